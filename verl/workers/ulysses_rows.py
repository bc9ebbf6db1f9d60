"""The dp x sp layout of a worker group under Ulysses sequence parallelism.

The driver dispatches a DataProto in `world` equal chunks (DP_COMPUTE_PROTO), one per rank. With
sp > 1 the ranks form consecutive sequence-parallel groups of sp ranks (ranks [k*sp, (k+1)*sp)),
and every rank of a group must process the same rows. Rather than adding a dispatch mode to the
single controller (upstream dispatches by dp rank and collects from sp rank 0), each worker
all-gathers its group's chunks (`gather`) so all sp ranks hold the same sp*chunk rows, computes on
them with the sequence split inside the model, and returns only the rows it was sent (`own`). The
driver-side contract (chunk in, chunk out, same order) is thus unchanged; the cost is one
all-gather of the inputs per call within each sp group, which is small next to the forward.

The data-parallel size is world / sp: mini-batch sizes are divided by it, and token budgets per
micro-batch (`*_max_token_len_per_gpu`) are multiplied by sp, as upstream does, because each rank
holds 1/sp of every micro-batch's tokens.
"""

from __future__ import annotations

import torch.distributed as dist

from verl.protocol import DataProto
from verl.utils.ulysses import SP_KEY

__all__ = ["UlyssesRows"]


class UlyssesRows:
    """This rank's sequence-parallel group and the row exchange within it (sp=1: no-ops)."""

    def __init__(self, sp: int, role: str):
        world = dist.get_world_size() if dist.is_initialized() else 1
        if sp < 1 or world % sp:
            raise ValueError(
                f"{role}.{SP_KEY}={sp} does not divide the {world} ranks of the worker group; choose a "
                f"divisor of {world} (trainer.n_gpus_per_node x trainer.nnodes)"
            )
        self.sp = sp
        self.dp_size = world // sp
        self.group = None
        if sp > 1:
            rank = dist.get_rank()
            # every rank must create every group, in the same order
            for start in range(0, world, sp):
                group = dist.new_group(list(range(start, start + sp)))
                if start <= rank < start + sp:
                    self.group = group
            self.sp_rank = dist.get_rank(self.group)

    def gather(self, data: DataProto) -> DataProto:
        """The sp group's chunks concatenated in sp-rank order (the same rows on every sp rank)."""
        if self.sp == 1:
            return data
        parts = [None] * self.sp
        dist.all_gather_object(parts, data, group=self.group)
        merged = DataProto.concat(parts)
        merged.meta_info = data.meta_info
        return merged

    def own(self, out: DataProto) -> DataProto:
        """The rows of `out` (computed on `gather`'s rows) that this rank was sent."""
        if self.sp == 1:
            return out
        return out.chunk(self.sp)[self.sp_rank]


def scale_token_budgets(cfg, keys: tuple[str, ...], sp: int) -> None:
    """Multiply the per-rank token budgets `keys` of `cfg` (an open DictConfig) by sp in place."""
    if sp == 1:
        return
    for key in keys:
        if cfg.get(key) is not None:
            cfg[key] = int(cfg[key]) * sp
