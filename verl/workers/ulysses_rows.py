"""The dp x sp layout of a worker group under Ulysses sequence parallelism.

The driver dispatches a DataProto in `world` equal chunks (DP_COMPUTE_PROTO), one per rank. With
sp > 1 the ranks form consecutive sequence-parallel groups of sp ranks (ranks [k*sp, (k+1)*sp)),
and every rank of a group must process the same rows. Rather than adding a dispatch mode to the
single controller (upstream dispatches by dp rank and collects from sp rank 0), each worker
all-gathers its group's chunks (`gather`) so all sp ranks hold the same sp*chunk rows, computes on
them with the sequence split inside the model, and returns only the rows it was sent (`own`). The
driver-side contract (chunk in, chunk out, same order) is thus unchanged; the cost is one
all-gather of the inputs per call within each sp group, which is small next to the forward.

The gather moves tensors as tensors: every tensor of the chunk is flattened to its bytes and
packed into one uint8 buffer, so a chunk costs one all-gather of its raw bytes plus one of two
integers per rank (row count, layout checksum), whatever the number of keys and dtypes (bool and
bfloat16 included, which not every backend reduces but every one moves as bytes). Pickling the
DataProto (`all_gather_object`) cost a serialization, a size exchange and a copy per rank; it
measured 3.4x slower (101 ms vs 30 ms for 64 rows x 2048 tokens, 4.8 MB a rank, 2 gloo ranks on a
loaded 2-core CPU machine: benchmarks/ulysses_row_gather.py). Only the non-tensor
columns (numpy object arrays: uids, data sources) still travel pickled, when there are any.

The data-parallel size is world / sp: mini-batch sizes are divided by it, and token budgets per
micro-batch (`*_max_token_len_per_gpu`) are multiplied by sp, as upstream does, because each rank
holds 1/sp of every micro-batch's tokens.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.distributed as dist

from verl.protocol import DataProto
from verl.utils.device import collective_device
from verl.utils.process_groups import consecutive_rank_group

__all__ = ["UlyssesRows"]


class UlyssesRows:
    """This rank's sequence-parallel group and the row exchange within it (sp=1: no-ops)."""

    def __init__(self, sp: int, key: str):
        """`key`: the full config key that set `sp` (`verl.utils.ulysses.role_sp`), for errors."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if sp < 1 or world % sp:
            raise ValueError(
                f"{key}={sp} does not divide the {world} ranks of the worker group; choose a "
                f"divisor of {world} (trainer.n_gpus_per_node x trainer.nnodes)"
            )
        self.sp = sp
        self.dp_size = world // sp
        self.group, self.sp_rank = consecutive_rank_group(sp, key, "ranks of the worker group")

    def gather(self, data: DataProto) -> DataProto:
        """The sp group's chunks concatenated in sp-rank order (the same rows on every sp rank)."""
        if self.sp == 1:
            return data
        tensors, self._counts = gather_tensors(
            dict(data.batch.items()) if data.batch is not None else {}, len(data), self.group
        )
        non_tensors = data.non_tensor_batch
        if non_tensors:
            parts = [None] * self.sp
            dist.all_gather_object(parts, non_tensors, group=self.group)
            non_tensors = {k: np.concatenate([p[k] for p in parts]) for k in non_tensors}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=data.meta_info)

    def own(self, out: DataProto) -> DataProto:
        """The rows of `out` (computed on `gather`'s rows) that this rank was sent."""
        if self.sp == 1:
            return out
        start = sum(self._counts[: self.sp_rank])
        return out.slice(start, start + self._counts[self.sp_rank])


def scale_token_budgets(cfg, keys: tuple[str, ...], sp: int) -> None:
    """Multiply the per-rank token budgets `keys` of `cfg` (an open DictConfig) by sp in place."""
    if sp == 1:
        return
    for key in keys:
        if cfg.get(key) is not None:
            cfg[key] = int(cfg[key]) * sp


def _layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(key, dtype, trailing shape), widest dtype first: each key's bytes then start at a multiple of
    its item size, so the received bytes can be viewed as that dtype without a copy."""
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].dtype.itemsize, kv[0]))
    return [(key, t.dtype, tuple(t.shape[1:])) for key, t in items]


def gather_tensors(tensors: dict[str, torch.Tensor], rows: int, group) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Concatenate, in rank order along dim 0, the `rows`-row tensors every rank of `group` holds
    under the same keys, dtypes and trailing shapes (row counts may differ); also return each
    rank's row count. One all-gather of the packed bytes (see the module docstring)."""
    world = dist.get_world_size(group)
    layout = _layout(tensors)
    checksum = zlib.crc32(repr(layout).encode())
    device = collective_device(group)
    header = [torch.empty(2, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(header, torch.tensor([rows, checksum], dtype=torch.int64, device=device), group=group)
    counts = [int(h[0]) for h in header]
    if any(int(h[1]) != checksum for h in header):
        raise RuntimeError(
            "the ranks of a sequence-parallel group hold different batch layouts (keys, dtypes or widths); "
            f"this rank has {layout}. The driver sends every rank a chunk of one DataProto, so this is a bug"
        )
    widths = [dtype.itemsize * _numel(shape) for _, dtype, shape in layout]
    if not widths:
        return {}, counts
    # key-major: each key's rows are contiguous, so each received key is a view of its rank's part
    local = torch.zeros(max(counts) * sum(widths), dtype=torch.uint8, device=device)
    offset = 0
    for (key, _, _), width in zip(layout, widths, strict=True):
        local[offset : offset + rows * width] = tensors[key].detach().contiguous().view(-1).view(torch.uint8)
        offset += rows * width
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    out = {key: [] for key, _, _ in layout}
    for part, n in zip(parts, counts, strict=True):
        offset = 0
        for (key, dtype, shape), width in zip(layout, widths, strict=True):
            out[key].append(part[offset : offset + n * width].view(dtype).view(n, *shape))
            offset += n * width
    return {key: torch.cat(chunks).to(tensors[key].device) for key, chunks in out.items()}, counts


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
