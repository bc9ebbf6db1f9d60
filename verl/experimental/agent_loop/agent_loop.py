"""The agent-loop interface: `await loop.run_episode(engine, sample) -> Trajectory`.

An agent loop plays one conversation (an "episode") against an `AsyncRolloutEngine`: it decides
what to send to the model, what to do with what comes back (call tools, stop) and returns the
token-level record the trainer needs. Many episodes run concurrently in one event loop; the engine
batches their requests (see engine.py), so a loop is written one conversation at a time.

Token bookkeeping is the loop's contract with the trainer (`Trajectory`):
- `prompt_ids`: the first prompt, exactly as sent to the engine;
- `response_ids`: everything after it, in order: the model's tokens verbatim (never decoded and
  re-encoded, so training sees exactly what was sampled) and the tokens the loop inserted (tool
  messages rendered by the chat template);
- `response_mask`: 1 on the model's tokens, 0 on inserted ones, so only generated tokens are trained;
- `response_logprobs`: the engine's log-prob of each generated token (0 on inserted ones), when
  the rollout computes them.
`num_turns` counts messages as upstream verl does: the user prompt, each assistant turn and each
tool-response turn (a single-turn episode has 2).

Loops are chosen by name (`AGENT_LOOPS`, filled by `@register`): a sample's `agent_name` column,
else `tool_agent` when multi-turn is enabled. A name that is not registered but looks like an
import path (`my_pkg.agents.MyLoop`) is imported, so a user loop needs no change here. Upstream's
`rollout.agent.agent_loop_config_path` registers loops from a YAML list instead
(`register_agent_loops_from_file`): each entry's `name` selects the class its `_target_` names, and
its other keys become constructor keyword arguments of that loop.

Loops written against upstream's API (`run(sampling_params, **row) -> AgentLoopOutput`, one instance
per episode, talking to a `server_manager`) subclass the same `AgentLoopBase` and register the same
way; the rollout runs them through `UpstreamLoopRunner` (see upstream_api.py for what is served).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.experimental.agent_loop.engine import AsyncRolloutEngine
from verl.experimental.agent_loop.upstream_api import (
    AgentLoopMetrics,
    AgentLoopOutput,
    AsyncLLMServerManager,
    DictConfigWrap,
    upstream_sampling_params,
)
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import RolloutConfig

AGENT_LOOPS: dict[str, type[AgentLoopBase]] = {}
AGENT_LOOP_KWARGS: dict[str, dict[str, Any]] = {}
"""Constructor keyword arguments of loops registered from an agent-loop config file."""


def register(name: str):
    """Class decorator: make an `AgentLoopBase` subclass selectable as `agent_name=name`."""

    def decorate(cls):
        AGENT_LOOPS[name] = cls
        return cls

    return decorate


def _import_path(target: str):
    """The object an import path (`pkg.module.Name`) names; ImportError/AttributeError otherwise."""
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ImportError(f"{target!r} is not an import path (pkg.module.Name)")
    return getattr(importlib.import_module(module_name), attr)


def resolve_config_path(path: str) -> str:
    """An agent-loop config file's absolute path: as given when absolute, else under the working
    directory, else under the directory that holds the `verl` package (a source checkout), as
    upstream resolves it; FileNotFoundError naming the places tried."""
    import os

    import verl
    from verl.utils.fs import find_relative_file

    found, candidates = find_relative_file(path, [os.getcwd(), os.path.dirname(os.path.dirname(verl.__file__))])
    if found is not None:
        return found
    raise FileNotFoundError(
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path!r}: no such file (looked at "
        f"{', '.join(candidates)}); give an absolute path, or one relative to the working directory"
    )


def read_agent_loop_config(path: str) -> list[dict[str, Any]]:
    """The entries of an agent-loop config file (a YAML list of `{name, _target_, ...}`), checked."""
    from omegaconf import OmegaConf

    resolved = resolve_config_path(path)
    entries = OmegaConf.to_container(OmegaConf.load(resolved), resolve=True)
    where = f"agent loop config {resolved}"
    if not isinstance(entries, list):
        raise ValueError(
            f"{where} must be a YAML list of entries with `name` and `_target_`, got {type(entries).__name__}"
        )
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("_target_"):
            raise ValueError(
                f"{where}: entry {i} ({entry!r}) needs a `name` (what the `agent_name` column says) and a `_target_` "
                "(the import path of an AgentLoopBase subclass)"
            )
    return entries


def register_agent_loops_from_file(path: str) -> list[str]:
    """Register every entry of an agent-loop config file; returns the names registered.

    Classes are imported here, so a wrong `_target_` fails when the rollout is built, naming the
    entry, not at the first episode that asks for it.
    """
    names = []
    for entry in read_agent_loop_config(path):
        entry = dict(entry)
        name, target = str(entry.pop("name")), str(entry.pop("_target_"))
        try:
            cls = _import_path(target)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"agent loop {name!r} of {path}: cannot import _target_ {target!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise ValueError(
                f"agent loop {name!r} of {path}: _target_ {target!r} is not a subclass of "
                "verl.experimental.agent_loop.AgentLoopBase (override run_episode(engine, sample) -> Trajectory, "
                "or upstream's run(sampling_params, **kwargs) -> AgentLoopOutput; see docs/multi_turn.md)"
            )
        AGENT_LOOPS[name] = cls
        AGENT_LOOP_KWARGS[name] = entry
        names.append(name)
    return names


def get_agent_loop_class(name: str) -> type[AgentLoopBase]:
    if name in AGENT_LOOPS:
        return AGENT_LOOPS[name]
    if "." in name:
        try:
            cls = _import_path(name)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"agent loop {name!r} is neither registered ({sorted(AGENT_LOOPS)}) nor importable: {e}"
            ) from e
        if isinstance(cls, type) and issubclass(cls, AgentLoopBase):
            return cls
    raise ValueError(
        f"unknown agent loop {name!r}; registered loops: {sorted(AGENT_LOOPS)}, or give the import path of an "
        "AgentLoopBase subclass (e.g. my_pkg.agents.MyLoop)"
    )


@dataclass
class AgentLoopSettings:
    """What every agent loop reads (from `actor_rollout_ref.rollout` and its `multi_turn` section)."""

    response_length: int
    """Budget of response tokens per episode, generated and inserted together (rollout.response_length)."""
    max_assistant_turns: int | None = None
    """Stop after this many assistant turns (None: only the token budget limits them)."""
    max_user_turns: int | None = None
    """Stop before the (N+1)-th tool-response turn."""
    max_parallel_calls: int = 1
    """Tool calls executed per assistant turn; further calls are answered with an error."""
    max_tool_response_length: int = 256
    """Characters of a tool's answer kept in the conversation."""
    tool_response_truncate_side: str = "middle"
    """left: keep the beginning; right: keep the end; middle: keep both ends."""
    format: str = "hermes"
    """Tool-call format (tool_parser.TOOL_PARSERS)."""
    tokenization_sanity_check_mode: str = "strict"
    """strict: compare each finished episode's ids with the chat template's rendering of its messages;
    ignore_strippable: the same, ignoring whitespace; disable: no check."""
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    prompt_length: int | None = None
    """rollout.prompt_length (upstream's `ToolAgentLoop.prompt_length`; the loops here do not cut prompts)."""
    interaction_config_path: str | None = None
    """multi_turn.interaction_config_path (upstream's `ToolAgentLoop.interaction_config_file`)."""

    @classmethod
    def from_rollout_config(cls, rollout_config, apply_chat_template_kwargs: dict | None = None) -> AgentLoopSettings:
        """The settings of a rollout config (a `RolloutConfig`, or a section it is built from)."""
        config = omega_conf_to_dataclass(rollout_config, RolloutConfig)
        mt = config.multi_turn
        return cls(
            response_length=int(config.response_length),
            max_assistant_turns=mt.max_assistant_turns,
            max_user_turns=mt.max_user_turns,
            max_parallel_calls=int(mt.max_parallel_calls),
            max_tool_response_length=int(mt.max_tool_response_length),
            tool_response_truncate_side=mt.tool_response_truncate_side,
            format=mt.format,
            tokenization_sanity_check_mode=mt.tokenization_sanity_check_mode,
            apply_chat_template_kwargs=dict(apply_chat_template_kwargs or {}),
            prompt_length=None if config.prompt_length is None else int(config.prompt_length),
            interaction_config_path=mt.interaction_config_path or None,
        )


