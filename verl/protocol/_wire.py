"""How a DataProto crosses a process boundary: each tensor as one flat byte buffer (pickled
out-of-band, borrowed without a copy where the caller allows it), plus upstream's
`serialize_*` / `deserialize_*` helpers built on the same encoding."""

from __future__ import annotations

import contextlib
import pickle
import threading
import warnings

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from verl.protocol._columns import _bits, _new_td, _numpy_copyable

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
