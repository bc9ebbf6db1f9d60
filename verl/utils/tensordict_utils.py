"""Helpers for TensorDicts that mix tensors, jagged (nested) tensors and non-tensor data
(upstream's `verl.utils.tensordict_utils`, used by code written against its TensorDict interface).

A TensorDict here holds three kinds of values under one batch dimension:

- tensors, regular or jagged nested tensors (`torch.nested`, `layout=torch.jagged`) for rows of
  different lengths;
- `NonTensorStack`: one Python object per row (a list of turn scores, a dict of extra info);
- `NonTensorData`: one Python object for the whole batch (metadata, like `DataProto.meta_info`).

Row operations (`index_select_tensor_dict`, `chunk_tensordict`, `concat_tensordict`,
`pad_to_divisor`) handle jagged tensors by unbinding and re-nesting them, because torch's own
indexing and chunking do not support every jagged layout (3-D jagged tensors, for instance). The
accessors `get` / `pop` (and `get_keys` / `pop_keys`) return Python values: a tensor as is, a
`NonTensorStack` as a list, a `NonTensorData` as its object.

Inconsistent inputs (different batch sizes, mixed nested and regular keys across parts, a key
with different values on the two sides of a union) raise `TensorDictError` naming the key: a
`ValueError` that is also an `AssertionError`, because upstream checks these with `assert`.

`concat_tensordict` keeps the first part's value of a batch-wide `NonTensorData` key, as upstream
does: tensordict up to 0.10 keeps the first value when `torch.cat` joins NonTensorData, later
releases turn differing values into a per-row `NonTensorStack`; this function gives upstream's
result with either.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack

__all__ = [
    "TensorDictError",
    "assert_tensordict_eq",
    "assign_non_tensor",
    "assign_non_tensor_data",
    "assign_non_tensor_stack",
    "chunk_tensordict",
    "concat_nested_tensors",
    "concat_tensordict",
    "concat_tensordict_with_none_bsz",
    "contiguous",
    "get",
    "get_keys",
    "get_non_tensor_data",
    "get_tensordict",
    "index_select_tensor_dict",
    "jagged_from_rows",
    "make_iterator",
    "maybe_fix_3d_position_ids",
    "pad_to_divisor",
    "pop",
    "pop_keys",
    "union_tensor_dict",
    "unpad",
    "unwrap_non_tensor_data",
]


class TensorDictError(ValueError, AssertionError):
    """Inputs these helpers refuse (see the module docstring): a ValueError, and an AssertionError
    for code written against upstream, which asserts these preconditions."""


def _require_td(value, what: str = "tensor_dict") -> None:
    if not isinstance(value, TensorDict):
        raise TypeError(f"{what} must be a tensordict.TensorDict, got {type(value).__name__}")


def _is_nested(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_nested


def _stack(values: Iterable) -> NonTensorStack:
    return NonTensorStack.from_list([NonTensorData(v) for v in values])


def assign_non_tensor_data(tensor_dict: TensorDict, key, val) -> None:
    """Store one Python object for the whole batch under `key`."""
    _require_td(tensor_dict)
    tensor_dict[key] = NonTensorData(val)


def assign_non_tensor_stack(tensor_dict: TensorDict, key, val: list) -> None:
    """Store one Python object per row (`val` has one entry per row) under `key`."""
    _require_td(tensor_dict)
    tensor_dict[key] = _stack(val)


def assign_non_tensor(tensor_dict: TensorDict, **kwargs) -> TensorDict:
    """`assign_non_tensor_stack` for list values, `assign_non_tensor_data` for anything else
    (already wrapped values are stored as they are); returns the TensorDict."""
    _require_td(tensor_dict)
    for key, val in kwargs.items():
        if isinstance(val, (NonTensorData, NonTensorStack)):
            tensor_dict[key] = val
        elif isinstance(val, list):
            assign_non_tensor_stack(tensor_dict, key, val)
        else:
            assign_non_tensor_data(tensor_dict, key, val)
    return tensor_dict


def unwrap_non_tensor_data(data):
    """The object inside a `NonTensorData`; any other value unchanged."""
    return data.data if isinstance(data, NonTensorData) else data


def get_non_tensor_data(data: TensorDict, key: str, default):
    """`data[key]` unwrapped from `NonTensorData`, or `default` when the key is absent."""
    return unwrap_non_tensor_data(data.get(key, default))


def jagged_from_rows(rows: list[torch.Tensor], ragged_idx: int = 1) -> torch.Tensor:
    """A jagged nested tensor [B, ...] of `rows` whose ragged dimension is `ragged_idx` (1: each row's
    first dimension, as `torch.nested.as_nested_tensor` makes it; 2 for M-RoPE position ids [B, C, j],
    each row [C, j_i]). Given explicitly because torch infers it from the rows' shapes: rows of equal
    length (or a single row) would otherwise be ragged in their first dimension."""
    if ragged_idx == 1 or not rows:
        return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)
    dim = ragged_idx - 1
    lengths = torch.tensor([row.shape[dim] for row in rows], dtype=torch.long)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    values = torch.cat(list(rows), dim=dim)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets.to(values.device), jagged_dim=ragged_idx)


def _jagged_like(value: torch.Tensor, rows) -> torch.Tensor:
    return jagged_from_rows(list(rows), getattr(value, "_ragged_idx", 1))


def concat_nested_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate jagged nested tensors (each contiguous, 2-D or more) along the batch dimension."""
    rows = []
    for i, tensor in enumerate(tensors):
        if not (tensor.is_nested and tensor.is_contiguous()):
            raise TensorDictError(f"concat_nested_tensors: part {i} is not a contiguous nested tensor")
        if tensor.dim() < 2:
            raise TensorDictError(f"concat_nested_tensors: part {i} has shape {tuple(tensor.shape)}; it needs 2+ dims")
        rows.extend(tensor.unbind(0))
    return _jagged_like(tensors[0], rows)


