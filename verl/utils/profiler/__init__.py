"""Profiling of listed training steps (`global_profiler`, each role's `profiler`), upstream's names.

`StepProfiler` is the driver's part, `DistProfiler` / `DistProfilerExtension` the workers',
`ProfilerConfig` and friends the config (see `verl.utils.profiler.profile` for the tools and where
their traces go, `verl.utils.profiler.config` for the keys). `marked_timer` and `simple_timer`
are the phase timers upstream exports from here too.

The config classes are imported here directly; the tools (`verl.utils.profiler.profile`, which
imports torch) on first access of one of their names, so the typed config sections that hold a
`ProfilerConfig` stay importable without torch.
"""

from contextlib import contextmanager

from verl.utils.profiler.config import (
    GlobalProfilerConfig,
    NPUToolConfig,
    NsightToolConfig,
    ProfilerConfig,
    TorchMemoryToolConfig,
    TorchProfilerToolConfig,
    check_tool_available,
    resolve_role_profilers,
)
from verl.utils.timer import marked_timer as simple_timer

_TOOL_NAMES = (
    "DistProfiler",
    "DistProfilerExtension",
    "StepProfiler",
    "mark_annotate",
    "mark_end_range",
    "mark_start_range",
)


def __getattr__(name):
    if name in _TOOL_NAMES:
        from verl.utils.profiler import profile

        return getattr(profile, name)
    if name in ("GPUMemoryLogger", "log_gpu_memory_usage"):  # upstream exports them here; they import torch
        from verl.utils.profiler import performance

        return getattr(performance, name)
    raise AttributeError(f"module 'verl.utils.profiler' has no attribute {name!r}")


@contextmanager
def marked_timer(name: str, timing_raw: dict, color: str | None = None, **_):
    """`simple_timer` that is also an NVTX range named `name` (seen by `nsys`; `color` is accepted
    for upstream's call sites, NVTX ranges here are uncoloured)."""
    from verl.utils.profiler.profile import mark_end_range, mark_start_range

    range_id = mark_start_range(name)
    try:
        with simple_timer(name, timing_raw):
            yield
    finally:
        mark_end_range(range_id)


__all__ = [
    "DistProfiler",
    "DistProfilerExtension",
    "GPUMemoryLogger",
    "GlobalProfilerConfig",
    "NPUToolConfig",
    "NsightToolConfig",
    "ProfilerConfig",
    "StepProfiler",
    "TorchMemoryToolConfig",
    "TorchProfilerToolConfig",
    "check_tool_available",
    "log_gpu_memory_usage",
    "mark_annotate",
    "mark_end_range",
    "mark_start_range",
    "marked_timer",
    "resolve_role_profilers",
    "simple_timer",
]