@dataclass
class AgentSample:
    """One episode's input."""

    prompt_ids: list[int]
    """The prompt as the dataset tokenised it (left padding removed)."""
    messages: list[dict] | None = None
    """The prompt's chat messages (`raw_prompt`), when the dataset returned them."""
    sampling: dict[str, Any] = field(default_factory=dict)
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    """Per-tool keyword arguments (`extra_info.tools_kwargs`): {tool: {create_kwargs: {...}, ...}}."""
    extra_info: Any = None
    index: int = 0
    interaction_kwargs: dict[str, Any] | None = None
    """The simulated user's arguments (`extra_info.interaction_kwargs`: `name` picks the interaction)."""
    row: dict[str, Any] = field(default_factory=dict)
    """Every non-tensor column of the episode's row (what upstream passes to `run` as keyword arguments)."""


@dataclass
class Trajectory:
    """One finished episode (see the module docstring for the token contract)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    num_turns: int = 2
    messages: list[dict] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    turn_scores: list[float] = field(default_factory=list)
    """The simulated user's score of each model turn it answered (upstream's `turn_scores`)."""
    tool_rewards: list[float] = field(default_factory=list)
    """The step reward of each tool call that gave one (upstream's `tool_rewards`)."""
    versions: tuple[int, int] | None = None
    """(oldest, newest) weight version that sampled its tokens, set by the rollout when the engine
    reports versions (partial rollouts); None otherwise."""
    reward_score: float | None = None
    """A score the loop computed itself (upstream's `AgentLoopOutput.reward_score`): when every episode
    of a call has one, the rollout returns them as `rm_scores` and no reward function runs."""
    extra_fields: dict[str, Any] = field(default_factory=dict)
    """Per-episode values the rollout returns as non-tensor columns (upstream's `extra_fields`)."""
    routed_experts: Any | None = None
    """MoE routing for router replay R3: [tokens, moe_layers, top_k] over prompt_ids + response_ids
    (upstream's `AgentLoopOutput.routed_experts`); set by the rollout from the episode's last model call
    when the engine records routing. None otherwise."""

    def __post_init__(self):
        assert len(self.response_ids) == len(self.response_mask), "response ids and mask must align"
        assert self.response_logprobs is None or len(self.response_logprobs) == len(self.response_ids)


class AgentLoopBase:
    """Base of agent loops, in either of two styles (module docstring):

    - this project's: `AgentLoopBase(tokenizer, settings, tools=(), interactions=None)`, one instance
      serving every episode of a rollout concurrently, overriding `run_episode(engine, sample)`;
    - upstream's: `AgentLoopBase(trainer_config, server_manager, tokenizer, processor, dataset_cls,
      dataset_config, **kwargs)`, one instance per episode, overriding `run(sampling_params, **row)`.
      The constructor keeps upstream's attributes (`config`, `server_manager`, `tokenizer`,
      `processor`, `dataset_cls`, `dataset_config`, `apply_chat_template_kwargs`, `system_prompt`,
      `loop`), and `apply_chat_template` is upstream's helper.
    """

    def __init__(self, *args, **kwargs):
        if (args and isinstance(args[0], DictConfigWrap)) or "trainer_config" in kwargs:
            self._init_upstream(*args, **kwargs)
        else:
            self._init_episodes(*args, **kwargs)

    def _init_episodes(self, tokenizer, settings: AgentLoopSettings, tools: Sequence = (), interactions=None):
        self.tokenizer = tokenizer
        self.settings = settings
        self.tools = {tool.name: tool for tool in tools}
        self.interactions = dict(interactions or {})
        """Simulated users by name (`multi_turn.interaction_config_path`); loops that have none ignore them."""

    def _init_upstream(
        self,
        trainer_config: DictConfigWrap,
        server_manager: AsyncLLMServerManager,
        tokenizer,
        processor=None,
        dataset_cls=None,
        dataset_config: DictConfigWrap | None = None,
        **kwargs,
    ):
        import asyncio

        from verl.utils.chat_template import initialize_system_prompt

        self.config = trainer_config.config
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.dataset_config = None if dataset_config is None else dataset_config.config
        data = self.dataset_config if self.dataset_config is not None else {}
        self.apply_chat_template_kwargs = dict(data.get("apply_chat_template_kwargs") or {})
        self.system_prompt = initialize_system_prompt(tokenizer, **self.apply_chat_template_kwargs)
        self.loop = asyncio.get_event_loop()

    async def run_episode(self, engine: AsyncRolloutEngine, sample: AgentSample) -> Trajectory:
        """Play one conversation and return its trajectory (this project's style)."""
        raise NotImplementedError(
            f"{type(self).__name__} must override run_episode(engine, sample) (this project's agent-loop API) or "
            "run(sampling_params, **kwargs) (upstream's); see docs/multi_turn.md"
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        """Play one conversation and return its output (upstream's style)."""
        raise NotImplementedError(f"{type(self).__name__} must override run(sampling_params, **kwargs)")

    async def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, images=None, videos=None,
        remove_system_prompt: bool = False,
    ) -> list[int]:  # fmt: skip
        """Token ids of `messages` rendered with a generation prompt (upstream's helper); with
        `remove_system_prompt` the template's default system prompt is cut from the front."""
        if images is not None or videos is not None:
            raise ValueError("images and videos are not supported by this rollout's agent loops")
        ids = await self.loop.run_in_executor(
            None,
            lambda: self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, **self.apply_chat_template_kwargs
            ),
        )
        ids = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        return ids[len(self.system_prompt) :] if remove_system_prompt else ids


