"""Upstream's `verl.utils.profiler.performance`: memory logging at points of a worker's life
(`log_gpu_memory_usage`, the `GPUMemoryLogger` decorator) and the phase timers.

Memory comes from `verl.utils.device.memory_stats()`: device allocated / reserved GiB on CUDA and
the process's resident set size always, so on CPU the line still says something.
"""

from __future__ import annotations

import functools
import logging

from verl.utils.timer import marked_timer as simple_timer

__all__ = [
    "GPUMemoryLogger",
    "gather_timing",
    "log_gpu_memory_usage",
    "reduce_timing",
    "simple_timer",
    "topk_reduce_ratio_min_max",
]  # and marked_timer, resolved on use


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def memory_line(head: str) -> str:
    """`head` and this process's memory figures, one line."""
    from verl.utils.device import memory_stats

    figures = ", ".join(f"{name.removesuffix('_gb')} {value:.2f} GiB" for name, value in memory_stats().items())
    return f"{head}: {figures}"


def log_gpu_memory_usage(head: str, logger: logging.Logger | None = None, level=logging.DEBUG, rank: int | None = 0):
    """Log (or print, without a logger) `head` with the memory figures, on rank `rank` only
    (None: every rank)."""
    if rank is not None and _rank() != rank:
        return
    line = memory_line(head)
    if logger is None:
        print(line)
    else:
        logger.log(level, line)


class GPUMemoryLogger:
    """Decorator: log the memory before and after each call of the function, labelled with `role`
    and the function's name (on rank 0 only unless `log_only_rank_0=False`)."""

    def __init__(
        self, role: str, logger: logging.Logger | None = None, level=logging.DEBUG, log_only_rank_0: bool = True
    ):
        self.role = role
        self.logger = logger
        self.level = level
        self.rank = 0 if log_only_rank_0 else None

    def __call__(self, fn):
        @functools.wraps(fn)
        def logged(*args, **kwargs):
            log_gpu_memory_usage(f"Before {self.role} {fn.__name__}", self.logger, self.level, self.rank)
            result = fn(*args, **kwargs)
            log_gpu_memory_usage(f"After {self.role} {fn.__name__}", self.logger, self.level, self.rank)
            return result

        return logged


# ------------------------------------------------------------------ timings across ranks (upstream's)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _timing_device():
    from verl.utils.device import get_device

    dist = _dist()
    return "cpu" if dist is not None and dist.get_backend() == "gloo" else get_device()


def reduce_timing(timing_raw: dict[str, float], reduce_op=None) -> dict[str, float]:
    """Each timing reduced over the default group's ranks (`reduce_op`, default the average; gloo has no
    AVG, so it is a sum divided by the world size there); unchanged without a process group."""
    import torch

    dist = _dist()
    if dist is None:
        return timing_raw
    reduce_op = dist.ReduceOp.AVG if reduce_op is None else reduce_op
    keys = sorted(timing_raw)
    values = torch.tensor([timing_raw[k] for k in keys], dtype=torch.float32, device=_timing_device())
    if reduce_op == dist.ReduceOp.AVG and dist.get_backend() == "gloo":
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= dist.get_world_size()
    else:
        dist.all_reduce(values, op=reduce_op)
    return dict(zip(keys, values.cpu().tolist(), strict=True))


def topk_reduce_ratio_min_max(timing: float, k: int = 10) -> tuple[float, float, float]:
    """(share of ranks whose `timing` is above the (100 - k)th percentile over the ranks, min, max);
    (-1, -1, -1) without a process group."""
    import torch

    dist = _dist()
    if dist is None:
        return -1.0, -1.0, -1.0
    mine = torch.tensor([float(timing)], dtype=torch.float32, device=_timing_device())
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    every = torch.cat(parts).cpu()
    threshold = torch.quantile(every, 1 - k / 100)
    return float((every > threshold).float().mean()), float(every.min()), float(every.max())


def gather_timing(timing_raw: dict[str, float]) -> dict[str, list[float]]:
    """{key: [each rank's value, in rank order]} (keys sorted); [own value] without a process group."""
    dist = _dist()
    if dist is None:
        return {k: [v] for k, v in timing_raw.items()}
    keys = sorted(timing_raw)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [timing_raw[k] for k in keys])
    return {key: [rank_values[i] for rank_values in gathered] for i, key in enumerate(keys)}


def __getattr__(name):
    if name == "marked_timer":
        from verl.utils.profiler import marked_timer

        return marked_timer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
