"""Profiling the listed training steps: `StepProfiler` (driver) starts and stops each worker's
`DistProfiler` around the steps in `global_profiler.steps`; the worker's profiler records with the
configured tool on the ranks its role's `profiler` section selects.

Tools:

- `torch`: torch.profiler (CPU activity, and CUDA where present, unless `contents` narrows them),
  one Chrome trace per profiled step and rank, gzipped:
  `<save_path>/step<N>/<role>/prof_rank-<rank>.json.gz` (N the first step of a continuous range).
  With `tool_config.torch.discrete` one trace per profiled worker call instead:
  `<save_path>/step<N>/<role>/<method>_prof_rank-<rank>.json.gz`. The worker calls are labelled
  in the trace (`record_function`) by `DistProfiler.annotate`.
- `nsys`: Nsight Systems. Ray starts each worker (and the driver's TaskRunner) under `nsys
  profile` with `global_tool_config.nsys.{worker,controller}_nsight_options`; a profiled step (or
  call, `discrete`) is one CUDA profiler capture range (`torch.cuda.profiler.start/stop`), and the
  worker calls are NVTX ranges. Needs `nsys` installed and a CUDA device.
- `torch_memory`: a CUDA memory snapshot per profiled step and rank
  (`<save_path>/step<N>/<role>/memory_snapshot_rank-<rank>.pickle`, for pytorch.org/memory_viz).

Design decisions: one profiler per process is active at a time (torch.profiler cannot nest): when
roles share a process (colocated actor and critic), the first role that starts records the calls
of all of them, which the log says. Decisions are local to each rank: a rank that is not selected
does nothing, so no collective is needed.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from verl.utils.device import ACCELERATOR_NAME, is_cuda_available
from verl.utils.profiler.config import GlobalProfilerConfig, ProfilerConfig
from verl.utils.profiler.torch_profile import Profiler

__all__ = [
    "DistProfiler",
    "DistProfilerExtension",
    "Profiler",
    "StepProfiler",
    "mark_annotate",
    "mark_end_range",
    "mark_start_range",
]

logger = logging.getLogger(__name__)

# the tool implementation recording in this process, if any (see the module docstring)
_ACTIVE: dict[str, Any] = {}


def mark_start_range(message: str | None = None, color: str | None = None, domain=None, category=None):
    """Open an NVTX range (a no-op where NVTX is unavailable); returns its id for `mark_end_range`."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.nvtx.range_start(message or "")
    except (ImportError, RuntimeError):
        pass
    return None


def mark_end_range(range_id) -> None:
    """Close a range opened by `mark_start_range`."""
    if range_id is None:
        return
    import torch

    torch.cuda.nvtx.range_end(range_id)


def mark_annotate(message: str | None = None, color: str | None = None, domain=None, category=None) -> Callable:
    """Decorator wrapping a function in an NVTX range named `message` (the function's name by default)."""

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            range_id = mark_start_range(message or func.__name__)
            try:
                return func(*args, **kwargs)
            finally:
                mark_end_range(range_id)

        return wrapper

    return decorator


def _trace_dir(save_path: str, step: int | None, role: str) -> str:
    path = os.path.join(save_path, f"step{step}" if step is not None else "unscheduled", role)
    os.makedirs(path, exist_ok=True)
    return path