def uses_upstream_api(cls: type) -> bool:
    """Whether a loop class is written in upstream's style, so it is built per episode with upstream's
    arguments: it overrides `run` and not `run_episode`, or its `run` is more derived than its
    `run_episode`. A class defining both (`ToolAgentLoop`) serves both; its subclasses that override
    neither (only handlers or `__init__`) are upstream-style, as such subclasses are written upstream."""
    mro = cls.__mro__
    run_owner = next(k for k in mro if "run" in vars(k))
    episode_owner = next(k for k in mro if "run_episode" in vars(k))
    if run_owner is AgentLoopBase:
        return False
    if episode_owner is AgentLoopBase:
        return True
    if run_owner is not episode_owner:
        return mro.index(run_owner) < mro.index(episode_owner)
    return cls is not run_owner


class UpstreamLoopRunner(AgentLoopBase):
    """Runs an upstream-style loop class as one of this project's loops: per episode, builds it with
    upstream's constructor arguments and a server manager over the episode's engine, awaits `run`
    with the row's columns, and turns its `AgentLoopOutput` into a `Trajectory`."""

    def __init__(self, loop_cls: type[AgentLoopBase], tokenizer, settings: AgentLoopSettings, trainer_config,
                 with_logprobs: bool, loop_kwargs: dict | None = None):  # fmt: skip
        super().__init__(tokenizer, settings)
        self.loop_cls = loop_cls
        self.trainer_config = trainer_config
        """What the loops see as `self.config`; its `actor_rollout_ref.rollout` gives the sampling params."""
        self.with_logprobs = with_logprobs
        self.loop_kwargs = dict(loop_kwargs or {})
        self.dataset_config = {"apply_chat_template_kwargs": dict(settings.apply_chat_template_kwargs)}

    async def run_episode(self, engine: AsyncRolloutEngine, sample: AgentSample) -> Trajectory:
        from verl.utils.dataset.rl_dataset import RLHFDataset

        manager = AsyncLLMServerManager(engine, sample.sampling, self.settings.response_length)
        loop = self.loop_cls(
            trainer_config=DictConfigWrap(self.trainer_config),
            server_manager=manager,
            tokenizer=self.tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            dataset_config=DictConfigWrap(self.dataset_config),
            **self.loop_kwargs,
        )
        rollout_config = self.trainer_config.actor_rollout_ref.rollout
        params = upstream_sampling_params(rollout_config, bool(sample.sampling.get("validate")), self.with_logprobs)
        row = {k: v for k, v in sample.row.items() if k != "agent_name"}
        if "raw_prompt" not in row:  # upstream's agent-loop rollout requires it of every row too
            raise ValueError(
                f"agent loop {self.loop_cls.__name__} (upstream's API) reads each row's chat messages as "
                "kwargs['raw_prompt'], but the batch has no raw_prompt column: set data.return_raw_chat=true"
            )
        output = await loop.run(params, **row)
        return trajectory_from_output(output, self.loop_cls.__name__)


