"""DataProto: the one data container that flows between the driver and the workers.

A `DataProto` is three things that share a leading batch dimension of length N:

- `batch`: a `tensordict.TensorDict` of tensors with `batch_size=[N]` (or `None` for a proto that
  carries only non-tensor data),
- `non_tensor_batch`: a dict of numpy arrays (normally `dtype=object`) of length N, for strings,
  dicts and other per-sample Python objects (`uid`, `data_source`, `reward_model`, ...),
- `meta_info`: a plain dict of per-batch values (`temperature`, `eos_token_id`, `metrics`, ...).

The public API follows upstream verl so its users' code works unchanged. Design decisions:

- Cheap on the hot path. The single controller chunks a proto before every data-parallel RPC and
  concatenates the results after it, so every row operation works per key on whole tensors
  (one concatenation or gather per key, slicing into views) and per key on whole numpy arrays
  (`np.concatenate`, fancy indexing); there is no per-row Python loop for tensors. `repeat`,
  `reorder`, `select_idxs` and padding are all one gather with a computed index. CPU tensors are
  concatenated and gathered on one thread, by numpy: torch's intra-op threads cost milliseconds to
  wake on a busy machine, far more than the copy itself (see `_cat_rows`).
- Pickling is ours, not tensordict's. torch pickles a view together with its whole storage, so
  a chunk of a 64 MB batch would ship 64 MB to each worker. `__reduce_ex__` instead writes each
  tensor as one flat, contiguous byte buffer covering exactly its own elements (any dtype,
  bfloat16 included), next to its dtype name and shape: pickle writes it as one block, and Ray
  moves it out-of-band into its object store without an intermediate copy (measured in
  benchmarks/bench_protocol.py).
  Unpickled tensors are always on the CPU (the driver may have no accelerator); call `.to()` on
  the receiving side.
- Derived protos (slices, chunks, selections) get a shallow copy of `meta_info`, so setting a key
  on a chunk never leaks into its parent; slices and chunks share tensor storage with the parent.
- `concat` merges `meta_info`: equal values are kept, `metrics` (a dict of name -> value or list
  of values, or a list of such dicts) become one dict of flat lists across all parts (so a mean
  over a list is the mean over all ranks), `timing` (name -> seconds) keeps the maximum (parallel
  ranks finish when the slowest does), and any other key whose values differ is an error.
- Ray is imported only inside `DataProtoFuture` methods; importing this module never imports ray.
- Auto-padding (upstream's `DataProtoConfig.auto_padding`, the `VERL_AUTO_PADDING` variable, or
  `from_dict(..., auto_padding=True)` for one proto) lets `chunk` split a length that does not
  divide evenly: chunks of ceil(n / chunks) rows, the last ones shorter (possibly empty). The
  worker group's DataProto dispatch modes pad every batch anyway (see `single_controller`), so this
  only changes a direct `chunk` call.
- A proto has exactly one batch dimension; `fold_batch_dim` / `unfold_batch_dim` reshape the rows
  (e.g. [n * k, ...] <-> [n, k, ...]) while keeping that invariant.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "collate_fn",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]

_SUPPORTED_DATALOADER_KWARGS = ("shuffle", "drop_last")


class _DataProtoConfigMeta(type):
    """Class-level settings of `DataProtoConfig` (a property on the metaclass reads like a class attribute)."""

    _config: dict = {}
    auto_padding_key = "_verl_auto_padding"

    @property
    def auto_padding(cls) -> bool:
        """Whether every proto may be chunked unevenly: set here, or by VERL_AUTO_PADDING=1/true."""
        by_env = os.environ.get("VERL_AUTO_PADDING", "false").strip().lower() in ("1", "true")
        return by_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings: `DataProtoConfig.auto_padding = True` (see the module docstring)."""


class DataProtoKeyError(KeyError):
    """A missing key; subclasses KeyError but prints its message without KeyError's quoting."""

    def __str__(self) -> str:
        return str(self.args[0])


def _missing_key_error(where: str, missing: Sequence, available) -> DataProtoKeyError:
    names = ", ".join(repr(k) for k in missing)
    return DataProtoKeyError(f"key {names} not found in {where}; available keys: {sorted(map(str, available))}")


def _to_object_array(values) -> np.ndarray:
    """A 1-D object array of len(values); np.array(list_of_equal_length_lists) would build 2-D."""
    if isinstance(values, np.ndarray):
        return values
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _values_equal(a, b) -> bool:
    """Equality for meta_info and non-tensor values: tensors, arrays, containers; NaN equals NaN."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        if torch.equal(a, b):
            return True
        return a.is_floating_point() and bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _numpy_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _numpy_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a is b:
        return True
    if a.shape != b.shape:
        return False
    if a.dtype != object and b.dtype != object:
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    return all(_values_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1)))


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of `tensor_dict2` to `tensor_dict1` (in place) and return it.

    Keys present in both must hold equal tensors; a conflict is an error naming the key.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            f"cannot union TensorDicts with batch sizes {tuple(tensor_dict1.batch_size)} and "
            f"{tuple(tensor_dict2.batch_size)}; both must describe the same rows"
        )
    existing = set(tensor_dict1.keys(include_nested=True, leaves_only=True))
    new_leaves = {}
    for key, value in tensor_dict2.items(include_nested=True, leaves_only=True):
        if key not in existing:
            new_leaves[key] = value
        elif not _values_equal(tensor_dict1.get(key), value):
            raise ValueError(
                f"union: batch key {key!r} exists on both sides with different values; rename or pop "
                "one of them before union (union only adds keys, it never overwrites)"
            )
    for key, value in new_leaves.items():  # only after every key checked: a conflict changes nothing
        tensor_dict1.set(key, value)
    return tensor_dict1


def union_numpy_dict(dict1: dict[str, np.ndarray], dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the arrays of `dict2` to `dict1` (in place) and return it; shared keys must be equal."""
    for key, value in dict2.items():
        if key in dict1 and not _numpy_equal(dict1[key], value):
            raise ValueError(
                f"union: non_tensor_batch key {key!r} exists on both sides with different values; rename or "
                "pop one of them before union (union only adds keys, it never overwrites)"
            )
    dict1.update(dict2)
    return dict1


