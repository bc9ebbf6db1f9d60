"""`run_distributed`'s ranks do not depend on what earlier tests left in pytest's process.

The hazard (issue #30): ranks forked from pytest's process inherit its objects but not its threads.
A gloo process group that an earlier in-process test left referenced keeps its gloo threads in the
parent; a forked rank that drops the inherited group runs its destructor, which waits forever to
join threads the child does not have. Here the group is held in a module global that the ranks
clear, as megatron's `initialize_model_parallel` replaces its globals in a rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import free_port, run_distributed

_HELD: list = []
"""What this process keeps alive between its tests; a forked rank would inherit it, a rank
started from the forkserver imports this module afresh and finds it empty."""


def _native_threads() -> int:
    """How many threads this process runs (gloo's and OpenMP's too, not only Python's)."""
    return len(os.listdir("/proc/self/task"))


def _drop_what_the_parent_held_then_all_reduce(rank: int, world_size: int) -> None:
    _HELD.clear()
    value = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(value)
    assert value.item() == world_size * (world_size + 1) / 2


@pytest.mark.timeout(300)  # a hang guard: a hung rank would otherwise block the tier for 10 minutes
def test_ranks_finish_while_this_process_holds_a_gloo_group_with_live_threads(one_process):
    threads_before = _native_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))
    _HELD.append(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()  # unregistered, but the object (and its threads) live on in _HELD
    try:
        assert _native_threads() > threads_before, "precondition: the held group's threads are alive"
        run_distributed(_drop_what_the_parent_held_then_all_reduce, 2)
    finally:
        _HELD.clear()