def trajectory_from_output(output: AgentLoopOutput, loop_name: str = "agent loop") -> Trajectory:
    """A `Trajectory` from an upstream-style `AgentLoopOutput` (see upstream_api.py for the mapping)."""
    if not isinstance(output, AgentLoopOutput):
        raise TypeError(f"{loop_name}.run returned {type(output).__name__}, not an AgentLoopOutput")
    if output.multi_modal_data:
        raise ValueError(f"{loop_name} returned multi_modal_data: multi-modal prompts are not supported here")
    extra = dict(output.extra_fields)
    turn_scores = list(extra.pop("turn_scores", None) or [])
    metrics = {"generate_sequences": output.metrics.generate_sequences, "tool_calls": output.metrics.tool_calls}
    return Trajectory(
        prompt_ids=list(output.prompt_ids),
        response_ids=list(output.response_ids),
        response_mask=list(output.response_mask),
        response_logprobs=None if output.response_logprobs is None else list(output.response_logprobs),
        num_turns=int(output.num_turns),
        metrics=metrics,
        turn_scores=turn_scores,
        reward_score=output.reward_score,
        extra_fields=extra,
        routed_experts=output.routed_experts,
    )


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One model turn: what the trainer does without multi-turn."""

    async def run_episode(self, engine: AsyncRolloutEngine, sample: AgentSample) -> Trajectory:
        out = await engine.generate(sample.prompt_ids, sample.sampling, self.settings.response_length)
        return Trajectory(
            prompt_ids=list(sample.prompt_ids),
            response_ids=list(out.token_ids),
            response_mask=[1] * len(out.token_ids),
            response_logprobs=None if out.log_probs is None else list(out.log_probs),
            num_turns=2,
        )


def trajectory_info(step: int, index: list, validate: bool) -> list[dict[str, Any]]:
    """One `{step, sample_index, rollout_n, validate}` per row: `rollout_n` counts the row among the
    consecutive rows of the same `index` (the driver repeats each prompt n times in a row)."""
    info, rollout_n = [], 0
    for row, sample_index in enumerate(index):
        rollout_n = rollout_n + 1 if row > 0 and index[row - 1] == sample_index else 0
        info.append({"step": step, "sample_index": sample_index, "rollout_n": rollout_n, "validate": validate})
    return info


async def get_trajectory_info(step: int, index: list, validate: bool) -> list[dict[str, Any]]:
    """Upstream's coroutine name for `trajectory_info` (its agent loop workers await it)."""
    return trajectory_info(step, index, validate)


__all__ = [
    "AGENT_LOOPS",
    "AGENT_LOOP_KWARGS",
    "AgentLoopBase",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "AgentLoopSettings",
    "AgentSample",
    "AsyncLLMServerManager",
    "DictConfigWrap",
    "SingleTurnAgentLoop",
    "Trajectory",
    "UpstreamLoopRunner",
    "get_agent_loop_class",
    "get_trajectory_info",
    "read_agent_loop_config",
    "register",
    "register_agent_loops_from_file",
    "resolve_config_path",
    "trajectory_from_output",
    "trajectory_info",
    "uses_upstream_api",
]


def __getattr__(name: str):
    # upstream's `AgentLoopManager` is public here; it drives the trainer's worker groups, so it lives with the
    # trainer (verl.trainer.ppo.agent_loop_manager) and is imported only when asked for (no Ray at import)
    if name == "AgentLoopManager":
        from verl.trainer.ppo.agent_loop_manager import AgentLoopManager

        return AgentLoopManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