def _union_meta_info(meta1: dict, meta2: dict) -> dict:
    for key, value in meta2.items():
        if key in meta1 and not _values_equal(meta1[key], value):
            raise ValueError(
                f"union: meta_info[{key!r}] differs between the two protos ({meta1[key]!r} vs {value!r}); "
                "make them equal or pop the key from one side before union"
            )
    meta1.update(meta2)
    return meta1


def list_of_dict_to_dict_of_list(list_of_dict: list[dict]) -> dict[str, list]:
    """[{'a': 1, 'b': 2}, {'a': 3, 'b': 4}] -> {'a': [1, 3], 'b': [2, 4]} (keys of the first dict)."""
    if not list_of_dict:
        return {}
    keys = list_of_dict[0].keys()
    return {key: [d[key] for d in list_of_dict] for key in keys}


def _merge_metrics(parts: list) -> dict[str, list]:
    """Merge per-part metrics into one dict of flat lists, in part order."""
    merged: dict[str, list] = {}
    for metrics in parts:
        for one in metrics if isinstance(metrics, list) else [metrics]:
            if not isinstance(one, dict):
                raise TypeError(
                    f"meta_info['metrics'] must be a dict of name -> value (or list of values), or a list of "
                    f"such dicts; got {type(one).__name__}"
                )
            for name, value in one.items():
                bucket = merged.setdefault(name, [])
                if isinstance(value, (list, tuple)):
                    bucket.extend(value)
                else:
                    bucket.append(value)
    return merged


def _merge_meta_info(metas: list[dict]) -> dict:
    merged: dict = {}
    metrics_parts = []
    timing: dict | None = None
    for meta in metas:
        for key, value in meta.items():
            if key == "metrics":
                if value is not None:
                    metrics_parts.append(value)
            elif key == "timing" and isinstance(value, dict):
                timing = {} if timing is None else timing
                for name, seconds in value.items():
                    timing[name] = max(timing.get(name, seconds), seconds)
            elif key not in merged:
                merged[key] = value
            elif not _values_equal(merged[key], value):
                raise ValueError(
                    f"DataProto.concat: meta_info[{key!r}] differs between the parts ({merged[key]!r} vs {value!r}) "
                    "and one value cannot represent them all; make it equal on every part, or report per-part "
                    "values under meta_info['metrics'] (lists there are concatenated)"
                )
    if metrics_parts:
        merged["metrics"] = _merge_metrics(metrics_parts)
    if timing is not None:
        merged["timing"] = timing
    return merged


def _new_td(source: dict, num_rows: int, device) -> TensorDict:
    return TensorDict(source, batch_size=[num_rows], device=device)


def _as_index(idxs, length: int) -> tuple[torch.Tensor, np.ndarray]:
    """Normalise list / numpy / tensor indices or a boolean mask to (int64 tensor, int64 numpy)."""
    if isinstance(idxs, torch.Tensor):
        idx_t = idxs.detach().cpu()
    elif isinstance(idxs, np.ndarray):
        idx_t = torch.from_numpy(idxs)
    elif isinstance(idxs, (list, tuple, range)):
        idx_t = torch.as_tensor(list(idxs)) if len(idxs) else torch.zeros(0, dtype=torch.int64)
    else:
        raise TypeError(f"indices must be a list, numpy array or torch tensor, got {type(idxs).__name__}")
    if idx_t.dtype == torch.bool:
        if idx_t.shape != (length,):
            raise IndexError(f"boolean mask of shape {tuple(idx_t.shape)} does not match the DataProto length {length}")
        idx_t = torch.nonzero(idx_t).reshape(-1)
    elif idx_t.dtype.is_floating_point or idx_t.dtype.is_complex or idx_t.dim() != 1:
        raise IndexError(
            f"indices must be a 1-D integer or boolean sequence, got {idx_t.dtype} of shape {tuple(idx_t.shape)}"
        )
    idx_t = idx_t.to(torch.int64)
    return idx_t, idx_t.numpy()


# ----------------------------------------------------------------------------------------------
# Row copies of CPU tensors on one thread.
#
# torch.cat and index gathers split any copy above ~32K elements over the intra-op thread pool and
# then wait for every pool thread. On a busy machine a sleeping pool thread takes milliseconds to be
# scheduled: joining two 0.5 MB halves took ~23 ms with torch's two threads and ~0.1 ms with one
# (2 cores, load ~7). The driver concatenates after every data-parallel call and gathers when it
# pads, repeats or reorders, so plain CPU tensors are copied by numpy instead (one thread, one
# memcpy per contiguous part) through an integer view of the same element size, which covers every
# torch dtype up to 8 bytes, bfloat16, bool and float8 included. Anything else (accelerator
# tensors, autograd, subclasses, sparse or nested layouts, conjugate views) goes to torch.
# numpy also allocates the result: it asks the kernel for transparent huge pages on large
# arrays, so a fresh 64 MB result takes ~500 page faults instead of ~16K (copy time 27 ms
# instead of ~100 ms, measured on the busy 2-core machine).

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy_copyable(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.dim() > 0
        and not tensor.is_nested
        and not tensor.is_quantized
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.element_size() in _BITS_DTYPE
    )


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy integer array of the same shape and strides (no copy)."""
    return tensor.view(_BITS_DTYPE[tensor.element_size()]).numpy()


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` along dim 0, on one thread for plain CPU tensors."""
    first = parts[0]
    if not all(_numpy_copyable(p) and p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts):
        return torch.cat(parts)
    return torch.from_numpy(np.concatenate([_bits(p) for p in parts], axis=0)).view(first.dtype)


