"""Column-level helpers of DataProto: equality and union of columns, merging of `meta_info`,
row indexing, and the single-threaded row gathers/concatenations that keep the hot path cheap."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch
from tensordict import TensorDict


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


class DataProtoError(ValueError, AssertionError):
    """A DataProto operation refused for its input (uneven chunks, conflicting values, mismatched rows).

    A ValueError, and also an AssertionError: upstream verl checks these preconditions with
    `assert`, so code written against it catches AssertionError; ours may catch either.
    """


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


def _values_equal(a, b, _path: frozenset = frozenset()) -> bool:
    """Equality for meta_info and non-tensor values: tensors, arrays, containers; NaN equals NaN.

    A container that contains itself (an object array holding itself, say) is compared without
    endless recursion: a pair of containers met again on the same path counts as equal there, so
    two structurally identical cycles are equal and a cycle never equals an acyclic value."""
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
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (np.ndarray, dict, list, tuple)) or isinstance(b, (np.ndarray, dict, list, tuple)):
        pair = (id(a), id(b))
        if pair in _path:
            return True
        path = _path | {pair}
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return _numpy_equal(np.asarray(a), np.asarray(b), path)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(_values_equal(a[k], b[k], path) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y, path) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _numpy_equal(a: np.ndarray, b: np.ndarray, _path: frozenset = frozenset()) -> bool:
    if a is b:
        return True
    if a.shape != b.shape:
        return False
    if a.dtype != object and b.dtype != object:
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    return all(_values_equal(x, y, _path) for x, y in zip(a.reshape(-1), b.reshape(-1)))


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of `tensor_dict2` to `tensor_dict1` (in place) and return it.

    Keys present in both must hold equal tensors; a conflict is an error naming the key.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"cannot union TensorDicts with batch sizes {tuple(tensor_dict1.batch_size)} and "
            f"{tuple(tensor_dict2.batch_size)}; both must describe the same rows"
        )
    existing = set(tensor_dict1.keys(include_nested=True, leaves_only=True))
    new_leaves = {}
    for key, value in tensor_dict2.items(include_nested=True, leaves_only=True):
        if key not in existing:
            new_leaves[key] = value
        elif not _values_equal(tensor_dict1.get(key), value):
            raise DataProtoError(
                f"union: batch key {key!r} exists on both sides with different values ({key} in tensor_dict1 and "
                "tensor_dict2 are not the same object); rename or pop one of them before union (union only adds "
                "keys, it never overwrites)"
            )
    for key, value in new_leaves.items():  # only after every key checked: a conflict changes nothing
        tensor_dict1.set(key, value)
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the arrays of `tensor_dict2` to `tensor_dict1` (in place) and return it; shared keys must
    be equal (NaN equals NaN, object arrays compared element by element)."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1 and not _numpy_equal(tensor_dict1[key], value):
            raise DataProtoError(
                f"union: non_tensor_batch key {key!r} exists on both sides with different values (`{key}` in "
                "tensor_dict1 and tensor_dict2 are not the same object.); rename or pop one of them before union "
                "(union only adds keys, it never overwrites)"
            )
    tensor_dict1.update(tensor_dict2)
    return tensor_dict1


def _union_meta_info(meta1: dict, meta2: dict) -> dict:
    for key, value in meta2.items():
        if key in meta1 and not _values_equal(meta1[key], value):
            raise DataProtoError(
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
                raise DataProtoError(
                    f"DataProto.concat: Conflicting values for meta_info key {key!r}: meta_info[{key!r}] differs "
                    f"between the parts ({merged[key]!r} vs {value!r}) "
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


def _check_same_keys(key_sets: list[set], part: str) -> None:
    first = key_sets[0]
    for i, keys in enumerate(key_sets[1:], start=1):
        if keys != first:
            raise DataProtoError(
                f"DataProto.concat: part {i} has {part} keys {sorted(map(str, keys))} but part 0 has "
                f"{sorted(map(str, first))}; all parts must carry the same keys (missing in part {i}: "
                f"{sorted(map(str, first - keys))}, extra: {sorted(map(str, keys - first))})"
            )
