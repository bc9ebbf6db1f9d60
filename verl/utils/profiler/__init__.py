"""Profiling of listed training steps (`global_profiler`, each role's `profiler`), upstream's names.

`StepProfiler` is the driver's part, `DistProfiler` / `DistProfilerExtension` the workers',
`ProfilerConfig` and friends the config (see `verl.utils.profiler.profile` for the tools and where
their traces go, `verl.utils.profiler.config` for the keys). `marked_timer` and `simple_timer`
are the phase timers upstream exports from here too.
"""

from contextlib import contextmanager

from verl.utils.profiler.config import (
    GlobalProfilerConfig,
    NsightToolConfig,
    ProfilerConfig,
    TorchMemoryToolConfig,
    TorchProfilerToolConfig,
    check_tool_available,
    resolve_role_profilers,
)
from verl.utils.profiler.profile import (
    DistProfiler,
    DistProfilerExtension,
    StepProfiler,
    mark_annotate,
    mark_end_range,
    mark_start_range,
)
from verl.utils.timer import marked_timer as simple_timer


@contextmanager
def marked_timer(name: str, timing_raw: dict, color: str | None = None, **_):
    """`simple_timer` that is also an NVTX range named `name` (seen by `nsys`; `color` is accepted
    for upstream's call sites, NVTX ranges here are uncoloured)."""
    range_id = mark_start_range(name)
    try:
        with simple_timer(name, timing_raw):
            yield
    finally:
        mark_end_range(range_id)


__all__ = [
    "DistProfiler",
    "DistProfilerExtension",
    "GlobalProfilerConfig",
    "NsightToolConfig",
    "ProfilerConfig",
    "StepProfiler",
    "TorchMemoryToolConfig",
    "TorchProfilerToolConfig",
    "check_tool_available",
    "mark_annotate",
    "mark_end_range",
    "mark_start_range",
    "marked_timer",
    "resolve_role_profilers",
    "simple_timer",
]