def concat_tensordict_with_none_bsz(data: list[TensorDict]) -> TensorDict:
    """Concatenation of TensorDicts without a batch dimension (metadata only): the first one."""
    for i, td in enumerate(data):
        if len(td.batch_size) != 0:
            raise TensorDictError(f"part {i} has batch size {list(td.batch_size)}; only batch-less TensorDicts qualify")
    return data[0]


def concat_tensordict(data: list[TensorDict]) -> TensorDict:
    """Concatenate TensorDicts along the batch dimension (the inputs are left unchanged).

    Jagged tensors are re-nested row by row; a key that holds batch-wide `NonTensorData` in every
    part keeps the first part's value (upstream's result, see the module docstring)."""
    if not data:
        raise TensorDictError("concat_tensordict needs at least one TensorDict")
    if len(data[0].batch_size) == 0 and not any(_is_nested(value) for value in data[0].values()):
        return concat_tensordict_with_none_bsz(data)
    nested_keys = {key for key, value in data[0].items() if _is_nested(value)}
    batch_wide_keys = {
        key
        for key, value in data[0].items()
        if isinstance(value, NonTensorData) and all(isinstance(td.get(key, None), NonTensorData) for td in data)
    }
    regular = []
    for i, td in enumerate(data):
        keys = {key for key, value in td.items() if _is_nested(value)}
        if keys != nested_keys:
            raise TensorDictError(
                f"concat_tensordict: part {i} has nested keys {sorted(keys)} but part 0 has {sorted(nested_keys)}"
            )
        skip = nested_keys | batch_wide_keys
        regular.append(
            TensorDict({k: v for k, v in td.items() if k not in skip}, batch_size=td.batch_size, device=td.device)
        )
    output = torch.cat(regular, dim=0)
    for key in nested_keys:
        output[key] = concat_nested_tensors([td[key] for td in data])
    for key in batch_wide_keys:
        output[key] = NonTensorData(data[0].get(key).data)
    return output


def chunk_tensordict(td: TensorDict, chunks: int) -> list[TensorDict]:
    """`chunks` equal parts of `td` (its length must divide evenly); 3-D+ jagged tensors, which
    `torch.chunk` cannot split, are split row by row."""
    _require_td(td, "td")
    if chunks < 1 or len(td) % chunks:
        raise TensorDictError(f"chunk_tensordict: {len(td)} rows do not split into {chunks} equal chunks")
    size = len(td) // chunks
    special = {k for k, v in td.items() if _is_nested(v) and v.dim() >= 3}
    base = TensorDict({k: v for k, v in td.items() if k not in special}, batch_size=td.batch_size, device=td.device)
    parts = list(base.chunk(chunks=chunks))
    for key in special:
        rows = td[key].unbind(0)
        for i, part in enumerate(parts):
            part[key] = _jagged_like(td[key], rows[i * size : (i + 1) * size])
    return parts


