"""Load checkpoints without executing code from them: the `weights_only=True` rule, applied to DCP too.

A checkpoint is data someone else may have written (a shared directory, a downloaded run), and
Python's pickle runs whatever a file tells it to. `torch.load(..., weights_only=True)` only rebuilds
tensors and plain containers; everything verl writes with `torch.save` is kept in that subset
(RNG states included: numpy's generator state is stored as a tensor, see `numpy_rng_state`; batches
held across a checkpoint, such as asynchronous rollouts waiting to be trained, go through
`to_plain` / `from_plain`, which also store a vision-language row's PIL images as their mode, size
and pixel bytes).

`torch.distributed.checkpoint` (DCP), which holds the sharded model and optimizer, is the
exception in torch itself: it reads its `.metadata` file with plain `pickle.load` and the
non-tensor entries (optimizer hyper-parameters) with `torch.load(weights_only=False)`. `dcp_load`
closes both: the metadata goes through an unpickler that only resolves DCP's own metadata classes,
torch dtypes/sizes/layouts and pathlib paths, and non-tensor entries through `weights_only=True`.
A checkpoint that needs anything else fails with `UnsafeCheckpointError` instead of running it.
"""

from __future__ import annotations

import io
import os
import pickle
import sys

import numpy as np
import torch

__all__ = [
    "UnsafeCheckpointError",
    "dcp_load",
    "dcp_metadata",
    "from_plain",
    "numpy_rng_state",
    "set_numpy_rng_state",
    "to_plain",
    "torch_load",
]

# (module, name) pairs a DCP .metadata file may reference; checked by `_MetadataUnpickler`.
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file references Python objects outside the safe set (it could run code)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        allowed = (
            (module, name) in _ALLOWED_GLOBALS
            or module in _DCP_METADATA_MODULES
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise UnsafeCheckpointError(
                f"{self._path} references {module}.{name}, which a checkpoint's metadata never needs; refusing to "
                "load it because unpickling it could run arbitrary code. Only load checkpoints you or your own "
                "runs wrote"
            )
        return super().find_class(module, name)


def _reader_and_planner(path: str):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            file = os.path.join(path, name)
            with open(file, "rb") as f:
                metadata = _MetadataUnpickler(f, file).load()
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsafeCheckpointError(
                    f"entry {read_item.dest_index.fqn!r} of checkpoint {path} is not plain data ({e}); refusing to "
                    "load it because unpickling it could run arbitrary code"
                ) from e
            super().load_bytes(read_item, _saved(obj))

    return SafeFileSystemReader(path), WeightsOnlyLoadPlanner()


def _saved(obj) -> io.BytesIO:
    # DefaultLoadPlanner.load_bytes reads the object back with torch.load; hand it the already
    # checked object re-serialised, so the (unsafe) parent implementation only sees plain data.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def dcp_metadata(path: str):
    """The `Metadata` of the DCP checkpoint at `path` (what it holds), read with the safe unpickler."""
    reader, _ = _reader_and_planner(path)
    return reader.read_metadata()


def dcp_load(state_dict: dict, path: str, **kwargs) -> None:
    """`torch.distributed.checkpoint.load(state_dict, checkpoint_id=path)` without pickle's code execution."""
    import torch.distributed.checkpoint as dcp

    reader, planner = _reader_and_planner(path)
    reader.read_metadata()  # fail here, with our message, rather than wrapped inside DCP's collective load
    dcp.load(state_dict, storage_reader=reader, planner=planner, **kwargs)


def torch_load(path: str, what: str):
    """`torch.load(path, weights_only=True)` with an error that says which file and what to do."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{what} {path} holds Python objects other than tensors and plain containers ({e}); verl loads "
            "checkpoints with weights_only=True so that a checkpoint cannot run code. Re-save it with this version "
            "of verl, or only if you wrote the file yourself, convert it offline"
        ) from e


_TAG = "__verl_plain__"


def to_plain(obj):
    """`obj` with every DataProto, numpy array and numpy scalar turned into tensors and plain containers,
    so that `torch.save` writes something `torch.load(weights_only=True)` reads (see `from_plain`).
    Dicts, lists and tuples are converted recursively; other values are left as they are."""
    from verl.protocol import DataProto

    if isinstance(obj, DataProto):
        batch = None if obj.batch is None else {k: v for k, v in obj.batch.items()}
        return {
            _TAG: "DataProto",
            "batch": batch,
            "batch_size": None if obj.batch is None else int(obj.batch.batch_size[0]),
            "non_tensor_batch": {k: to_plain(v) for k, v in obj.non_tensor_batch.items()},
            "meta_info": to_plain(dict(obj.meta_info)),
        }
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "biuf":
            return {_TAG: "ndarray", "tensor": torch.from_numpy(np.ascontiguousarray(obj)), "dtype": obj.dtype.str}
        return {_TAG: "ndarray_items", "items": [to_plain(x) for x in obj.ravel().tolist()], "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_plain(v) for v in obj)
    pil = sys.modules.get("PIL.Image")  # an object can only be a PIL image once PIL is imported
    if pil is not None and isinstance(obj, pil.Image):
        pixels = torch.frombuffer(bytearray(obj.tobytes()), dtype=torch.uint8)
        return {_TAG: "pil_image", "mode": obj.mode, "size": list(obj.size), "pixels": pixels}
    return obj


def from_plain(obj):
    """Inverse of `to_plain` (numpy scalars come back as Python numbers)."""
    if isinstance(obj, dict) and _TAG in obj:
        kind = obj[_TAG]
        if kind == "ndarray":
            return obj["tensor"].numpy().astype(np.dtype(obj["dtype"]), copy=False)
        if kind == "ndarray_items":
            items = [from_plain(x) for x in obj["items"]]
            array = np.empty(len(items), dtype=object)
            array[:] = items if items else array
            return array.reshape(obj["shape"])
        if kind == "pil_image":
            from PIL import Image

            return Image.frombytes(obj["mode"], tuple(obj["size"]), obj["pixels"].numpy().tobytes())
        if kind == "DataProto":
            from tensordict import TensorDict

            from verl.protocol import DataProto

            batch = None
            if obj["batch"] is not None:
                batch = TensorDict(obj["batch"], batch_size=[obj["batch_size"]])
            return DataProto(
                batch=batch,
                non_tensor_batch={k: from_plain(v) for k, v in obj["non_tensor_batch"].items()},
                meta_info=from_plain(obj["meta_info"]),
            )
        raise ValueError(f"unknown plain-data tag {kind!r} in a checkpoint")
    if isinstance(obj, dict):
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(from_plain(v) for v in obj)
    return obj


def numpy_rng_state() -> tuple:
    """`np.random.get_state()` with the key array as an int64 tensor (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian))


def set_numpy_rng_state(state) -> None:
    """Inverse of `numpy_rng_state` (also accepts numpy's own state tuple)."""
    name, keys, pos, has_gauss, cached_gaussian = state
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy()
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
