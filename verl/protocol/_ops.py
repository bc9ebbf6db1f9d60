"""Functions over whole DataProtos: folding the batch dimension, padding to a divisor, and
`DataProtoFuture`, the lazy chunk/concat over Ray object refs (Ray imported only inside it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from tensordict import TensorDict

from verl.protocol._columns import DataProtoError, _new_td
from verl.protocol._data_proto import DataProto
from verl.utils import tensordict_utils as tu


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Group consecutive rows: [B, ...] -> [new_batch_size, B / new_batch_size, ...] for every tensor
    and non-tensor column (e.g. the n samples of each prompt after `repeat(n)` become one row)."""
    n = len(data)
    if new_batch_size < 1 or n % new_batch_size:
        raise DataProtoError(f"fold_batch_dim: {n} rows do not fold into {new_batch_size} rows of equal size")
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
        raise DataProtoError(f"unfold_batch_dim: the columns do not share {batch_dims} leading dimensions: {shapes}")
    lead = next(iter(shapes.values()), (0,))
    n = int(np.prod(lead))
    batch = None
    if data.batch is not None:
        source = {k: v.reshape(n, *v.shape[batch_dims:]) for k, v in data.batch.items()}
        batch = _new_td(source, n, data.batch.device)
    non_tensor = {k: v.reshape(n, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad `data` with copies of its first rows until its length divides by `size_divisor`.

    Returns `(padded, pad_size)`; `unpad_dataproto(result, pad_size)` drops the padding again.
    Padding rows repeat rows from the start (cycling when pad_size exceeds the length), so they
    are valid samples for any worker; their outputs are simply discarded.
    """
    if not isinstance(size_divisor, (int, np.integer)) or size_divisor < 1:
        raise DataProtoError(f"size_divisor must be a positive integer, got {size_divisor!r}")
    n = len(data)
    pad_size = -n % size_divisor
    if pad_size == 0:  # an empty proto divides by anything, so n > 0 below
        return data, 0
    idx = torch.arange(n + pad_size) % n
    return data._take(idx, idx.numpy()), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by `pad_dataproto_to_divisor`."""
    if pad_size < 0 or pad_size > len(data):
        raise DataProtoError(f"pad_size={pad_size} is outside [0, {len(data)}] for a DataProto of length {len(data)}")
    return data[: len(data) - pad_size] if pad_size else data


# ----------------------------------------------------------------------------------------------
# Lazy chunk/concat over Ray object refs.


def _concat_parts(parts: list[DataProto | TensorDict]) -> DataProto | TensorDict:
    """The concatenation of several workers' results: DataProtos or TensorDicts, not a mix."""
    if all(isinstance(p, DataProto) for p in parts):
        return DataProto.concat(parts)
    if all(isinstance(p, TensorDict) for p in parts):
        return tu.concat_tensordict(parts)
    raise TypeError(
        f"cannot concatenate {[type(p).__name__ for p in parts]}: the parts must be all DataProtos or all TensorDicts"
    )


def _pick_chunk(data: DataProto | TensorDict, index: int, chunks: int, inner: Callable | None):
    if inner is not None:
        data = inner(data)
    if isinstance(data, TensorDict):
        return tu.chunk_tensordict(data, chunks)[index]
    return data.chunk(chunks)[index]


@dataclass(eq=False)
class DataProtoFuture:
    """A DataProto not yet materialised: the outputs of several workers, still in Ray's object store.

    `get()` fetches `futures` (ray.ObjectRefs to DataProtos, or to TensorDicts, as upstream allows),
    merges them with `collect_fn` (normally their concatenation) and, when set, applies
    `dispatch_fn` (e.g. "take chunk i of n").
    This lets the driver pass one worker group's output straight to the next group without
    pulling the data through the driver: each worker calls `get()` for its own chunk.
    """

    collect_fn: Callable
    futures: list
    dispatch_fn: Callable | None = None

    @staticmethod
    def concat(data: list) -> DataProtoFuture:
        """A future for the concatenation of the DataProtos (or TensorDicts) behind `data`, a list of
        ray.ObjectRefs."""
        import ray

        data = list(data)
        bad = [type(x).__name__ for x in data if not isinstance(x, ray.ObjectRef)]
        if bad:
            raise TypeError(f"DataProtoFuture.concat expects ray.ObjectRefs, got {bad}")
        return DataProtoFuture(collect_fn=_concat_parts, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """`chunks` futures; the i-th yields chunk i of this future's result after `get()`."""
        if not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise DataProtoError(f"chunk needs a positive number of chunks, got {chunks!r}")
        return [
            DataProtoFuture(
                collect_fn=self.collect_fn,
                futures=self.futures,
                dispatch_fn=partial(_pick_chunk, index=i, chunks=int(chunks), inner=self.dispatch_fn),
            )
            for i in range(chunks)
        ]

    def get(self) -> DataProto | TensorDict:
        import ray

        outputs = ray.get(self.futures)
        bad = [type(o).__name__ for o in outputs if not isinstance(o, DataProto | TensorDict)]
        if bad:
            raise TypeError(f"DataProtoFuture.get: the futures resolved to {bad}, expected DataProtos or TensorDicts")
        output = self.collect_fn(outputs)
        if self.dispatch_fn is not None:
            output = self.dispatch_fn(output)
        return output


def all_gather_data_proto(data: DataProto, process_group=None) -> None:
    """Upstream's in-place all-gather: afterwards `data` holds every rank's rows of `process_group`, in
    rank order (tensor columns and non-tensor columns; `meta_info` is left as it is). Every rank must
    hold the same columns; row counts may differ. Tensors travel on the group's collective device and
    come back to where they were."""
    import torch.distributed as dist

    from verl.utils.device import collective_device

    if not isinstance(data, DataProto):
        raise DataProtoError(f"all_gather_data_proto gathers a DataProto, got a {type(data).__name__}")
    batch = data.batch
    mine = {
        "rows": len(data),
        "tensors": None if batch is None else {k: (tuple(v.shape[1:]), str(v.dtype)) for k, v in batch.items()},
        "non_tensors": sorted(data.non_tensor_batch),
    }
    size = dist.get_world_size(group=process_group)
    layouts: list = [None] * size
    dist.all_gather_object(layouts, mine, group=process_group)
    for rank, layout in enumerate(layouts):
        if {k: v for k, v in layout.items() if k != "rows"} != {k: v for k, v in mine.items() if k != "rows"}:
            raise DataProtoError(
                "all_gather_data_proto: every rank must hold the same columns (names, trailing shapes, dtypes); "
                f"this rank has tensors {mine['tensors']} and non-tensors {mine['non_tensors']}, rank {rank} has "
                f"{layout['tensors']} and {layout['non_tensors']}"
            )
    rows = [layout["rows"] for layout in layouts]
    if batch is not None:
        device = collective_device(process_group)
        gathered = {}
        for key, value in batch.items():
            padded = value.to(device)
            if len(value) < max(rows):  # all_gather needs equal shapes: pad to the longest, cut after
                fill = padded.new_zeros((max(rows) - len(value), *value.shape[1:]))
                padded = torch.cat([padded, fill])
            parts = [torch.empty_like(padded) for _ in range(size)]
            dist.all_gather(parts, padded.contiguous(), group=process_group)
            gathered[key] = torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)]).to(value.device)
        data.batch = TensorDict(gathered, batch_size=[sum(rows)], device=batch.device)
    columns: list = [None] * size
    dist.all_gather_object(columns, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {key: np.concatenate([part[key] for part in columns]) for key in data.non_tensor_batch}
