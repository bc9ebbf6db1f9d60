"""Groups of consecutive ranks of the default process group.

The rollout's tensor- and expert-parallel groups and the Ulysses sequence-parallel groups all cut
the worker group into blocks of `size` consecutive ranks (ranks [0, size) form the first group).
torch.distributed requires every rank to create every group, in the same order, so each rank
builds them all and keeps its own.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["consecutive_rank_group"]


def consecutive_rank_group(size: int, key: str, workers: str = "workers", hint: str = ""):
    """(group, rank in it) of this rank's block of `size` consecutive ranks; (None, 0) for size 1.

    `key` is the config key that asks for the groups (named in the errors), `workers` what the
    ranks are ("rollout workers"), `hint` an extra remedy appended to the divisibility error.
    """
    size = int(size)
    if size < 1:
        raise ValueError(f"{key}={size} must be at least 1")
    if size == 1:
        return None, 0
    if not dist.is_initialized():
        raise RuntimeError(
            f"{key}={size} needs the {workers}' torch.distributed group, which is not initialised; run inside "
            f"the trainer's worker group or set {key}=1"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"{key}={size} does not divide the {world} {workers}; use a divisor of {world}{hint}")
    mine = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine, rank % size
