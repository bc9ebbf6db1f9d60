"""Profiler configuration: upstream's `global_profiler` section and each role's `profiler` section.

`global_profiler` (trainer level): `tool` (null: off, `torch`, `nsys`, `torch_memory`), `steps`
(the training steps to profile, 1-based), `profile_continuous_steps` (one trace over a run of
consecutive listed steps instead of one per step), `save_path`, `global_tool_config`
(`nsys.{discrete, controller_nsight_options, worker_nsight_options}`,
`torch_memory.{trace_alloc_max_entries, stack_depth, ...}`).

A role's `profiler` (`actor_rollout_ref.{actor,rollout,ref}.profiler`, `critic.profiler`,
`reward_model.profiler`): `enable`, `all_ranks` / `ranks` (default rank 0), `tool` and
`save_path` (null: the global ones, as upstream's YAML interpolates them), `tool_config.<tool>`
(`torch.{contents, discrete}`, `nsys.discrete`, `torch_memory.{...}`).

Checked when built: an unknown tool, a tool for hardware this build does not support (`npu`), a
`torch` content only SGLang's server understands, and `nsys` where Nsight Systems is not installed
are refused with the setting that fixes them.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from verl.utils.device import ACCELERATOR_NAME

__all__ = [
    "PROFILER_TOOLS",
    "TORCH_CONTENTS",
    "GlobalProfilerConfig",
    "NsightToolConfig",
    "ProfilerConfig",
    "TorchMemoryToolConfig",
    "TorchProfilerToolConfig",
    "check_tool_available",
    "resolve_role_profilers",
]

PROFILER_TOOLS = ("torch", "nsys", "torch_memory")
TORCH_CONTENTS = ("cpu", ACCELERATOR_NAME, "memory", "shapes", "stack")
# upstream options that only its SGLang server profiler reads
_SGLANG_CONTENTS = ("profile-by-stage", "merge-profiles")
_ROLE_SECTIONS = (
    ("actor_rollout_ref", "actor"),
    ("actor_rollout_ref", "rollout"),
    ("actor_rollout_ref", "ref"),
    ("critic",),
    ("reward_model",),
)


def _plain(node: Any) -> dict:
    if node is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if isinstance(node, Mapping):
        return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in node.items()}
    if hasattr(node, "__dataclass_fields__"):
        return {f.name: getattr(node, f.name) for f in fields(node)}
    raise TypeError(f"expected a mapping or a dataclass profiler config, got {type(node).__name__}")


def _build(cls, node: Any, where: str):
    """`cls` from a config node; `_target_` and `name` (upstream's bookkeeping keys) are dropped,
    any other unknown key is an error naming it."""
    if isinstance(node, cls):
        return node
    values = _plain(node)
    values.pop("_target_", None)
    if "name" not in {f.name for f in fields(cls)}:
        values.pop("name", None)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; valid keys: {sorted(known)}")
    return cls(**values)


@dataclass(frozen=True)
class TorchProfilerToolConfig:
    """`tool_config.torch`: what torch.profiler records."""

    contents: tuple = ()
    """Any of cpu, cuda (activities; none listed: both where present), memory (allocations),
    shapes (input shapes), stack (Python stacks)."""
    discrete: bool = False
    """True: one trace per profiled worker call (update_actor, compute_log_prob, ...) instead of one
    per profiled step."""
    step_start: int = 0
    """Upstream's SGLang-server option; only the default (0) is accepted."""
    step_end: int = -1
    """Upstream's SGLang-server option; only the default (-1) is accepted."""
    name: str = "torch"

    def __post_init__(self):
        contents = tuple(self.contents or ())
        object.__setattr__(self, "contents", contents)
        sglang = [c for c in contents if c in _SGLANG_CONTENTS]
        if sglang:
            raise ValueError(
                f"profiler tool_config.torch.contents {sglang} are options of upstream's SGLang server profiler, which "
                f"this build does not run; use {list(TORCH_CONTENTS)}"
            )
        unknown = [c for c in contents if c not in TORCH_CONTENTS]
        if unknown:
            raise ValueError(
                f"profiler tool_config.torch.contents {unknown} are unknown; valid: {list(TORCH_CONTENTS)}"
            )
        if (self.step_start, self.step_end) != (0, -1):
            raise ValueError(
                "profiler tool_config.torch.step_start/step_end select steps of upstream's SGLang server profiler, not "
                "implemented here; list the steps in global_profiler.steps instead"
            )


@dataclass(frozen=True)
class NsightToolConfig:
    """`tool_config.nsys` / `global_tool_config.nsys`: Nsight Systems."""

    discrete: bool = False
    """True: one capture range per profiled worker call; False: one per profiled step."""
    controller_nsight_options: dict | None = None
    """`nsys profile` options for the driver's TaskRunner process (Ray's `runtime_env.nsight`)."""
    worker_nsight_options: dict | None = None
    """`nsys profile` options for each worker process (Ray's `runtime_env.nsight`)."""
    name: str = "nsight"


@dataclass(frozen=True)
class TorchMemoryToolConfig:
    """`tool_config.torch_memory`: CUDA memory snapshots (torch.cuda.memory._dump_snapshot)."""

    trace_alloc_max_entries: int = 100_000
    stack_depth: int = 32
    context: str = "all"
    stacks: str = "all"
    kw_args: dict = field(default_factory=dict)
    name: str = "torch_memory"

    def __post_init__(self):
        if not (isinstance(self.trace_alloc_max_entries, int) and self.trace_alloc_max_entries > 0):
            raise ValueError(
                f"torch_memory.trace_alloc_max_entries={self.trace_alloc_max_entries} must be a positive int"
            )


_TOOL_CONFIGS = {"torch": TorchProfilerToolConfig, "nsys": NsightToolConfig, "torch_memory": TorchMemoryToolConfig}


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


@dataclass(frozen=True)
class ProfilerConfig:
    """One role's `profiler` section (upstream's `verl.utils.profiler.ProfilerConfig` keys)."""

    tool: str | None = None
    """The tool; null: the global one (`global_profiler.tool`)."""
    enable: bool = False
    """Profile this role in the listed steps."""
    all_ranks: bool = False
    """Profile every rank of the role (else `ranks`, else rank 0)."""
    ranks: tuple = ()
    """The ranks to profile."""
    save_path: str | None = None
    """Where traces go; null: `global_profiler.save_path`."""
    tool_config: Any = None
    """{tool: its settings}; only the selected tool's entry is read (built into its dataclass)."""
    global_tool_config: Any = None
    """Upstream's slot for the global tool settings (read from `global_profiler` instead)."""

    def __post_init__(self):
        _check_tool(self.tool, "profiler.tool")
        object.__setattr__(self, "ranks", tuple(int(r) for r in (self.ranks or ())))
        if isinstance(self.tool_config, Mapping) or self.tool_config is None:
            object.__setattr__(self, "tool_config", _plain(self.tool_config))

    @classmethod
    def from_config(cls, node: Any, where: str = "profiler") -> ProfilerConfig:
        return _build(cls, node, where)

    def selected_tool_config(self):
        """The selected tool's settings as its dataclass (defaults where the section has none)."""
        if self.tool is None:
            return None
        entry = (self.tool_config or {}).get(self.tool) if isinstance(self.tool_config, Mapping) else self.tool_config
        return _build(_TOOL_CONFIGS[self.tool], entry or {}, f"profiler.tool_config.{self.tool}")

    def profiles_rank(self, rank: int) -> bool:
        """Whether this rank records when the role is profiled."""
        if not self.enable:
            return False
        if self.all_ranks:
            return True
        return rank in self.ranks if self.ranks else rank == 0


@dataclass(frozen=True)
class GlobalProfilerConfig:
    """The `global_profiler` section: which tool, which steps, where."""

    tool: str | None = None
    steps: tuple | None = None
    """Training steps to profile (1-based); null or empty: none."""
    profile_continuous_steps: bool = False
    save_path: str = "outputs/profile"
    global_tool_config: Any = None

    def __post_init__(self):
        _check_tool(self.tool, "global_profiler.tool")
        steps = self.steps
        if steps is not None:
            if isinstance(steps, (str, bytes)) or not hasattr(steps, "__iter__"):
                raise ValueError(f"global_profiler.steps={steps!r} must be a list of training steps, e.g. [1, 5]")
            steps = tuple(sorted({int(s) for s in steps}))
            if any(s < 1 for s in steps):
                raise ValueError(f"global_profiler.steps={list(steps)}: training steps count from 1")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "global_tool_config", _plain(self.global_tool_config))

    @classmethod
    def from_config(cls, node: Any) -> GlobalProfilerConfig:
        return _build(cls, node, "global_profiler")

    @property
    def active(self) -> bool:
        return self.tool is not None and bool(self.steps)

    def nsight(self) -> NsightToolConfig:
        return _build(NsightToolConfig, (self.global_tool_config or {}).get("nsys") or {}, "global_tool_config.nsys")

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