def get_tensordict(tensor_dict: dict[str, Any], non_tensor_dict: dict | None = None) -> TensorDict:
    """A TensorDict from per-row values (`tensor_dict`: tensors, jagged tensors, lists of Python
    objects, NonTensorStacks) and batch-wide metadata (`non_tensor_dict`, stored as NonTensorData).

    Every per-row value must have the same length; lists become NonTensorStacks (a list may not
    hold tensors: convert them first). With no per-row value the TensorDict has no batch dimension.
    """
    source = dict(tensor_dict)
    batch_size = None
    for key, val in tensor_dict.items():
        if _is_nested(val) and (val.layout != torch.jagged or not val.is_contiguous()):
            raise TensorDictError(f"get_tensordict: nested tensor {key!r} must be contiguous with layout=torch.jagged")
        if isinstance(val, NonTensorStack):
            length = len(val)
        elif isinstance(val, list):
            if any(isinstance(v, torch.Tensor) for v in val):
                raise TypeError(
                    f"get_tensordict: list {key!r} holds tensors; a list becomes per-row Python objects, so pass a "
                    "stacked or nested tensor instead"
                )
            source[key] = _stack(val)
            length = len(val)
        elif isinstance(val, torch.Tensor):
            length = val.size(0)
        else:
            raise TypeError(f"get_tensordict: {key!r} is a {type(val).__name__}; use a tensor or a list per row")
        if batch_size is None:
            batch_size = length
        elif length != batch_size:
            raise TensorDictError(f"get_tensordict: {key!r} has {length} rows but earlier values have {batch_size}")
    for key, val in (non_tensor_dict or {}).items():
        if key in source:
            raise TensorDictError(f"get_tensordict: {key!r} is given both per row and as batch metadata")
        source[key] = NonTensorData(val)
    return TensorDict(source=source, batch_size=[] if batch_size is None else [batch_size])


def index_select_tensor_dict(batch: TensorDict | None, indices: torch.Tensor | list[int]) -> TensorDict | None:
    """The rows `indices` (1-D) of `batch`; jagged tensors are gathered row by row, batch metadata
    (NonTensorData without a batch dimension) is kept. None stays None."""
    if batch is None:
        return None
    indices = torch.as_tensor(indices, dtype=torch.long)
    if indices.dim() != 1:
        raise TensorDictError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    out = {}
    for key, value in batch.items():
        if _is_nested(value):
            rows = value.unbind()
            out[key] = _jagged_like(value, [rows[i] for i in indices.tolist()])
        elif isinstance(value, torch.Tensor) or value.shape:
            out[key] = value[indices]
        else:
            out[key] = value
    return TensorDict(source=out, batch_size=[indices.shape[0]])


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of `tensor_dict2` to `tensor_dict1` (in place); shared keys must hold equal values."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise TensorDictError(
            f"union_tensor_dict: batch sizes differ ({list(tensor_dict1.batch_size)} vs {list(tensor_dict2.batch_size)})"
        )
    existing = tensor_dict1.keys()  # `in` on a TensorDict itself is not supported by every tensordict version
    for key in list(tensor_dict2.keys()):
        value = tensor_dict2.get(key)
        if key not in existing:
            tensor_dict1[key] = value
            continue
        mine = tensor_dict1.get(key)
        same = (
            mine.equal(value) if isinstance(value, torch.Tensor) else get(tensor_dict1, key) == get(tensor_dict2, key)
        )
        if not same:
            raise TensorDictError(
                f"union_tensor_dict: {key!r} exists in both TensorDicts with different values ({key} in tensor_dict1 "
                "and tensor_dict2 are not the same object); rename or pop it on one side first"
            )
    return tensor_dict1


def make_iterator(
    tensordict: TensorDict, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs=None
) -> Iterator[TensorDict]:
    """Mini-batches of `mini_batch_size` rows for `epochs` passes, drawn through a
    `torch.utils.data.DataLoader` over the row indices (so `dataloader_kwargs={"shuffle": True}`
    with a `seed` gives DataLoader's seeded order)."""
    from torch.utils.data import DataLoader

    if tensordict.batch_size[0] % mini_batch_size:
        raise TensorDictError(f"make_iterator: {tensordict.batch_size[0]} rows are not divisible by {mini_batch_size}")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    loader = DataLoader(
        dataset=torch.arange(tensordict.shape[0]),
        batch_size=mini_batch_size,
        collate_fn=lambda x: torch.stack(x),
        generator=generator,
        **(dataloader_kwargs or {}),
    )

    def batches():
        for _ in range(epochs):
            for idx in loader:
                yield index_select_tensor_dict(tensordict, idx)

    return iter(batches())