class _TorchTool:
    def __init__(self, rank: int, role: str, save_path: str, tool_config):
        self.rank, self.role, self.save_path = rank, role, save_path
        self.contents = set(tool_config.contents)
        self.discrete = tool_config.discrete
        self.prof = None
        self.step: int | None = None

    def _profiler(self):
        import torch

        activities = []
        if not self.contents or "cpu" in self.contents:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        if (not self.contents or ACCELERATOR_NAME in self.contents) and is_cuda_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if not activities:
            raise RuntimeError(
                f"profiler tool_config.torch.contents={sorted(self.contents)} selects only CUDA activity, but this "
                "process has no CUDA device; add `cpu` to the contents"
            )
        return torch.profiler.profile(
            activities=activities,
            record_shapes="shapes" in self.contents,
            profile_memory="memory" in self.contents,
            with_stack="stack" in self.contents,
        )

    def _export(self, prof, name: str) -> str:
        path = os.path.join(_trace_dir(self.save_path, self.step, self.role), name)
        prof.export_chrome_trace(path)
        logger.info("profiler: wrote %s", path)
        return path

    def start(self, step: int | None) -> None:
        self.step = step
        if self.discrete:  # each annotated call makes its own trace (`around`)
            return
        self.prof = self._profiler()
        self.prof.start()

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self._export(self.prof, f"prof_rank-{self.rank}.json.gz")
            self.prof = None

    def around(self, name: str, func: Callable, *args, **kwargs):
        import torch

        if not self.discrete:
            with torch.profiler.record_function(name):
                return func(*args, **kwargs)
        prof = self._profiler()
        with prof, torch.profiler.record_function(name):
            result = func(*args, **kwargs)
        self._export(prof, f"{name}_prof_rank-{self.rank}.json.gz")
        return result


class _NsightTool:
    def __init__(self, rank: int, role: str, save_path: str, tool_config):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "profiler tool nsys records CUDA activity through capture ranges, but this worker has no CUDA device; "
                "use global_profiler.tool=torch"
            )
        self.discrete = tool_config.discrete
        self.running = False

    def start(self, step: int | None) -> None:
        import torch

        if not self.discrete:
            torch.cuda.profiler.start()
            self.running = True

    def stop(self) -> None:
        import torch

        if self.running:
            torch.cuda.profiler.stop()
            self.running = False

    def around(self, name: str, func: Callable, *args, **kwargs):
        import torch

        if self.discrete:
            torch.cuda.profiler.start()
        range_id = mark_start_range(name)
        try:
            return func(*args, **kwargs)
        finally:
            mark_end_range(range_id)
            if self.discrete:
                torch.cuda.profiler.stop()


class _TorchMemoryTool:
    def __init__(self, rank: int, role: str, save_path: str, tool_config):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "profiler tool torch_memory takes CUDA memory snapshots, but this worker has no CUDA device; "
                "use global_profiler.tool=torch with tool_config.torch.contents=[cpu,memory]"
            )
        self.rank, self.role, self.save_path, self.cfg = rank, role, save_path, tool_config
        self.step: int | None = None

    def start(self, step: int | None) -> None:
        import torch

        self.step = step
        torch.cuda.memory._record_memory_history(
            max_entries=self.cfg.trace_alloc_max_entries, context=self.cfg.context, stacks=self.cfg.stacks
        )

    def stop(self) -> None:
        import torch

        path = os.path.join(
            _trace_dir(self.save_path, self.step, self.role), f"memory_snapshot_rank-{self.rank}.pickle"
        )
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        logger.info("profiler: wrote %s", path)

    def around(self, name: str, func: Callable, *args, **kwargs):
        return func(*args, **kwargs)


_TOOLS = {"torch": _TorchTool, "nsys": _NsightTool, "torch_memory": _TorchMemoryTool}


