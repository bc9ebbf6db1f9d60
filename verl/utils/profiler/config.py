"""Profiler configuration, upstream's classes: a role's `profiler` section (`ProfilerConfig`), its
per-tool settings (`NsightToolConfig`, `TorchProfilerToolConfig`, `TorchMemoryToolConfig`,
`NPUToolConfig`) and the trainer-level `global_profiler` section (`GlobalProfilerConfig`, ours:
upstream reads that section as a DictConfig).

`global_profiler`: `tool` (null: off, `torch`, `nsys`, `torch_memory`), `steps` (the training steps
to profile, 1-based), `profile_continuous_steps` (one trace over a run of consecutive listed steps
instead of one per step), `save_path`, `global_tool_config` (`nsys.{discrete,
controller_nsight_options, worker_nsight_options}`, `torch_memory.{trace_alloc_max_entries, ...}`).

A role's `profiler` (`actor_rollout_ref.{actor,rollout,ref}.profiler`, `critic.profiler`,
`reward_model.profiler`): `enable`, `all_ranks` / `ranks` (default rank 0), `tool` and `save_path`
(null: the global ones, as upstream's YAML interpolates them), `tool_config.<tool>`, each entry
built into its tool class (the YAML names it with `_target_`, as upstream's does).

Design decisions:
- One class per section, used everywhere: the schema (validator, docs) reads `ProfilerConfig`'s
  and `GlobalProfilerConfig`'s `doc(...)` metadata, the typed actor/critic/rollout/reward-model
  sections hold a `ProfilerConfig`, and the workers build their `DistProfiler` from it.
- Light: imports neither torch nor the profiler's tools, so the typed sections that hold it stay
  importable by light tools (docgen, the validator).
- Checked when built, each refusal naming the setting that fixes it: an unknown tool, `npu`
  (Ascend hardware this build does not support; `NPUToolConfig` still builds, as the default YAML
  carries its entry), a `torch` content only SGLang's server profiler understands, and `nsys`
  where Nsight Systems is not installed (`check_tool_available`, when profiling is on).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from verl.base_config import NPU, BaseConfig, doc

__all__ = [
    "PROFILER_TOOLS",
    "TOOL_CONFIGS",
    "torch_contents",
    "GlobalProfilerConfig",
    "NPUToolConfig",
    "NsightToolConfig",
    "PrecisionDebuggerToolConfig",
    "ProfilerConfig",
    "TorchProfilerScheduleConfig",
    "TorchMemoryToolConfig",
    "TorchProfilerToolConfig",
    "check_tool_available",
    "resolve_role_profilers",
]

PROFILER_TOOLS = ("torch", "nsys", "torch_memory")
"""The tools this build runs (upstream's `npu` is refused: see `_check_tool`)."""
_TOOL_CHOICES = ("nsys", "npu", "torch", "torch_memory")


def torch_contents() -> tuple[str, ...]:
    """What `tool_config.torch.contents` may list: torch.profiler's activities (the host's and the
    accelerator's, by the name verl.utils.device gives it) and its record options. Imported when a
    config lists contents, so the config classes load without torch otherwise."""
    from verl.utils.device import ACCELERATOR_NAME

    return ("cpu", ACCELERATOR_NAME, "memory", "shapes", "stack")


# upstream options that only its SGLang server profiler reads
_SGLANG_CONTENTS = ("profile-by-stage", "merge-profiles")
_NPU_CONTENTS = ("npu", "cpu", "memory", "shapes", "module", "stack")
_NPU_LEVELS = ("level_none", "level0", "level1", "level2")
_ROLE_SECTIONS = (
    ("actor_rollout_ref", "actor"),
    ("actor_rollout_ref", "rollout"),
    ("actor_rollout_ref", "ref"),
    ("critic",),
    ("reward_model",),
)


def _positive_int(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}={value!r} must be a positive whole number")


@dataclass
class NsightToolConfig(BaseConfig):
    """`tool_config.nsys` / `global_tool_config.nsys`: Nsight Systems."""

    discrete: bool | None = False
    """True: one capture range per profiled worker call; False: one per profiled step. A role's
    section interpolates `global_profiler.global_tool_config.nsys.discrete` without a default, as
    upstream's does, so a section read apart from its full config (an agent loop's view of the
    rollout section) gets null: read as False, as upstream's truthiness test reads it."""
    name: str = "nsight"
    controller_nsight_options: dict | None = None
    """`nsys profile` options for the driver's TaskRunner process (Ray's `runtime_env.nsight`)."""
    worker_nsight_options: dict | None = None
    """`nsys profile` options for each worker process (Ray's `runtime_env.nsight`)."""

    def __post_init__(self) -> None:
        if self.discrete is None:
            object.__setattr__(self, "discrete", False)


_SCHEDULE_KEYS = ("skip_first", "wait", "warmup", "active", "repeat")


@dataclass
class TorchProfilerScheduleConfig(BaseConfig):
    """`tool_config.torch.schedule`: upstream's torch.profiler.schedule arguments (all 0: none; the only
    value accepted here, see TorchProfilerToolConfig.schedule)."""

    skip_first: int = 0
    wait: int = 0
    warmup: int = 0
    active: int = 0
    repeat: int = 0


def _no_token_window(tool: BaseConfig, name: str) -> None:
    for key in ("profile_token_start", "profile_token_end"):
        if getattr(tool, key) is not None:
            raise ValueError(
                f"profiler tool_config.{name}.{key}={getattr(tool, key)!r} selects tokens of upstream's rollout-server "
                "profiler, not implemented here; leave it null"
            )


@dataclass
class TorchProfilerToolConfig(BaseConfig):
    """`tool_config.torch`: what torch.profiler records."""

    step_start: int = 0
    """Upstream's SGLang-server option; only the default (0) is accepted."""
    step_end: int = -1
    """Upstream's SGLang-server option; only the default (-1) is accepted."""
    contents: list[str] = field(default_factory=list)
    """Any of cpu, cuda (activities; none listed: both where present), memory (allocations),
    shapes (input shapes), stack (Python stacks)."""
    discrete: bool = False
    """True: one trace per profiled worker call (update_actor, compute_log_prob, ...) instead of one
    per profiled step."""
    name: str = "torch"
    profile_token_start: int | None = None
    """Upstream's rollout-server option (profile from this generated token); only null is accepted."""
    profile_token_end: int | None = None
    """Upstream's rollout-server option (profile up to this token); only null is accepted."""
    schedule: dict = field(default_factory=dict)
    """Upstream's torch.profiler.schedule (skip_first, wait, warmup, active, repeat; all 0: no
    schedule, the whole profiled call is recorded). Only the all-zero schedule is accepted here."""

    def __post_init__(self) -> None:
        sched = {k: v for k, v in dict(self.schedule or {}).items() if k != "_target_"}
        unknown_sched = sorted(set(sched) - set(_SCHEDULE_KEYS))
        if unknown_sched:
            raise ValueError(
                f"profiler tool_config.torch.schedule has unknown keys {unknown_sched}; valid: {_SCHEDULE_KEYS}"
            )
        if any(sched.get(k, 0) for k in _SCHEDULE_KEYS):
            raise ValueError(
                f"profiler tool_config.torch.schedule={sched}: torch.profiler schedules are not implemented here (each "
                "profiled call is recorded whole); leave every schedule value at 0 and choose the steps with "
                "global_profiler.steps"
            )
        object.__setattr__(self, "schedule", {k: int(sched.get(k, 0)) for k in _SCHEDULE_KEYS})
        _no_token_window(self, "torch")
        if not isinstance(self.contents, list | tuple):
            raise ValueError(f"profiler tool_config.torch.contents={self.contents!r} must be a list")
        object.__setattr__(self, "contents", list(self.contents))
        sglang = [c for c in self.contents if c in _SGLANG_CONTENTS]
        if sglang:
            raise ValueError(
                f"profiler tool_config.torch.contents {sglang} are options of upstream's SGLang server profiler, which "
                f"this build does not run; use {list(torch_contents())}"
            )
        valid = torch_contents() if self.contents else ()
        unknown = [c for c in self.contents if c not in valid]
        if unknown:
            raise ValueError(f"profiler tool_config.torch.contents {unknown} are unknown; valid: {list(valid)}")
        if (self.step_start, self.step_end) != (0, -1):
            raise ValueError(
                "profiler tool_config.torch.step_start/step_end select steps of upstream's SGLang server profiler, not "
                "implemented here; list the steps in global_profiler.steps instead"
            )


@dataclass
class TorchMemoryToolConfig(BaseConfig):
    """`tool_config.torch_memory` / `global_tool_config.torch_memory`: CUDA memory snapshots
    (torch.cuda.memory._record_memory_history, then _dump_snapshot)."""

    trace_alloc_max_entries: int = 100_000
    """Allocation events kept."""
    stack_depth: int = 32
    """Frames recorded per allocation."""
    name: str = "torch_memory"
    context: str = "all"
    """Which events get a stack (`_record_memory_history`'s `context`)."""
    stacks: str = "all"
    """Python and/or C++ stacks (`_record_memory_history`'s `stacks`)."""
    kw_args: dict = field(default_factory=dict)
    """More keyword arguments for `_record_memory_history`."""

    def __post_init__(self) -> None:
        _positive_int(self.trace_alloc_max_entries, "torch_memory.trace_alloc_max_entries")
        _positive_int(self.stack_depth, "torch_memory.stack_depth")


@dataclass
class NPUToolConfig(NsightToolConfig):
    """`tool_config.npu`: upstream's Ascend profiler settings. Built (the default YAML carries the
    entry) and checked, but selecting the tool is refused: this build does not support Ascend NPUs."""

    contents: list[str] = field(default_factory=list)
    """Any of npu, cpu, memory, shapes, module, stack."""
    level: str = "level0"
    """Collection level: level_none, level0, level1, level2."""
    analysis: bool = False
    """Parse the collected data automatically."""
    name: str = "npu"
    profile_token_start: int | None = None
    """Upstream's rollout-server option; only null is accepted."""
    profile_token_end: int | None = None
    """Upstream's rollout-server option; only null is accepted."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _no_token_window(self, "npu")
        if not isinstance(self.contents, list | tuple):
            raise ValueError(f"profiler tool_config.npu.contents={self.contents!r} must be a list")
        object.__setattr__(self, "contents", list(self.contents))
        unknown = [c for c in self.contents if c not in _NPU_CONTENTS]
        if unknown:
            raise ValueError(f"profiler tool_config.npu.contents {unknown} are unknown; valid: {list(_NPU_CONTENTS)}")
        if self.level not in _NPU_LEVELS:
            raise ValueError(f"profiler tool_config.npu.level={self.level!r} is unknown; valid: {list(_NPU_LEVELS)}")


@dataclass
class PrecisionDebuggerToolConfig(BaseConfig):
    """`tool_config.precision_debugger` / `global_tool_config.precision_debugger`: upstream's msprobe
    precision debugger (Ascend tooling). Its settings are checked; selecting the tool is refused (it is
    not one of `profiler.tool`'s choices here)."""

    config_path: str | None = None
    """msprobe's JSON config."""
    steps: list[int] | None = None
    """Deprecated upstream (global_profiler.steps chooses the steps)."""
    stages: list[str] | None = None
    """Stages to record (actor_update, actor_compute_log_prob, ...)."""
    strict: bool = False
    """Fail on an unknown stage or a missing msprobe."""
    name: str = "precision_debugger"


TOOL_CONFIGS: dict[str, type[BaseConfig]] = {
    "nsys": NsightToolConfig,
    "npu": NPUToolConfig,
    "torch": TorchProfilerToolConfig,
    "torch_memory": TorchMemoryToolConfig,
    "precision_debugger": PrecisionDebuggerToolConfig,
}
"""`tool_config` key -> the class its entry builds into (the YAML's `_target_`s name the same)."""


def _default_tool_configs() -> dict[str, BaseConfig]:
    """The YAML's `tool_config` (whose npu entry sets `analysis: true`, unlike the class default)."""
    defaults = {name: cls() for name, cls in TOOL_CONFIGS.items()}
    defaults["npu"] = NPUToolConfig(analysis=True)
    return defaults


def _build(cls: type, node: Any, where: str):
    """`cls` from a config node (DictConfig, mapping or an instance); errors name `where`."""
    from verl.utils.config import omega_conf_to_dataclass

    if isinstance(node, cls):
        return node
    try:
        return omega_conf_to_dataclass(node if node is not None else {}, cls)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _check_tool(tool: Any, where: str) -> None:
    if tool is None or tool in PROFILER_TOOLS:
        return
    if tool == "npu":
        raise ValueError(
            f"{where}=npu profiles Ascend NPUs, hardware this build does not support; use {where}=torch "
            "(or nsys on NVIDIA GPUs)"
        )
    raise ValueError(f"{where}={tool!r} is not a profiler tool; valid: null (off), {', '.join(PROFILER_TOOLS)}")


def check_tool_available(tool: str | None) -> None:
    """Refuse a tool this machine cannot run, naming what is missing."""
    if tool == "nsys" and shutil.which("nsys") is None:
        raise RuntimeError(
            "global_profiler.tool=nsys needs NVIDIA Nsight Systems (the `nsys` program), which is not installed on "
            "this machine (not on PATH); install Nsight Systems, or use global_profiler.tool=torch"
        )


@dataclass
class ProfilerConfig(BaseConfig):
    """Profiling of one role's work (global_profiler picks the steps, and the tool unless the role names one)."""

    tool: str | None = doc(
        "Profiler (follows global_profiler.tool).", choices=_TOOL_CHOICES, hardware_values={"npu": NPU}, default=None
    )
    enable: bool = doc("Profile this role at global_profiler.steps.", default=False)
    all_ranks: bool = doc("Profile every rank (else `ranks`, else rank 0).", default=False)
    ranks: list[int] = doc("Ranks to profile when all_ranks is false.", default_factory=list)
    save_path: str | None = doc(
        "Directory of the traces (follows global_profiler.save_path).", default="outputs/profile"
    )
    tool_config: dict | None = doc(
        "Per-tool options, each built into its class: {nsys: NsightToolConfig(discrete), torch: "
        "TorchProfilerToolConfig(contents, discrete), torch_memory: TorchMemoryToolConfig(...), npu: NPUToolConfig}.",
        default_factory=_default_tool_configs,
    )
    global_tool_config: dict | None = doc(
        "Upstream's slot for the global tool settings (read from global_profiler.global_tool_config instead).",
        optional=True,
        default=None,
    )

    def __post_init__(self) -> None:
        _check_tool(self.tool, "profiler.tool")
        if not isinstance(self.ranks, list | tuple | set):
            raise ValueError(f"profiler.ranks={self.ranks!r} must be a list of ranks")
        object.__setattr__(self, "ranks", [int(r) for r in self.ranks])
        object.__setattr__(self, "tool_config", self._built_tool_configs())

    def _built_tool_configs(self) -> dict[str, BaseConfig]:
        node = self.tool_config
        if node is None:
            return _default_tool_configs()
        if not isinstance(node, Mapping):
            raise ValueError(f"profiler.tool_config={node!r} must be a mapping of tool name -> settings")
        unknown = sorted(set(node) - set(TOOL_CONFIGS))
        if unknown:
            raise ValueError(f"profiler.tool_config has unknown tool(s) {unknown}; valid: {list(TOOL_CONFIGS)}")
        built = _default_tool_configs()
        for name, entry in node.items():
            built[name] = _build(TOOL_CONFIGS[name], entry, f"profiler.tool_config.{name}")
        return built

    @classmethod
    def from_config(cls, node: Any, where: str = "profiler") -> ProfilerConfig:
        """Build from a config node (DictConfig, mapping, or an instance, returned as is)."""
        return _build(cls, node, where)

    def selected_tool_config(self) -> BaseConfig | None:
        """The selected tool's settings (None: no tool)."""
        return None if self.tool is None else self.tool_config[self.tool]

    def profiles_rank(self, rank: int) -> bool:
        """Whether this rank records when the role is profiled."""
        if not self.enable:
            return False
        if self.all_ranks:
            return True
        return rank in self.ranks if self.ranks else rank == 0

    def union(self, other: ProfilerConfig) -> ProfilerConfig:
        """Profile where either does (same tool): enable/all_ranks or-ed, ranks joined."""
        self._same_tool(other, "union")
        return dataclasses.replace(
            self,
            enable=self.enable or other.enable,
            all_ranks=self.all_ranks or other.all_ranks,
            ranks=sorted(set(self.ranks) | set(other.ranks)),
            global_tool_config=self.global_tool_config or other.global_tool_config,
        )

    def intersect(self, other: ProfilerConfig) -> ProfilerConfig:
        """Profile where both do (same tool): enable/all_ranks and-ed, ranks intersected."""
        self._same_tool(other, "intersect")
        return dataclasses.replace(
            self,
            enable=self.enable and other.enable,
            all_ranks=self.all_ranks and other.all_ranks,
            ranks=sorted(set(self.ranks) & set(other.ranks)),
            global_tool_config=self.global_tool_config or other.global_tool_config,
        )

    def _same_tool(self, other: ProfilerConfig, op: str) -> None:
        if self.tool != other.tool:
            raise ValueError(f"cannot {op} profiler configs of different tools: {self.tool} vs {other.tool}")


@dataclass
class GlobalProfilerConfig(BaseConfig):
    """Profiling: the tool, the training steps it records and where the traces go."""

    # upstream's YAML names `verl.utils.profiler.ProfilerConfig` as this section's `_target_`
    # (it never builds it from there); accepted as a name of this class
    TARGET_ALIASES: ClassVar[tuple[str, ...]] = ("verl.utils.profiler.ProfilerConfig",)

    tool: str | None = doc(
        "nsys, torch or torch_memory (npu: Ascend NPUs); null: no profiling.",
        choices=_TOOL_CHOICES,
        hardware_values={"npu": NPU},
        default=None,
    )
    steps: list[int] | None = doc("Training steps to profile (with a tool), counted from 1.", default=None)
    profile_continuous_steps: bool = doc(
        "Record consecutive profiled steps into one trace (with a tool).", default=False
    )
    save_path: str = doc("Directory of the traces.", default="outputs/profile")
    global_tool_config: dict = doc(
        "Per-tool options: nsys (discrete, controller/worker nsight options), torch_memory.", default_factory=dict
    )

    def __post_init__(self) -> None:
        _check_tool(self.tool, "global_profiler.tool")
        steps = self.steps
        if steps is not None:
            if isinstance(steps, str | bytes) or not hasattr(steps, "__iter__"):
                raise ValueError(f"global_profiler.steps={steps!r} must be a list of training steps, e.g. [1, 5]")
            steps = sorted({int(s) for s in steps})
            if any(s < 1 for s in steps):
                raise ValueError(f"global_profiler.steps={steps}: training steps count from 1")
        object.__setattr__(self, "steps", steps)
        tools = dict(self.global_tool_config or {})
        for name in ("nsys", "torch_memory", "precision_debugger"):
            if name in tools:
                tools[name] = _build(TOOL_CONFIGS[name], tools[name], f"global_profiler.global_tool_config.{name}")
        object.__setattr__(self, "global_tool_config", tools)

    @classmethod
    def from_config(cls, node: Any) -> GlobalProfilerConfig:
        """Build from the `global_profiler` node (DictConfig, mapping, or an instance, returned as is)."""
        return _build(cls, node, "global_profiler")

    @property
    def active(self) -> bool:
        return self.tool is not None and bool(self.steps)

    def nsight(self) -> NsightToolConfig:
        return self.global_tool_config.get("nsys") or NsightToolConfig()

    def worker_runtime_env(self) -> dict:
        """Ray `runtime_env` entries that start each worker under `nsys profile` (tool nsys), else {}.
        Capture ends after 6 ranges per profiled step unless the options say otherwise (as upstream)."""
        if self.tool != "nsys" or not self.active:
            return {}
        options = dict(self.nsight().worker_nsight_options or {})
        if options.get("capture-range-end") is None:
            options["capture-range-end"] = f"repeat-shutdown:{6 * len(self.steps)}"
        return {"nsight": options}

    def controller_runtime_env(self) -> dict:
        """Ray `runtime_env` entries that run the driver's TaskRunner under `nsys profile` (tool nsys), else {}."""
        if self.tool != "nsys" or not self.active:
            return {}
        return {"nsight": dict(self.nsight().controller_nsight_options or {})}


def resolve_role_profilers(config: Any) -> GlobalProfilerConfig:
    """Check `global_profiler` and fill each role's `profiler.tool` / `save_path` from it where
    they are null (in place, before the workers are built; upstream's YAML does this with
    interpolations, which a role's config loses once it is shipped to a worker on its own).
    A role that enables profiling while no tool is chosen is an error."""
    from omegaconf import open_dict

    node = config.get("global_profiler") if hasattr(config, "get") else None
    glob = GlobalProfilerConfig.from_config(node or {})
    if glob.active:
        check_tool_available(glob.tool)
    for path in _ROLE_SECTIONS:
        section = config
        for key in path:
            section = section.get(key) if section is not None and hasattr(section, "get") else None
        profiler = section.get("profiler") if section is not None and hasattr(section, "get") else None
        if profiler is None:
            continue
        where = ".".join((*path, "profiler"))
        role = ProfilerConfig.from_config(profiler, where)
        tool = role.tool or glob.tool
        if role.enable and glob.steps and tool is None:
            raise ValueError(
                f"{where}.enable=true but no tool is chosen; set global_profiler.tool=torch (or {where}.tool)"
            )
        with open_dict(profiler):
            profiler.tool = tool
            profiler.save_path = role.save_path or glob.save_path
    return glob