def assert_tensordict_eq(tensordict1: TensorDict, tensordict2: TensorDict) -> None:
    """Raise AssertionError naming the first key whose values differ (jagged tensors compared row by row)."""
    keys1, keys2 = set(tensordict1.keys()), set(tensordict2.keys())
    assert keys1 == keys2, f"the keys differ: {sorted(keys1 ^ keys2)}"
    for key in keys1:
        a, b = tensordict1[key], tensordict2[key]
        assert type(a) is type(b), f"{key!r}: {type(a).__name__} vs {type(b).__name__}"
        if _is_nested(a):
            rows_a, rows_b = a.unbind(), b.unbind()
            assert len(rows_a) == len(rows_b), f"{key!r}: {len(rows_a)} vs {len(rows_b)} rows"
            for i, (x, y) in enumerate(zip(rows_a, rows_b)):
                assert torch.equal(x, y), f"{key!r}: row {i} differs: {x} vs {y}"
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"{key!r} differs: {a} vs {b}"
        else:
            assert a == b, f"{key!r} differs: {a!r} vs {b!r}"


def _native(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, NonTensorData):
        return value.data
    raise TypeError(f"unexpected TensorDict entry of type {type(value).__name__}")


def get(tensordict: TensorDict, key: str, default=None) -> Any:
    """`tensordict[key]` as a Python value (tensor, list for a NonTensorStack, object for NonTensorData)."""
    keys = tensordict.keys()
    if key not in keys:
        return default
    return _native(tensordict.get(key))


def pop(tensordict: TensorDict, key: str, default=None) -> Any:
    """Remove `key` and return its Python value (as `get`), or `default` when absent."""
    keys = tensordict.keys()
    if key not in keys:
        return default
    return _native(tensordict.pop(key))


def _split_kinds(tensordict: TensorDict, keys: Iterable[str], remove: bool) -> TensorDict:
    per_row, batch_wide = {}, {}
    available = set(tensordict.keys())
    for key in keys:
        if key not in available:
            raise KeyError(f"key {key!r} not in the TensorDict (keys: {sorted(available)})")
        value = tensordict.pop(key) if remove else tensordict.get(key)
        if isinstance(value, NonTensorData):
            batch_wide[key] = value.data
        else:
            per_row[key] = _native(value)
    return get_tensordict(per_row, batch_wide)


def get_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """A new TensorDict with only `keys` (a missing key is a KeyError)."""
    return _split_kinds(tensordict, keys, remove=False)


def pop_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """Remove `keys` from `tensordict` and return them as a new TensorDict."""
    return _split_kinds(tensordict, keys, remove=True)


def pad_to_divisor(data: TensorDict, size_divisor: int) -> tuple[TensorDict, int]:
    """Append copies of the first rows (cycling) until the length divides by `size_divisor`;
    returns `(padded, pad_size)`. An empty TensorDict is returned unchanged."""
    _require_td(data, "data")
    n = len(data)
    pad_size = -n % size_divisor if n else 0
    if pad_size == 0:
        return data, 0
    idx = torch.arange(n + pad_size) % n
    return index_select_tensor_dict(data, idx), pad_size


def unpad(data: TensorDict, pad_size: int) -> TensorDict:
    """Drop the last `pad_size` rows (undoes `pad_to_divisor`)."""
    return data[: len(data) - pad_size] if pad_size else data


def contiguous(data: TensorDict) -> TensorDict:
    """A new TensorDict whose tensors are contiguous (non-tensor entries kept as they are)."""
    per_row, batch_wide = {}, {}
    for key in list(data.keys()):
        value = data.get(key)
        if isinstance(value, NonTensorData):
            batch_wide[key] = value.data
        elif isinstance(value, NonTensorStack):
            per_row[key] = value
        else:
            per_row[key] = value.contiguous()
    return get_tensordict(per_row, batch_wide)


def maybe_fix_3d_position_ids(data: TensorDict) -> None:
    """After unpickling, a 3-D jagged `position_ids` (multimodal rope) can lose the index of its ragged
    dimension; restore it (it is the last one)."""
    keys = data.keys()
    if "position_ids" in keys:
        position_ids = data["position_ids"]
        if position_ids.is_nested and position_ids.dim() == 3:
            position_ids._ragged_idx = 2
