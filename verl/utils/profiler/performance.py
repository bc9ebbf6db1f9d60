"""Upstream's `verl.utils.profiler.performance`: memory logging at points of a worker's life
(`log_gpu_memory_usage`, the `GPUMemoryLogger` decorator) and the phase timers.

Memory comes from `verl.utils.device.memory_stats()`: device allocated / reserved GiB on CUDA and
the process's resident set size always, so on CPU the line still says something.
"""

from __future__ import annotations

import functools
import logging

from verl.utils.timer import marked_timer as simple_timer

__all__ = ["GPUMemoryLogger", "log_gpu_memory_usage", "simple_timer"]  # and marked_timer, resolved on use


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


def __getattr__(name):
    if name == "marked_timer":
        from verl.utils.profiler import marked_timer

        return marked_timer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