class DistProfiler:
    """One worker role's profiler on one rank (upstream's name and methods).

    `DistProfiler(rank, config, role=...)` with `config` the role's `ProfilerConfig` (its `tool`
    and `save_path` already filled from `global_profiler`, see `resolve_role_profilers`).
    `start(profile_step=N)` / `stop()` bracket a profiled step; `annotate` marks worker methods.
    """

    def __init__(self, rank: int, config: ProfilerConfig | None = None, tool_config=None, role: str = "worker", **_):
        self.config = config or ProfilerConfig()
        self.rank = rank
        self.role = role
        self._this_rank = self.config.tool is not None and self.config.profiles_rank(rank)
        self._step: int | None = None  # the profiled step in progress
        self._recording = False  # this profiler's one-trace-per-step recording is running
        self._impl = None
        if self._this_rank:
            tool_config = tool_config or self.config.selected_tool_config()
            save_path = self.config.save_path or "outputs/profile"
            self._impl = _TOOLS[self.config.tool](rank, role, save_path, tool_config)

    def check_enable(self) -> bool:
        return self.config.enable

    def check_this_rank(self) -> bool:
        return self._this_rank

    def check_this_step(self) -> bool:
        return self._step is not None

    def is_discrete_mode(self) -> bool:
        return bool(getattr(self._impl, "discrete", False))

    def start(self, profile_step: int | None = None, **_) -> None:
        """Begin step `profile_step` (this rank selected): record until `stop`, or in discrete mode
        trace each annotated call of the step on its own."""
        if self._impl is None or self._step is not None:
            return
        self._step = profile_step
        owner = _ACTIVE.get("owner")
        if owner is not None:
            logger.info("profiler: %s's calls are recorded in %s's trace (same process)", self.role, owner.role)
            return
        self._impl.start(profile_step)
        if not self.is_discrete_mode():
            _ACTIVE["owner"] = self
            self._recording = True

    def stop(self) -> None:
        """End the step and write its trace."""
        if self._step is None:
            return
        self._step = None
        if self._recording:
            self._recording = False
            _ACTIVE.pop("owner", None)
            self._impl.stop()

    def run(self, name: str, func: Callable, *args, **kwargs):
        """Call `func`, labelled `name` in the running trace (in discrete mode: in its own trace)."""
        owner = _ACTIVE.get("owner")
        if owner is not None:
            label = name if owner is self else f"{self.role}.{name}"
            return owner._impl.around(label, func, *args, **kwargs)
        if self._step is not None and self.is_discrete_mode():
            return self._impl.around(name, func, *args, **kwargs)
        return func(*args, **kwargs)

    @classmethod
    def annotate(cls, message: str | None = None, role: str | None = None, **_) -> Callable:
        """Decorate a worker method so profiled steps label it (or trace it alone, `discrete`). The
        worker's `profiler` attribute is its `DistProfiler`; methods without one run unchanged."""

        def decorator(func):
            name = message or func.__name__

            @functools.wraps(func)
            def wrapper(self_instance, *args, **kwargs):
                profiler = getattr(self_instance, "profiler", None)
                if not isinstance(profiler, DistProfiler):
                    return func(self_instance, *args, **kwargs)
                return profiler.run(name, func, self_instance, *args, **kwargs)

            return wrapper

        return decorator


class DistProfilerExtension:
    """Mixin for a worker: `start_profile` / `stop_profile` RPCs (every rank) around its
    `DistProfiler`, kept in `self.profiler`."""

    from verl.single_controller.base.decorator import Dispatch, register

    def init_profiler(self, rank: int, config: Any, role: str) -> None:
        """Build `self.profiler` from a role's `profiler` section (None: off)."""
        section = ProfilerConfig.from_config(config or {}, f"{role}.profiler")
        self.profiler = DistProfiler(rank, section, role=role)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, **kwargs) -> None:
        """Start profiling this rank for the step `profile_step` (when its role selects it)."""
        profiler = getattr(self, "profiler", None)
        if profiler is not None:
            profiler.start(**kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> None:
        """Stop profiling this rank and write the step's trace."""
        profiler = getattr(self, "profiler", None)
        if profiler is not None:
            profiler.stop()

    del Dispatch, register


class StepProfiler:
    """The driver's side: starts the workers' profilers before each listed step and stops them after
    (`global_profiler.steps`; with `profile_continuous_steps` one range per run of consecutive
    steps). `groups` are worker groups (or workers) with `start_profile` / `stop_profile`."""

    def __init__(self, config: GlobalProfilerConfig, groups: Iterable[Any] = ()):
        self.config = config
        self.groups = [g for g in groups if g is not None and hasattr(g, "start_profile")]
        self.steps = set(config.steps or ()) if config.tool is not None else set()
        self._running_since: int | None = None

    def begin(self, step: int) -> None:
        """Before training step `step`."""
        if step not in self.steps or self._running_since is not None:
            return
        self._running_since = step
        for group in self.groups:
            group.start_profile(role="e2e", profile_step=step)

    def end(self, step: int) -> None:
        """After training step `step` (also after a step that failed, so traces are written)."""
        if self._running_since is None:
            return
        if self.config.profile_continuous_steps and step + 1 in self.steps:
            return
        for group in self.groups:
            group.stop_profile()
        self._running_since = None
