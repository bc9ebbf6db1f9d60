"""Upstream's stand-alone torch profiler, `Profiler` (`verl.utils.profiler.torch_profile`, also
importable from `verl.utils.profiler.profile` as recipes written for upstream's earlier layout do).

Workers normally profile through `DistProfiler` (tool `torch`), which the trainer drives per step;
`Profiler` is the hand-driven one a recipe starts and stops itself: `start(role=...)` begins one
continuous trace, `stop()` writes it to `<save_path>/<role>/[<prefix>_]prof_rank-<rank>.json.gz`;
with `tool_config.discrete` each `annotate`d call writes its own trace instead. One continuous
trace per process at a time (torch.profiler cannot nest): a second `start` does nothing.

Both upstream signatures work: `Profiler(rank, config, tool_config=None, save_file_prefix=None)`
and the earlier `Profiler(config, tool_config=None, save_file_prefix=None)` (rank from
torch.distributed). A disabled or missing config gives a profiler that records nothing until
started by hand.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from verl.utils.device import ACCELERATOR_NAME, is_cuda_available
from verl.utils.profiler.config import ProfilerConfig

__all__ = ["Profiler", "get_torch_profiler"]

logger = logging.getLogger(__name__)


def get_torch_profiler(contents, save_path: str, role: str | None = None, save_file_prefix=None, rank: int = 0):
    """A torch.profiler recording `contents` (cpu, cuda, stack, shapes, memory; empty: cpu and the
    accelerator) that writes its Chrome trace when stopped (see the module docstring for the path)."""
    directory = os.path.join(save_path, role) if role else save_path
    os.makedirs(directory, exist_ok=True)
    name = f"prof_rank-{rank}.json.gz"
    path = os.path.join(directory, f"{save_file_prefix}_{name}" if save_file_prefix else name)
    contents = set(contents or ())
    activities = []
    if not contents or "cpu" in contents:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    if (not contents or ACCELERATOR_NAME in contents) and is_cuda_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    if not activities:
        raise RuntimeError(
            f"profiler contents {sorted(contents)} select only CUDA activity and there is no CUDA device"
        )

    def write_trace(prof) -> None:
        prof.export_chrome_trace(path)
        logger.info("profiler: wrote %s", path)

    return torch.profiler.profile(
        activities=activities,
        with_stack="stack" in contents,
        record_shapes="shapes" in contents,
        profile_memory="memory" in contents,
        on_trace_ready=write_trace,
    )


def _field(config, key: str, default=None):
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


class Profiler:
    """A hand-driven torch profiler on one rank (see the module docstring)."""

    _running = 0  # continuous traces recording in this process (at most one)

    def __init__(self, rank=None, config=None, tool_config=None, save_file_prefix=None):
        if rank is not None and not isinstance(rank, int):  # upstream's earlier (config, tool_config, prefix)
            rank, config, tool_config, save_file_prefix = None, rank, config, tool_config
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        config = config if config is not None else ProfilerConfig()
        if tool_config is None and _field(config, "enable", False):
            raise ValueError(
                "Profiler: the profiler config is enabled but no tool_config was given; pass the torch tool's "
                "config (profiler.tool_config.torch)"
            )
        self.rank, self.config, self.tool_config = rank, config, tool_config
        self.save_file_prefix = save_file_prefix
        self.contents = list(_field(tool_config, "contents", [])) if tool_config is not None else []
        self.discrete = bool(_field(tool_config, "discrete", False)) if tool_config is not None else False
        self.save_path = _field(config, "save_path", "outputs/profile")
        self.prof = None

    def check(self) -> bool:
        """Whether this profiler is recording a continuous trace."""
        return self.prof is not None

    def start(self, **kwargs) -> None:
        if self.discrete or Profiler._running:
            return
        self.prof = get_torch_profiler(
            self.contents, self.save_path, kwargs.get("role"), self.save_file_prefix, self.rank
        )
        self.prof.start()
        Profiler._running += 1

    def step(self) -> None:
        if self.check():
            self.prof.step()

    def stop(self) -> None:
        if not self.check():
            return
        self.prof.stop()  # writes the trace
        self.prof = None
        Profiler._running -= 1

    def annotate(self, message: str | None = None, role: str | None = None, **_) -> Callable:
        """Decorate a function: a named range in the running trace, or its own trace when discrete."""

        def decorator(func):
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                name = message or func.__name__
                if not self.discrete:
                    with torch.profiler.record_function(name):
                        return func(*args, **kwargs)
                prof = get_torch_profiler(self.contents, self.save_path, role, self.save_file_prefix, self.rank)
                with prof, torch.profiler.record_function(name):
                    return func(*args, **kwargs)

            return wrapper

        return decorator
