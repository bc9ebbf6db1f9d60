"""Upstream's process-group helpers (`verl.utils.distributed`), for scripts and tests run under torchrun
or inside Ray actors.

They join the group the workers use (`verl.single_controller.base.worker.init_process_group`): gloo on
CPU, `cpu:gloo,cuda:nccl` bound to this rank's device on GPU, so host-side collectives work next to
NCCL, with the given deadline. Without torchrun's environment a process forms a one-rank group (as
the SFT trainers do), where upstream's raises `KeyError: 'LOCAL_RANK'`.
"""

from __future__ import annotations

import os

__all__ = [
    "destroy_global_process_group",
    "initialize_global_process_group",
    "initialize_global_process_group_ray",
    "join_process_group",
    "set_numa_affinity",
]


def join_process_group(timeout_s: float | None = None) -> None:
    """Join torchrun's process group (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR/PORT`), or form a
    one-process group without torchrun's environment, and bind this rank's device. `timeout_s`: the
    group's deadline (None: `VERL_DIST_TIMEOUT_S`'s)."""
    from verl.single_controller.base.worker import init_process_group
    from verl.utils import device as device_utils

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_process_group(timeout_s=timeout_s)
    device_utils.set_device()


def initialize_global_process_group(timeout_second: float = 36000) -> tuple[int, int, int]:
    """Upstream's name: `join_process_group`, returning `(local_rank, rank, world_size)`. `DIST_INIT_METHOD`
    is not read: the rendezvous is torchrun's environment."""
    import torch.distributed as dist

    join_process_group(timeout_second)
    return int(os.environ.get("LOCAL_RANK", "0")), dist.get_rank(), dist.get_world_size()


def initialize_global_process_group_ray(timeout_second: float | None = None, backend: str | None = None) -> None:
    """The same inside a Ray actor (the worker group sets the environment); `backend` as upstream's
    (`cpu:gloo,cuda:nccl` by default, gloo on a CPU machine)."""
    from verl.single_controller.base.worker import init_process_group

    init_process_group(backend=backend, timeout_s=timeout_second)


def destroy_global_process_group() -> None:
    """Leave the process group, if this process is in one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def set_numa_affinity() -> None:
    """Pin this process to the CPUs of its GPU's NUMA node (what upstream does through NVML before a worker
    builds its model). Needs a GPU and `pynvml`; elsewhere (a CPU machine, no NVML) it leaves the affinity
    alone, as upstream's does, and says why in the log."""
    from verl.utils import device as device_utils
    from verl.utils.logging_utils import get_logger

    log = get_logger(__name__)
    if not device_utils.is_cuda_available():
        log.info("set_numa_affinity: no GPU, CPU affinity left as it is")
        return
    try:
        import pynvml
    except ImportError:
        log.warning("set_numa_affinity: pynvml is not installed, CPU affinity left as it is")
        return
    pynvml.nvmlInit()
    try:
        index = device_utils.get_device().index or 0
        pynvml.nvmlDeviceSetCpuAffinity(pynvml.nvmlDeviceGetHandleByIndex(index))
    except pynvml.NVMLError as e:
        log.warning(f"set_numa_affinity: NVML could not set the affinity ({e}); CPU affinity left as it is")
    finally:
        pynvml.nvmlShutdown()
