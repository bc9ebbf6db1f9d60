"""How a worker process joins its group's torch.distributed process group and seeds torch (shared by
the role workers of `verl.workers.engine_workers`, the reward model's and `TrainingWorker`)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from verl.single_controller.base import Worker
from verl.utils import device as dev

__all__ = ["_join_group", "_seed_sampling"]


def _join_group(worker: Worker, timeout_s=None) -> None:
    """Join the group's torch.distributed group once per process (colocated roles share it: the
    first role built, the actor in main_ppo's pools, sets the backend and the timeout).

    `timeout_s` is the role's `nccl_timeout` (`actor_rollout_ref.nccl_timeout`; None: the
    `VERL_DIST_TIMEOUT_S` / 600 s default). The backend is gloo on CPU and `cpu:gloo,cuda:nccl` on
    GPU (see `verl.single_controller.base.worker`). Seeds torch identically on every rank, so
    freshly initialised weights (a critic's value head) agree across ranks; `_seed_sampling` later
    gives each rank its own sampling stream.
    """
    if not dist.is_initialized():
        worker.init_process_group(timeout_s=None if timeout_s is None else float(timeout_s))
    dev.set_device()
    torch.manual_seed(_SEED)
    # One CPU bundle per worker: use the threads Ray granted, not every core of the machine.
    if not dev.is_cuda_available():
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", 1))))


_SEED = 0


def _seed_sampling() -> None:
    """A per-rank random stream for sampling, so a fixed-seed run is reproducible (checkpoints save it)."""
    torch.manual_seed(_SEED + dist.get_rank())