def _take_rows(tensor: torch.Tensor, idx_t: torch.Tensor, idx_np: np.ndarray) -> torch.Tensor:
    """`tensor[idx_t]` (`idx_np`: the same int64 index), on one thread for plain CPU tensors."""
    if not _numpy_copyable(tensor):
        return tensor[idx_t]
    return torch.from_numpy(np.take(_bits(tensor), idx_np, axis=0)).view(tensor.dtype)


# ----------------------------------------------------------------------------------------------
# Compact serialisation of a TensorDict: exactly the bytes of each leaf, as one flat buffer.
#
# The state holds only builtins (tuples, strings, ints) around the buffers: Ray pickles every
# argument with cloudpickle, whose per-object hooks make each class, function or dtype object in
# the state cost microseconds; this layout pickles about twice as fast as a numpy-array-per-leaf one.
# With pickle protocol 5 each buffer is a `pickle.PickleBuffer`, which Ray ships out of band
# (no copy into the pickle); older protocols write it in band as numpy arrays.

_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _encode_tensor(tensor: torch.Tensor, out_of_band: bool) -> tuple:
    tensor = tensor.detach()
    if _numpy_copyable(tensor):
        raw = np.ascontiguousarray(_bits(tensor)).reshape(-1).view(np.uint8)  # copies only a strided view
    else:
        raw = tensor.to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()
    return (
        (pickle.PickleBuffer(raw) if out_of_band else raw),
        str(tensor.dtype).removeprefix("torch."),
        tuple(tensor.shape),
    )


_borrowing = threading.local()


@contextlib.contextmanager
def _borrow_buffers():
    """While open, tensors unpickled in this thread alias read-only buffers instead of copying them.

    Ray hands unpickling read-only views of its buffers, and `_decode_tensor` normally copies them
    so that every tensor owns writable memory. A caller that copies every tensor out of the
    unpickled protos before anything else can see them (the worker group, whose DataProto modes
    concatenate the results of a call) opens this around its `ray.get` and saves that copy: one
    pass over every returned byte on the driver. Only the protos' own batches are copied by the
    concat; a DataProto nested in a result's meta_info or non_tensor_batch would stay borrowed.
    """
    previous = getattr(_borrowing, "active", False)
    _borrowing.active = True
    try:
        yield
    finally:
        _borrowing.active = previous


def _decode_tensor(raw, dtype_name: str, shape) -> torch.Tensor:
    raw = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
    dtype = _DTYPE_BY_NAME[dtype_name]
    if raw.ctypes.data % 16:  # torch kernels expect aligned memory
        raw = raw.copy()
    elif not raw.flags.writeable:
        # Ray's views of its buffers are read-only; a tensor must own writable memory, so copy
        # unless the caller borrows (see `_borrow_buffers`). A plain pickle round trip needs no copy.
        if not getattr(_borrowing, "active", False):
            raw = raw.copy()
        else:
            with warnings.catch_warnings():  # torch warns that it cannot mark the tensor read-only
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(raw).view(dtype).reshape(shape)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _strided_leaves(td: TensorDictBase, prefix: tuple = ()) -> dict | None:
    """{key: tensor} for every leaf of a plain (possibly nested) TensorDict; None if any leaf is exotic."""
    if type(td) is not TensorDict:
        return None
    leaves = {}
    for key, value in td.items():
        if isinstance(value, TensorDictBase):
            nested = _strided_leaves(value, (*prefix, key))
            if nested is None:
                return None
            leaves.update(nested)
        elif isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested:
            leaves[(*prefix, key) if prefix else key] = value
        else:
            return None
    return leaves


def _encode_batch(batch: TensorDict | None, out_of_band: bool):
    if batch is None:
        return None
    leaves = _strided_leaves(batch)
    if leaves is None:
        # Non-tensor data, sparse/nested tensors or lazy stacks inside the batch: tensordict pickles those.
        return ("tensordict", pickle.dumps(batch.cpu(), protocol=pickle.HIGHEST_PROTOCOL))
    encoded = tuple((key, *_encode_tensor(value, out_of_band)) for key, value in leaves.items())
    return ("leaves", int(batch.batch_size[0]), encoded)


def _decode_batch(state) -> TensorDict | None:
    if state is None:
        return None
    if state[0] == "tensordict":
        return pickle.loads(state[1])
    _, num_rows, leaves = state
    return _new_td({key: _decode_tensor(raw, dtype, shape) for key, raw, dtype, shape in leaves}, num_rows, None)


def _rebuild_data_proto(batch_state, non_tensor_batch: dict, meta_info: dict, cls: type | None = None) -> DataProto:
    proto = object.__new__(cls or DataProto)
    proto.batch = _decode_batch(batch_state)
    proto.non_tensor_batch = non_tensor_batch
    proto.meta_info = meta_info
    return proto


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto (`proto[i]`): 0-dim TensorDict, per-key values, shared meta_info."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


