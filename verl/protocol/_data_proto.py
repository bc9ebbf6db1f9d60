"""The `DataProto` class itself (and `DataProtoItem`, `collate_fn`); see `verl.protocol` for the
design decisions."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from verl.protocol._columns import (
    DataProtoConfig,
    DataProtoError,
    _as_index,
    _cat_rows,
    _check_same_keys,
    _merge_meta_info,
    _missing_key_error,
    _new_td,
    _take_rows,
    _to_object_array,
    _union_meta_info,
    union_numpy_dict,
    union_tensor_dict,
)
from verl.protocol._wire import _decode_batch, _encode_batch

_SUPPORTED_DATALOADER_KWARGS = ("shuffle", "drop_last")


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
        raise DataProtoError("collate_fn needs at least one DataProtoItem")
    batch = torch.stack([d.batch for d in data]) if data[0].batch is not None else None
    non_tensor = {key: _to_object_array([d.non_tensor_batch[key] for d in data]) for key in data[0].non_tensor_batch}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=data[0].meta_info)


def _column_of_sequences(key: str, column: np.ndarray, n_split: int) -> np.ndarray:
    """A 1-D object column of per-row sequences (what from_dict makes of a list of lists), to split
    into `n_split` chunks per row. Rows of one common length come back as the 2-D [B, L] object array
    that upstream's from_dict builds from such a list, so they unfold exactly as upstream's do; ragged
    rows come back unchanged (1-D)."""
    for item in column:
        if isinstance(item, (str, bytes)) or not hasattr(item, "__len__") or len(item) % n_split:
            raise DataProtoError(
                f"unfold_column_chunks: an entry of {key!r} ({item!r}) is not a sequence that splits into "
                f"{n_split} chunks; each row of a split key needs a list (or array) whose length divides by {n_split}"
            )
    lengths = {len(item) for item in column}
    if len(lengths) != 1:
        return column
    table = np.empty((len(column), lengths.pop()), dtype=object)
    for i, item in enumerate(column):
        for j, element in enumerate(item):  # one by one: an element may itself be a list
            table[i, j] = element
    return table


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
            raise DataProtoError(
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
                    raise DataProtoError(
                        f"tensors[{key!r}] is a 0-dim tensor; every tensor needs a leading batch dimension"
                    )
                sizes[key] = value.shape[0]
            if len(set(sizes.values())) != 1:
                raise DataProtoError(
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
            raise DataProtoError(f"DataProto.from_tensordict(num_batch_dims={num_batch_dims}): only 1 is supported")
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
            raise DataProtoError(f"to_tensordict: keys {clash} are both in batch and non_tensor_batch")
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
                raise DataProtoError(
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
                raise DataProtoError(f"non_tensor_batch[{key!r}] is a 0-dim array; it needs one entry per row")
            lengths[key] = len(value)
        if self.batch is not None:
            expected = int(self.batch.batch_size[0])
            wrong = {k: n for k, n in lengths.items() if n != expected}
            if wrong:
                raise DataProtoError(
                    f"non_tensor_batch lengths {wrong} differ from the batch size {expected} of the tensors "
                    f"{sorted(self.batch.keys())}; every entry needs exactly one row per sample"
                )
        elif len(set(lengths.values())) > 1:
            raise DataProtoError(f"non_tensor_batch entries have different lengths {lengths}; they must all be equal")

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
            raise DataProtoError(
                f"rename got {len(old_keys)} old keys {old_keys} but {len(new_keys)} new keys {new_keys}"
            )
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
            raise DataProtoError(f"union needs protos of the same length, got {len(self)} and {len(other)}")
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
            raise DataProtoError(f"padding_size must be >= 0, got {padding_size}")
        if padding_size == 0:
            return
        if len(self) == 0:
            raise DataProtoError("cannot pad an empty DataProto: there is no row to repeat")
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
            raise DataProtoError(
                f"sample_level_repeat needs one count per row ({len(self)}), got shape {tuple(counts.shape)}"
            )
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise DataProtoError(f"sample_level_repeat counts must be non-negative integers, got {counts.tolist()}")
        idx_np = np.repeat(np.arange(len(self), dtype=np.int64), counts.astype(np.int64))
        return self._take(torch.from_numpy(idx_np), idx_np)

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut the second dimension of each key in `split_keys` into `n_split` chunks that become rows
        ([B, C, ...] -> [B * n_split, C / n_split, ...], row i's chunks adjacent); every other key is
        repeated `n_split` times per row (interleaved) to stay aligned.

        A non-tensor split key may also be a column of per-row lists: lists of one common length L
        unfold like upstream's 2-D object column ([B * n_split, L / n_split] object array), ragged
        lists into one list per chunk."""
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
                value = _column_of_sequences(key, value, n_split)
                if value.ndim == 1:  # ragged rows: each row's chunks stay lists
                    pieces = []
                    for item in value:
                        size = len(item) // n_split
                        pieces.extend(list(item[i * size : (i + 1) * size]) for i in range(n_split))
                    return _to_object_array(pieces)
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(
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
            raise DataProtoError(f"chunk needs a positive number of chunks, got {chunks!r}")
        n = len(self)
        if n % chunks and self.is_padding_enabled():
            size = -(-n // chunks)
            return [self.slice(min(i * size, n), min((i + 1) * size, n)) for i in range(chunks)]
        if n % chunks:
            raise DataProtoError(
                f"DataProto.chunk({chunks}): {n} rows do not split evenly into {chunks} chunks. Pad first with "
                f"`padded, pad_size = pad_dataproto_to_divisor(data, {chunks})` and drop the padding from the "
                f"concatenated result with `unpad_dataproto(output, pad_size)`, or use a batch size divisible by {chunks}"
            )
        size = n // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of `split_size` rows (views); the last part may be shorter."""
        if not isinstance(split_size, (int, np.integer)) or split_size < 1:
            raise DataProtoError(f"split needs a positive split_size, got {split_size!r}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Concatenate protos along the batch dimension; meta_info is merged (see module docstring)."""
        data = list(data)
        if not data:
            raise DataProtoError("DataProto.concat needs at least one DataProto")
        has_batch = [d.batch is not None for d in data]
        if any(has_batch) and not all(has_batch):
            raise DataProtoError(
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
            raise DataProtoError(f"repeat_times must be a positive integer, got {repeat_times!r}")
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
            raise DataProtoError(
                f"make_iterator: unsupported dataloader_kwargs {unknown}; supported: {list(_SUPPORTED_DATALOADER_KWARGS)} "
                "(mini-batches are gathered directly, without a DataLoader)"
            )
        n = len(self)
        if not isinstance(mini_batch_size, (int, np.integer)) or mini_batch_size < 1:
            raise DataProtoError(f"mini_batch_size must be a positive integer, got {mini_batch_size!r}")
        drop_last = bool(dataloader_kwargs.get("drop_last", False))
        if n % mini_batch_size and not drop_last:
            raise DataProtoError(
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
