"""Upstream's process-group helpers (`verl.utils.distributed`) on 2 real gloo ranks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.distributed_helpers import free_port, run_distributed


def _join_reduce_leave_rejoin(rank: int, world_size: int) -> None:
    from verl.utils.distributed import (
        destroy_global_process_group,
        initialize_global_process_group,
        set_numa_affinity,
    )

    ports = [free_port(), free_port()] if rank == 0 else [None, None]
    dist.broadcast_object_list(ports, src=0)  # fresh rendezvous ports for the helper's own groups
    dist.destroy_process_group()
    assert not dist.is_initialized()

    os.environ["MASTER_PORT"] = str(ports[0])
    assert initialize_global_process_group(timeout_second=120) == (rank, rank, world_size)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    assert value.item() == 3.0  # 1 + 2: both ranks are in the group
    assert dist.get_backend() == "gloo"
    set_numa_affinity()  # no GPU here: leaves the affinity alone
    destroy_global_process_group()
    assert not dist.is_initialized()
    destroy_global_process_group()  # leaving twice is harmless

    os.environ["MASTER_PORT"] = str(ports[1])
    initialize_global_process_group(timeout_second=120)  # the runner's own teardown leaves this group
    assert dist.get_world_size() == world_size


def test_ranks_join_reduce_leave_and_rejoin_through_upstreams_helpers():
    run_distributed(_join_reduce_leave_rejoin, 2)