def collate_fn(data: list[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems back into a DataProto (for `torch.utils.data.DataLoader(proto, ...)`)."""
    if not data:
        raise ValueError("collate_fn needs at least one DataProtoItem")
    batch = torch.stack([d.batch for d in data]) if data[0].batch is not None else None
    non_tensor = {key: _to_object_array([d.non_tensor_batch[key] for d in data]) for key in data[0].non_tensor_batch}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=data[0].meta_info)


@dataclass(eq=False)
class DataProto:
    """A batch of samples: tensors in `batch`, Python objects in `non_tensor_batch`, per-batch `meta_info`.

    Row operations (slicing, indexing, chunk, split, concat, repeat, reorder, padding) keep the
    three parts aligned; see the module docstring for the design decisions.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        # upstream accepts None for an empty part (DataProto(batch=td, non_tensor_batch=None))
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ------------------------------------------------------------------ construction and checks

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from a dict of tensors (same leading size) and a dict of per-row values.

        Non-tensor values may be lists/tuples (converted to 1-D object arrays) or numpy arrays.
        With no tensors, `batch` is None. `num_batch_dims` is upstream's argument and must be 1 (a
        DataProto has one batch dimension; see `fold_batch_dim` for grouped rows). `auto_padding`
        marks this proto as unevenly chunkable (see the module docstring).
        """
        if num_batch_dims != 1:
            raise ValueError(
                f"DataProto.from_dict(num_batch_dims={num_batch_dims}): a DataProto has exactly one batch dimension; "
                "build it with num_batch_dims=1 and group rows with fold_batch_dim(data, new_batch_size) if needed"
            )
        tensors = tensors or {}
        non_tensors = dict(non_tensors or {})
        batch = None
        if tensors:
            sizes = {}
            for key, value in tensors.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"tensors[{key!r}] is a {type(value).__name__}, not a torch.Tensor; pass per-row "
                        "Python objects through non_tensors instead"
                    )
                if value.dim() == 0:
                    raise ValueError(
                        f"tensors[{key!r}] is a 0-dim tensor; every tensor needs a leading batch dimension"
                    )
                sizes[key] = value.shape[0]
            if len(set(sizes.values())) != 1:
                raise ValueError(
                    f"tensors disagree on the batch size (leading dimension): {sizes}; every tensor must have one "
                    "row per sample"
                )
            batch = _new_td(dict(tensors), next(iter(sizes.values())), device=None)
        for key, value in non_tensors.items():
            if isinstance(value, torch.Tensor):
                raise TypeError(f"non_tensors[{key!r}] is a torch.Tensor; pass it through tensors instead")
            non_tensors[key] = _to_object_array(value)
        meta_info = dict(meta_info or {})
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Build from one dict: torch tensors go to `batch`, numpy arrays and lists to `non_tensor_batch`."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise TypeError(
                    f"from_single_dict: {key!r} is a {type(value).__name__}; values must be torch tensors "
                    "(-> batch) or numpy arrays / lists with one entry per row (-> non_tensor_batch). "
                    "Per-batch scalars belong in meta_info."
                )
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """The inverse of `to_tensordict`: tensors -> `batch`, per-row Python objects (NonTensorStack)
        -> `non_tensor_batch`, batch-wide objects (NonTensorData) -> `meta_info`."""
        from tensordict.tensorclass import NonTensorData, NonTensorStack

        if num_batch_dims != 1:
            raise ValueError(f"DataProto.from_tensordict(num_batch_dims={num_batch_dims}): only 1 is supported")
        meta_info = dict(meta_info or {})
        tensors, non_tensors = {}, {}
        for key in list(tensor_dict.keys()):
            value = tensor_dict.get(key)
            if isinstance(value, NonTensorStack):
                non_tensors[key] = _to_object_array(value.tolist())
            elif isinstance(value, NonTensorData):
                meta_info[key] = value.data
            else:
                tensors[key] = value
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict holding everything: tensors as they are, each non-tensor column as a
        NonTensorStack (one object per row), each `meta_info` entry as NonTensorData."""
        from verl.utils import tensordict_utils as tu

        tensors = {} if self.batch is None else dict(self.batch.items())
        clash = sorted(set(tensors) & set(self.non_tensor_batch))
        if clash:
            raise ValueError(f"to_tensordict: keys {clash} are both in batch and non_tensor_batch")
        per_row: dict[str, Any] = {**tensors, **{k: list(v) for k, v in self.non_tensor_batch.items()}}
        return tu.get_tensordict(per_row, dict(self.meta_info))

    def check_consistency(self) -> None:
        """Check that batch and non_tensor_batch describe the same rows; raise a clear error if not."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDictBase):
                raise TypeError(
                    f"DataProto.batch must be a tensordict.TensorDict or None, got {type(self.batch).__name__}; "
                    "build protos with DataProto.from_dict(tensors=...)"
                )
            if self.batch.batch_dims != 1:
                raise ValueError(
                    f"DataProto.batch must have exactly one batch dimension, got batch_size="
                    f"{list(self.batch.batch_size)}"
                )
        if not isinstance(self.non_tensor_batch, dict):
            raise TypeError(f"DataProto.non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}")
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"DataProto.meta_info must be a dict, got {type(self.meta_info).__name__}")
        lengths = {}
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"non_tensor_batch[{key!r}] is a {type(value).__name__}, not a numpy array; wrap it with "
                    "np.array(values, dtype=object) or build the proto with DataProto.from_dict, which converts lists"
                )
            if value.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}] is a 0-dim array; it needs one entry per row")
            lengths[key] = len(value)
        if self.batch is not None:
            expected = int(self.batch.batch_size[0])
            wrong = {k: n for k, n in lengths.items() if n != expected}
            if wrong:
                raise ValueError(
                    f"non_tensor_batch lengths {wrong} differ from the batch size {expected} of the tensors "
                    f"{sorted(self.batch.keys())}; every entry needs exactly one row per sample"
                )
        elif len(set(lengths.values())) > 1:
            raise ValueError(f"non_tensor_batch entries have different lengths {lengths}; they must all be equal")

    # ------------------------------------------------------------------ basics

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __repr__(self) -> str:
        lines = [f"DataProto(len={len(self)}"]
        if self.batch is None:
            lines.append("  batch: None")
        else:
            lines.append("  batch:")
            for key, value in self.batch.items(include_nested=True, leaves_only=True):
                name = ".".join(key) if isinstance(key, tuple) else key
                lines.append(f"    {name}: {tuple(value.shape)} {value.dtype} {value.device}")
        if self.non_tensor_batch:
            lines.append("  non_tensor_batch:")
            for key, value in self.non_tensor_batch.items():
                lines.append(f"    {key}: {value.shape} {value.dtype}")
        lines.append(f"  meta_info keys: {list(self.meta_info.keys())})")
        return "\n".join(lines)

    def _derive(self, batch, non_tensor_batch) -> DataProto:
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(self.meta_info))

    def __getitem__(self, item):
        """int -> DataProtoItem; slice -> view; list / numpy / tensor indices or bool mask -> gathered copy."""
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = len(self)
            index = int(item) + n if item < 0 else int(item)
            if not 0 <= index < n:
                raise IndexError(f"index {int(item)} is out of range for a DataProto of length {n}")
            batch = self.batch[index] if self.batch is not None else None
            return DataProtoItem(
                batch=batch,
                non_tensor_batch={k: v[index] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, range, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(
            f"DataProto indices must be an int, a slice, or a list/array/tensor of indices or a boolean mask; "
            f"got {type(item).__name__}"
        )

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows `start:end:step` as views of this proto's tensors and arrays (no copy)."""
        s = slice(start, end, step)
        num_rows = len(range(*s.indices(len(self))))
        batch = None
        if self.batch is not None:
            batch = _new_td({k: v[s] for k, v in self.batch.items()}, num_rows, self.batch.device)
        return self._derive(batch, {k: v[s] for k, v in self.non_tensor_batch.items()})

    def select_idxs(self, idxs) -> DataProto:
        """Rows at the given indices (list / numpy / tensor) or where a boolean mask is True."""
        idx_t, idx_np = _as_index(idxs, len(self))
        return self._take(idx_t, idx_np)

    def _take(self, idx_t: torch.Tensor, idx_np: np.ndarray) -> DataProto:
        batch = None
        if self.batch is not None:
            if self.batch.device is not None and self.batch.device.type != "cpu":
                idx_t = idx_t.to(self.batch.device)
            batch = _new_td(
                {k: _take_rows(v, idx_t, idx_np) for k, v in self.batch.items()}, len(idx_np), self.batch.device
            )
        return self._derive(batch, {k: v[idx_np] for k, v in self.non_tensor_batch.items()})

    def to(self, device) -> DataProto:
        """Move the tensors to `device` (in place, like upstream) and return self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    # ------------------------------------------------------------------ keys

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A proto with only the given keys (None keeps every key of that part); tensors are shared."""
        if batch_keys is not None:
            batch_keys = [batch_keys] if isinstance(batch_keys, str) else list(batch_keys)
            available = [] if self.batch is None else list(self.batch.keys())
            missing = [k for k in batch_keys if k not in available]
            if missing:
                raise _missing_key_error("DataProto.batch", missing, available)
            source = {k: self.batch[k] for k in batch_keys} if batch_keys else {}
        else:
            source = None if self.batch is None else dict(self.batch.items())
        batch = None if source is None or self.batch is None else _new_td(source, len(self), self.batch.device)
        non_tensor = self._pick(self.non_tensor_batch, non_tensor_batch_keys, "DataProto.non_tensor_batch")
        meta = self._pick(self.meta_info, meta_info_keys, "DataProto.meta_info")
        out = type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
        return copy.deepcopy(out) if deepcopy else out

    @staticmethod
    def _pick(source: dict, keys, where: str) -> dict:
        if keys is None:
            return dict(source)
        keys = [keys] if isinstance(keys, str) else list(keys)
        missing = [k for k in keys if k not in source]
        if missing:
            raise _missing_key_error(where, missing, source.keys())
        return {k: source[k] for k in keys}

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from this proto and return them as a new proto."""
        batch_keys = [batch_keys] if isinstance(batch_keys, str) else list(batch_keys or [])
        non_tensor_batch_keys = (
            [non_tensor_batch_keys] if isinstance(non_tensor_batch_keys, str) else list(non_tensor_batch_keys or [])
        )
        meta_info_keys = [meta_info_keys] if isinstance(meta_info_keys, str) else list(meta_info_keys or [])
        available = [] if self.batch is None else list(self.batch.keys())
        for keys, pool, where in (
            (batch_keys, available, "DataProto.batch"),
            (non_tensor_batch_keys, self.non_tensor_batch.keys(), "DataProto.non_tensor_batch"),
            (meta_info_keys, self.meta_info.keys(), "DataProto.meta_info"),
        ):
            missing = [k for k in keys if k not in pool]
            if missing:
                raise _missing_key_error(where, missing, pool)
        batch = None
        if batch_keys:
            batch = _new_td({k: self.batch.pop(k) for k in batch_keys}, len(self), self.batch.device)
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str] | None = None, new_keys: str | Sequence[str] | None = None):
        """Rename keys (in place) in `batch` or `non_tensor_batch`, wherever each old key lives; returns self."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename got {len(old_keys)} old keys {old_keys} but {len(new_keys)} new keys {new_keys}")
        batch_keys = [] if self.batch is None else list(self.batch.keys())
        for old, new in zip(old_keys, new_keys):
            if old in batch_keys:
                self.batch.rename_key_(old, new)
                batch_keys = list(self.batch.keys())
            elif old in self.non_tensor_batch:
                self.non_tensor_batch[new] = self.non_tensor_batch.pop(old)
            else:
                raise _missing_key_error(
                    "DataProto.batch or non_tensor_batch", [old], [*batch_keys, *self.non_tensor_batch]
                )
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add `other`'s keys to this proto (in place) and return self; shared keys must be equal."""
        if len(self) != len(other) and (self.batch is not None or self.non_tensor_batch):
            raise ValueError(f"union needs protos of the same length, got {len(self)} and {len(other)}")
        # Merge into shallow copies and assign at the end, so a conflict leaves self unchanged.
        batch = self.batch
        if other.batch is not None:
            if batch is None:
                batch = _new_td(dict(other.batch.items()), len(other), other.batch.device)
            else:
                batch = union_tensor_dict(_new_td(dict(batch.items()), len(self), batch.device), other.batch)
        non_tensor = union_numpy_dict(dict(self.non_tensor_batch), other.non_tensor_batch)
        meta_info = _union_meta_info(dict(self.meta_info), other.meta_info)
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor, meta_info
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ splitting and joining

    def is_padding_enabled(self) -> bool:
        """Whether this proto may be chunked unevenly (its own flag or `DataProtoConfig.auto_padding`)."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append `padding_size` copies of the first row (`padding_candidate="first"`) or of the last
        row (anything else, upstream's default), in place."""
        if padding_size < 0:
            raise ValueError(f"padding_size must be >= 0, got {padding_size}")
        if padding_size == 0:
            return
        if len(self) == 0:
            raise ValueError("cannot pad an empty DataProto: there is no row to repeat")
        row = 0 if padding_candidate == "first" else len(self) - 1
        idx = torch.cat([torch.arange(len(self)), torch.full((padding_size,), row, dtype=torch.int64)])
        padded = self._take(idx, idx.numpy())
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def sample_level_repeat(self, repeat_times) -> DataProto:
        """Repeat row i `repeat_times[i]` times, rows kept together: counts [2, 1] turn [a, b] into
        [a, a, b]; `repeat_times` is a list, tuple, 1-D numpy array or tensor of counts >= 0."""
        if isinstance(repeat_times, torch.Tensor):
            repeat_times = repeat_times.detach().cpu().numpy()
        counts = np.asarray(repeat_times)
        if counts.ndim != 1 or counts.shape[0] != len(self):
            raise ValueError(
                f"sample_level_repeat needs one count per row ({len(self)}), got shape {tuple(counts.shape)}"
            )
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise ValueError(f"sample_level_repeat counts must be non-negative integers, got {counts.tolist()}")
        idx_np = np.repeat(np.arange(len(self), dtype=np.int64), counts.astype(np.int64))
        return self._take(torch.from_numpy(idx_np), idx_np)

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut the second dimension of each key in `split_keys` into `n_split` chunks that become rows
        ([B, C, ...] -> [B * n_split, C / n_split, ...], row i's chunks adjacent); every other key is
        repeated `n_split` times per row (interleaved) to stay aligned."""
        split_keys = set(split_keys or ())
        n = len(self)
        missing = split_keys - set(self.batch.keys() if self.batch is not None else ()) - set(self.non_tensor_batch)
        if missing:
            raise _missing_key_error(
                "DataProto",
                sorted(missing),
                [*(self.batch.keys() if self.batch is not None else ()), *self.non_tensor_batch],
            )

        def unfold(key, value):
            if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == object:
                # a column of per-row sequences (what from_dict makes of a list of lists)
                pieces = []
                for item in value:
                    if not hasattr(item, "__len__") or len(item) % n_split:
                        raise ValueError(
                            f"unfold_column_chunks: an entry of {key!r} ({item!r}) does not split into {n_split} chunks"
                        )
                    size = len(item) // n_split
                    pieces.extend(list(item[i * size : (i + 1) * size]) for i in range(n_split))
                return _to_object_array(pieces)
            if value.ndim < 2 or value.shape[1] % n_split:
                raise ValueError(
                    f"unfold_column_chunks: {key!r} has shape {tuple(value.shape)}; its second dimension must divide "
                    f"into {n_split} chunks"
                )
            return value.reshape(n * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            source = {
                k: unfold(k, v) if k in split_keys else torch.repeat_interleave(v, n_split, dim=0)
                for k, v in self.batch.items()
            }
            batch = _new_td(source, n * n_split, self.batch.device)
        non_tensor = {
            k: unfold(k, v) if k in split_keys else np.repeat(v, n_split, axis=0)
            for k, v in self.non_tensor_batch.items()
        }
        return self._derive(batch, non_tensor)

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` parts (views). The length must divide evenly unless auto-padding is
        enabled: then parts hold ceil(n / chunks) rows, the last ones fewer."""
        if not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise ValueError(f"chunk needs a positive number of chunks, got {chunks!r}")
        n = len(self)
        if n % chunks and self.is_padding_enabled():
            size = -(-n // chunks)
            return [self.slice(min(i * size, n), min((i + 1) * size, n)) for i in range(chunks)]
        if n % chunks:
            raise ValueError(
                f"DataProto.chunk({chunks}): {n} rows do not split evenly into {chunks} chunks. Pad first with "
                f"`padded, pad_size = pad_dataproto_to_divisor(data, {chunks})` and drop the padding from the "
                f"concatenated result with `unpad_dataproto(output, pad_size)`, or use a batch size divisible by {chunks}"
            )
        size = n // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of `split_size` rows (views); the last part may be shorter."""
        if not isinstance(split_size, (int, np.integer)) or split_size < 1:
            raise ValueError(f"split needs a positive split_size, got {split_size!r}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Concatenate protos along the batch dimension; meta_info is merged (see module docstring)."""
        data = list(data)
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        has_batch = [d.batch is not None for d in data]
        if any(has_batch) and not all(has_batch):
            raise ValueError(
                f"DataProto.concat: parts {[i for i, h in enumerate(has_batch) if not h]} have no tensors (batch=None) "
                "while others do; all parts must carry the same keys"
            )
        _check_same_keys([set(d.batch.keys()) if d.batch is not None else set() for d in data], "batch")
        _check_same_keys([set(d.non_tensor_batch) for d in data], "non_tensor_batch")
        total = sum(len(d) for d in data)
        batch = None
        if data[0].batch is not None:
            keys = data[0].batch.keys()  # iterating a TensorDict itself would walk its rows
            device = data[0].batch.device
            batch = _new_td({k: _cat_rows([d.batch[k] for d in data]) for k in keys}, total, device)
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in data[0].non_tensor_batch}
        meta_info = _merge_meta_info([d.meta_info for d in data])
        return type(data[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row `repeat_times` times.

        interleave=True:  [a, b] -> [a, a, b, b]   (the samples of one prompt stay adjacent)
        interleave=False: [a, b] -> [a, b, a, b]
        """
        if not isinstance(repeat_times, (int, np.integer)) or repeat_times < 1:
            raise ValueError(f"repeat_times must be a positive integer, got {repeat_times!r}")
        n = len(self)
        rows = torch.arange(n * repeat_times)
        idx = rows // repeat_times if interleave else rows % max(n, 1)
        return self._take(idx, idx.numpy())

    def reorder(self, indices) -> None:
        """Permute the rows in place: row i becomes old row indices[i]."""
        idx_t, idx_np = _as_index(indices, len(self))
        reordered = self._take(idx_t, idx_np)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def make_iterator(
        self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[DataProto]:
        """Iterate over mini-batches of `mini_batch_size` rows for `epochs` passes.

        `dataloader_kwargs` accepts `shuffle` (default False) and `drop_last` (default False: the
        length must divide by `mini_batch_size`; True: the incomplete last mini-batch is dropped).
        With a `seed` the order is deterministic and identical to `torch.utils.data.DataLoader(...,
        shuffle=True, generator=torch.Generator().manual_seed(seed))`; each epoch draws a new permutation.
        """
        dataloader_kwargs = dict(dataloader_kwargs or {})
        unknown = sorted(set(dataloader_kwargs) - set(_SUPPORTED_DATALOADER_KWARGS))
        if unknown:
            raise ValueError(
                f"make_iterator: unsupported dataloader_kwargs {unknown}; supported: {list(_SUPPORTED_DATALOADER_KWARGS)} "
                "(mini-batches are gathered directly, without a DataLoader)"
            )
        n = len(self)
        if not isinstance(mini_batch_size, (int, np.integer)) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive integer, got {mini_batch_size!r}")
        drop_last = bool(dataloader_kwargs.get("drop_last", False))
        if n % mini_batch_size and not drop_last:
            raise ValueError(
                f"make_iterator: {n} rows are not divisible by mini_batch_size={mini_batch_size}; choose a mini-batch "
                f"size that divides the batch, pad with pad_dataproto_to_divisor(data, {mini_batch_size}), or pass "
                "dataloader_kwargs={'drop_last': True} to skip the incomplete last mini-batch"
            )
        shuffle = bool(dataloader_kwargs.get("shuffle", False))
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return self._iterate(mini_batch_size, epochs, shuffle, generator)

    def _iterate(self, mini_batch_size: int, epochs: int, shuffle: bool, generator) -> Iterator[DataProto]:
        n = len(self)
        num_full = n - n % mini_batch_size
        for _ in range(epochs):
            if shuffle:
                if generator is None:
                    order = torch.randperm(n)
                else:
                    # Same generator draws as a DataLoader(shuffle=True, generator=...) epoch: a base
                    # seed, the permutation, then the sampler's (here unused) tail permutation, so
                    # seeded orders match upstream verl, which iterated such a DataLoader.
                    torch.empty((), dtype=torch.int64).random_(generator=generator)
                    order = torch.randperm(n, generator=generator)
                    torch.randperm(n, generator=generator)
                for start in range(0, num_full, mini_batch_size):
                    part = order[start : start + mini_batch_size]
                    yield self._take(part, part.numpy())
            else:
                for start in range(0, num_full, mini_batch_size):
                    yield self.slice(start, start + mini_batch_size)

    # ------------------------------------------------------------------ persistence

    def __reduce_ex__(self, protocol):
        # Our own state instead of the dataclass fields (see "Compact serialisation" above).
        args = (_encode_batch(self.batch, out_of_band=protocol >= 5), self.non_tensor_batch, self.meta_info)
        return _rebuild_data_proto, args if type(self) is DataProto else (*args, type(self))

    def __copy__(self) -> DataProto:
        batch = None if self.batch is None else _new_td(dict(self.batch.items()), len(self), self.batch.device)
        return type(self)(batch=batch, non_tensor_batch=dict(self.non_tensor_batch), meta_info=dict(self.meta_info))

    def __deepcopy__(self, memo) -> DataProto:
        return type(self)(
            batch=None if self.batch is None else self.batch.clone(),
            non_tensor_batch=copy.deepcopy(self.non_tensor_batch, memo),
            meta_info=copy.deepcopy(self.meta_info, memo),
        )

    def save_to_disk(self, filepath) -> None:
        with open(filepath, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def load_from_disk(filepath) -> DataProto:
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{filepath} holds a {type(data).__name__}, not a DataProto saved with save_to_disk")
        return data


def _check_same_keys(key_sets: list[set], part: str) -> None:
    first = key_sets[0]
    for i, keys in enumerate(key_sets[1:], start=1):
        if keys != first:
            raise ValueError(
                f"DataProto.concat: part {i} has {part} keys {sorted(map(str, keys))} but part 0 has "
                f"{sorted(map(str, first))}; all parts must carry the same keys (missing in part {i}: "
                f"{sorted(map(str, first - keys))}, extra: {sorted(map(str, keys - first))})"
            )


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Group consecutive rows: [B, ...] -> [new_batch_size, B / new_batch_size, ...] for every tensor
    and non-tensor column (e.g. the n samples of each prompt after `repeat(n)` become one row)."""
    n = len(data)
    if new_batch_size < 1 or n % new_batch_size:
        raise ValueError(f"fold_batch_dim: {n} rows do not fold into {new_batch_size} rows of equal size")
    group = n // new_batch_size
    batch = None
    if data.batch is not None:
        source = {k: v.reshape(new_batch_size, group, *v.shape[1:]) for k, v in data.batch.items()}
        batch = _new_td(source, new_batch_size, data.batch.device)
    non_tensor = {k: v.reshape(new_batch_size, group, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Flatten the first `batch_dims` dimensions of every column into rows (undoes `fold_batch_dim`);
    all columns must agree on those dimensions."""
    shapes = {k: tuple(v.shape[:batch_dims]) for k, v in ([] if data.batch is None else data.batch.items())}
    shapes.update({k: tuple(v.shape[:batch_dims]) for k, v in data.non_tensor_batch.items()})
    if len(set(shapes.values())) > 1 or any(len(s) < batch_dims for s in shapes.values()):
        raise ValueError(f"unfold_batch_dim: the columns do not share {batch_dims} leading dimensions: {shapes}")
    lead = next(iter(shapes.values()), (0,))
    n = int(np.prod(lead))
    batch = None
    if data.batch is not None:
        source = {k: v.reshape(n, *v.shape[batch_dims:]) for k, v in data.batch.items()}
        batch = _new_td(source, n, data.batch.device)
    non_tensor = {k: v.reshape(n, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(dtype name, shape, its bytes as a flat uint8 numpy array): a tensor in plain builtins + bytes,
    any dtype (bfloat16 included), on any device (copied to the CPU)."""
    raw, dtype_name, shape = _encode_tensor(obj, out_of_band=False)
    return dtype_name, shape, raw


def deserialize_single_tensor(arr) -> torch.Tensor:
    """The tensor of `serialize_single_tensor`'s (dtype name, shape, bytes); it owns a copy of the bytes."""
    dtype_name, shape, data = arr
    if dtype_name not in _DTYPE_BY_NAME:
        raise ValueError(f"unknown tensor dtype {dtype_name!r} in a serialized tensor")
    if isinstance(data, np.ndarray):
        raw = np.array(data.reshape(-1).view(np.uint8), copy=True)
    else:  # bytes, bytearray or memoryview
        raw = np.frombuffer(bytearray(data), dtype=np.uint8)
    return torch.from_numpy(raw).view(_DTYPE_BY_NAME[dtype_name]).reshape(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """(batch size, device name or None, {key: encoding}): a regular tensor as
    `serialize_single_tensor`, a nested tensor as (layout name, [encoding of each row])."""
    items = {}
    for key, value in batch.items():
        if value.is_nested:
            layout = str(value.layout).removeprefix("torch.")
            items[key] = (layout, [serialize_single_tensor(row) for row in value.unbind()])
        else:
            items[key] = serialize_single_tensor(value)
    return tuple(batch.batch_size), None if batch.device is None else str(batch.device), items


def deserialize_tensordict(arr) -> TensorDict:
    """The TensorDict of `serialize_tensordict`'s output."""
    batch_size, device, items = arr
    decoded = {}
    for key, value in items.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, rows = value
            decoded[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(r) for r in rows], layout=getattr(torch, layout)
            )
        else:
            raise ValueError(f"{key!r}: a tensor encoding has 3 fields, a nested one 2; got {len(value)}")
    return TensorDict(source=decoded, batch_size=batch_size, device=device)


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad `data` with copies of its first rows until its length divides by `size_divisor`.

    Returns `(padded, pad_size)`; `unpad_dataproto(result, pad_size)` drops the padding again.
    Padding rows repeat rows from the start (cycling when pad_size exceeds the length), so they
    are valid samples for any worker; their outputs are simply discarded.
    """
    if not isinstance(size_divisor, (int, np.integer)) or size_divisor < 1:
        raise ValueError(f"size_divisor must be a positive integer, got {size_divisor!r}")
    n = len(data)
    pad_size = -n % size_divisor
    if pad_size == 0:  # an empty proto divides by anything, so n > 0 below
        return data, 0
    idx = torch.arange(n + pad_size) % n
    return data._take(idx, idx.numpy()), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by `pad_dataproto_to_divisor`."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size={pad_size} is outside [0, {len(data)}] for a DataProto of length {len(data)}")
    return data[: len(data) - pad_size] if pad_size else data


# ----------------------------------------------------------------------------------------------
# Lazy chunk/concat over Ray object refs.


def _pick_chunk(data: DataProto, index: int, chunks: int, inner: Callable | None) -> DataProto:
    if inner is not None:
        data = inner(data)
    return data.chunk(chunks)[index]


@dataclass(eq=False)
class DataProtoFuture:
    """A DataProto not yet materialised: the outputs of several workers, still in Ray's object store.

    `get()` fetches `futures` (ray.ObjectRefs to DataProtos), merges them with `collect_fn`
    (normally `DataProto.concat`) and, when set, applies `dispatch_fn` (e.g. "take chunk i of n").
    This lets the driver pass one worker group's output straight to the next group without
    pulling the data through the driver: each worker calls `get()` for its own chunk.
    """

    collect_fn: Callable
    futures: list
    dispatch_fn: Callable | None = None

    @staticmethod
    def concat(data: list) -> DataProtoFuture:
        """A future for the concatenation of the DataProtos behind `data` (a list of ray.ObjectRefs)."""
        import ray

        data = list(data)
        bad = [type(x).__name__ for x in data if not isinstance(x, ray.ObjectRef)]
        if bad:
            raise TypeError(f"DataProtoFuture.concat expects ray.ObjectRefs, got {bad}")
        return DataProtoFuture(collect_fn=DataProto.concat, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """`chunks` futures; the i-th yields chunk i of this future's result after `get()`."""
        if not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise ValueError(f"chunk needs a positive number of chunks, got {chunks!r}")
        return [
            DataProtoFuture(
                collect_fn=self.collect_fn,
                futures=self.futures,
                dispatch_fn=partial(_pick_chunk, index=i, chunks=int(chunks), inner=self.dispatch_fn),
            )
            for i in range(chunks)
        ]

    def get(self) -> DataProto:
        import ray

        outputs = ray.get(self.futures)
        bad = [type(o).__name__ for o in outputs if not isinstance(o, DataProto)]
        if bad:
            raise TypeError(f"DataProtoFuture.get: the futures resolved to {bad}, expected DataProtos")
        output = self.collect_fn(outputs)
        if self.dispatch_fn is not None:
            output = self.dispatch_fn(output)
        return output
