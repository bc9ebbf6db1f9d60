"""`AgentLoopRollout`: a `BaseRollout` that plays agent loops over any other rollout.

With `actor_rollout_ref.rollout.multi_turn.enable=true` the actor worker wraps its engine (`hf`,
`vllm`, `sglang`) in this class; everything else about the worker and the trainer stays the same.
`generate_sequences` turns each row of the prompt batch into an `AgentSample`, runs every episode
concurrently in one asyncio event loop (agent loop per row: the `agent_name` column, else
`rollout.agent.default_agent_loop`), with a `MicroBatchEngine` over the wrapped rollout batching their model turns (or the
rollout's own `async_engine`, see `make_engine`), and returns the usual rollout layout:

- `prompts` [B, P]: each episode's first prompt, left-padded (P = the incoming prompt width);
- `responses` [B, R]: every turn after the prompt (model and tool turns), right-padded to
  R = rollout.response_length;
- `response_mask` [B, R]: 1 on model-generated tokens only; `attention_mask` [B, P+R]: 1 on every
  real token, tool turns included; `position_ids` continue from the prompt's last;
- `rollout_log_probs` [B, R] with `calculate_log_probs` (0 on tool tokens);
- `non_tensor_batch["__num_turns__"]`: messages per episode (the trainer reports `num_turns/*`);
- `non_tensor_batch["turn_scores"]`: with simulated users (`multi_turn.interaction_config_path`,
  verl/interactions/), each episode's list of the interaction's turn scores, as upstream;
- `non_tensor_batch["tool_extra_fields"]`: upstream's per-episode dict (`turn_scores`, `tool_rewards`, a loop's
  own `extra_fields`), which the naive and rate-limited reward managers merge into `extra_info`;
- a loop's `Trajectory.extra_fields` as non-tensor columns (None where an episode lacks a key), and,
  when every episode carries a `reward_score`, `rm_scores` [B, R] holding it at the last response
  token (the reward manager then returns them unchanged), as upstream's agent loops;
- with partial rollouts (`meta_info["partial_rollout"]`, asynchronous training) `weight_version` /
  `weight_version_max`: the oldest and newest weight version that sampled a token of the episode,
  over all its model turns. The keys are passed on to the wrapped engine with every model turn, so
  newer weights are let in between two decode steps of a turn (hf, vllm) and, as a consequence,
  also between two turns; the wrapped engine's `weight_refresh` is this rollout's;
- `meta_info["metrics"]`: `agent_loop/*` means over the episodes (tool calls, tool errors,
  tokenization mismatches) and how the engine batched them.

Tracing (`rollout.trace.backend`: mlflow or weave, upstream's `verl.utils.rollout_trace`): the
rollout configures the process's tracer once, from the trace section and the trainer's project and
experiment names (passed in by the worker, whose config is only `actor_rollout_ref`). Each episode
runs inside `rollout_trace_attr` with upstream's tags: `sample_index` (the row's `index` column, the
dataset's `extra_info.index`; else its row number), `step` (`meta_info["global_steps"]`, -1 when
absent), `rollout_n` (its rank among consecutive rows of the same index: the driver repeats a prompt
`n` times in a row) and `validate`. With `max_samples_per_step_per_worker=k` each call traces the
episodes of k sample indices drawn at random without replacement (all `n` rollouts of each, upstream's
rule; every episode when there are no more than k indices); the others run with tracing off. Spans:
the episode (`AgentLoopRollout.run_episode`, decoded with `token2text`), every model turn
(`EpisodeEngine.generate`) and every tool call (`ToolAgentLoop.call_tool`). Without a backend all of
it is a pass-through costing a context-variable read.

Over-sampling (`rollout.over_sample_rate=r`, upstream's long-tail cut, first written for its SGLang
multi-turn rollout): in a training call (not validation) of B episodes, once int(B * (1 - r)) of
them have finished (at least one), the episodes still running are cancelled; episodes that finished
in the same engine batch are kept. A cancelled episode becomes a padding row, as upstream's: its
prompt is kept, its response is all pad with `attention_mask`, `response_mask` and
`rollout_log_probs` 0 on it and `__num_turns__` 0: a response length of 0 is what marks it, as
upstream (no extra column, so workers with and without cut episodes concatenate alike). It adds
nothing to any loss (every loss is masked by `response_mask`); the trainer leaves such rows out of
its score and reward statistics and reports their share as `response/aborted_ratio` (the rollout as
`agent_loop/aborted_ratio`). Their reward is still computed and, with a group estimator (GRPO),
still enters their group's mean and std, as upstream. One deliberate difference: upstream also
zeroes the prompt's attention mask; here the prompt stays attended, because a row with no attended
token at all makes the attention softmax of the log-prob pass 0/0 (NaN) on some backends, and NaN
times a zero mask is NaN.
A model turn already inside the engine when the cut comes finishes there (a batch-synchronous engine
cannot drop one row mid-batch) and is discarded; `generate_sequences` returns only after it, so the
engine is idle when the worker next syncs weights or sleeps.

Engine tensor parallelism (an engine sharded over tp workers): episodes on different ranks would
make different numbers of engine calls, which the engine's collectives cannot match, so the group's
first rank runs every episode of the group and the others serve (`_generate_as_group`).

Deliberately left out: multi-modal prompts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch
from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import (
    AGENT_LOOP_KWARGS,
    AgentLoopBase,
    AgentLoopSettings,
    AgentSample,
    Trajectory,
    UpstreamLoopRunner,
    get_agent_loop_class,
    register_agent_loops_from_file,
    trajectory_info,
    uses_upstream_api,
)
from verl.experimental.agent_loop.engine import AsyncRolloutEngine, MicroBatchEngine, rollout_batch_generator
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import set_device
from verl.utils.ray_utils import run_sync
from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op
from verl.workers.config import MultiTurnConfig, RolloutConfig, TraceConfig
from verl.workers.rollout.base import BaseRollout

SAMPLING_KEYS = ("do_sample", "validate", "temperature", "top_k", "top_p")
# passed on with every model turn, like the sampling keys (asynchronous training's partial rollouts)
PARTIAL_ROLLOUT_KEYS = ("partial_rollout", "partial_rollout_check_steps")


def settings_from_config(rollout_config, apply_chat_template_kwargs: dict | None = None) -> AgentLoopSettings:
    """`AgentLoopSettings` from the rollout config (a `RolloutConfig`, or a section it is built from)
    and its `multi_turn` section."""
    return AgentLoopSettings.from_rollout_config(rollout_config, apply_chat_template_kwargs)


class AgentLoopRollout(BaseRollout):
    """Agent loops over a wrapped rollout engine (module docstring).

    rollout: the engine that generates (any `BaseRollout`).
    config: the rollout config, a `RolloutConfig` (a DictConfig or dict section is built into one, its
        missing keys taking the class's defaults, which are the YAML's): `response_length`,
        `calculate_log_probs`, `over_sample_rate`, `multi_turn.*`, `agent.*`, `trace.*`.
    tokenizer: the policy's tokenizer (chat template, decoding turns).
    tools: the tools; None reads `multi_turn.tool_config_path` (no path: no tools).
    apply_chat_template_kwargs: passed to every chat-template rendering (`data.apply_chat_template_kwargs`).
    project_name, experiment_name: the trainer's (`trainer.project_name` / `experiment_name`); they name
        the traces and are needed only with a trace backend (`rollout.trace.backend`).
    trainer_config: what loops written against upstream's API see as `self.config` (the worker passes
        `{"actor_rollout_ref": ...}`); None: `{"actor_rollout_ref": {"rollout": config}}`.
    """

    def __init__(
        self,
        rollout: BaseRollout,
        config,
        tokenizer,
        tools: Sequence | None = None,
        apply_chat_template_kwargs: dict | None = None,
        project_name: str | None = None,
        experiment_name: str | None = None,
        trainer_config=None,
    ):
        config = omega_conf_to_dataclass(config, RolloutConfig)
        # what upstream-style loops see as self.config (they read actor_rollout_ref.rollout by attribute)
        if trainer_config is None:
            trainer_config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=config))
        elif isinstance(trainer_config, dict):
            trainer_config = OmegaConf.create(trainer_config)
        self.trainer_config = trainer_config
        tp = int(config.tensor_model_parallel_size)
        self._tp_group = getattr(rollout, "_tp_group", None)
        self._tp_rank = int(getattr(rollout, "_tp_rank", 0))
        self._tp_size = int(getattr(rollout, "_tp_size", 1))
        if tp > 1 and self._tp_size != tp:
            raise ValueError(
                f"multi-turn rollouts with actor_rollout_ref.rollout.tensor_model_parallel_size={tp} need an engine "
                f"that shards over a tensor-parallel group of workers ({type(rollout).__name__} does not: it runs "
                "one engine per worker); use rollout.name=vllm, or set tensor_model_parallel_size=1"
            )
        self.over_sample_rate = float(config.over_sample_rate)
        if not 0.0 <= self.over_sample_rate < 1.0:
            raise ValueError(
                f"actor_rollout_ref.rollout.over_sample_rate={self.over_sample_rate} must be in [0, 1): it is the "
                "share of each batch's episodes cut once the others have finished (0: none)"
            )
        _init_tracing(config.trace, project_name, experiment_name)
        self.inner = rollout
        self.tokenizer = tokenizer
        self.settings = settings_from_config(config, apply_chat_template_kwargs)
        # rows without an `agent_name` column run rollout.agent.default_agent_loop (upstream's rule)
        self.default_agent = str(config.agent.default_agent_loop)
        if config.agent.agent_loop_config_path:
            register_agent_loops_from_file(config.agent.agent_loop_config_path)
        self.with_logprobs = bool(config.calculate_log_probs)
        if tools is None and config.multi_turn.tool_config_path:
            from verl.tools.utils.tool_registry import initialize_tools_from_config

            tools = initialize_tools_from_config(config.multi_turn.tool_config_path)
        self.tools = list(tools or [])
        self.interactions = _load_interactions(config.multi_turn)
        self._loops: dict[str, AgentLoopBase] = {}
        # The current CUDA device is per thread and a new thread starts on device 0: bind the engine
        # thread to this worker's device, so whatever the wrapped engine allocates, captures or
        # launches there lands where its weights live (the built-in engine also sets it itself).
        self._engine_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rollout-engine", initializer=set_device
        )

    # -------------------------------------------------------------------- engine (delegated)
    @property
    def weight_refresh(self):
        """The wrapped engine's (set by the rollout worker of asynchronous training)."""
        return getattr(self.inner, "weight_refresh", None)

    @weight_refresh.setter
    def weight_refresh(self, refresh) -> None:
        self.inner.weight_refresh = refresh

    def update_weights(self, named_tensors):
        return self.inner.update_weights(named_tensors)

    def sleep(self, *args, **kwargs) -> None:
        self.inner.sleep(*args, **kwargs)

    def wake_up(self) -> None:
        self.inner.wake_up()

    def release(self) -> None:
        self.inner.release()

    def speed_paths(self):
        return self.inner.speed_paths()

    # ----------------------------------------------------------------------------- episodes
    def agent_loop(self, name: str) -> AgentLoopBase:
        if name not in self._loops:
            cls = get_agent_loop_class(name)
            if uses_upstream_api(cls):  # built per episode with upstream's arguments (upstream_api.py)
                self._loops[name] = UpstreamLoopRunner(
                    cls, self.tokenizer, self.settings, self.trainer_config, self.with_logprobs,
                    AGENT_LOOP_KWARGS.get(name, {}),
                )  # fmt: skip
                return self._loops[name]
            extra = {"interactions": self.interactions} if self.interactions else {}
            extra.update(AGENT_LOOP_KWARGS.get(name, {}))
            self._loops[name] = cls(self.tokenizer, self.settings, self.tools, **extra)
        return self._loops[name]

    def _token_ids(self, meta: dict) -> tuple[list[int], int]:
        eos = meta.get("eos_token_id", self.tokenizer.eos_token_id)
        eos_ids = [] if eos is None else [int(eos)] if np.isscalar(eos) else [int(e) for e in eos]
        pad = meta.get("pad_token_id", self.tokenizer.pad_token_id)
        pad = eos_ids[0] if pad is None and eos_ids else pad
        if pad is None:
            raise ValueError("the rollout cannot tell which token pads responses: put pad_token_id in meta_info")
        return eos_ids, int(pad)

    @staticmethod
    def samples(prompts, meta: dict) -> list[AgentSample]:
        """One `AgentSample` per row of a left-padded prompt batch."""
        ids, mask = prompts.batch["input_ids"].cpu(), prompts.batch["attention_mask"].cpu().bool()
        nt = prompts.non_tensor_batch
        sampling = {k: meta[k] for k in SAMPLING_KEYS + PARTIAL_ROLLOUT_KEYS if k in meta}
        out = []
        for i in range(len(ids)):
            extra = nt["extra_info"][i] if "extra_info" in nt else None
            tools_kwargs = nt["tools_kwargs"][i] if "tools_kwargs" in nt else None
            if tools_kwargs is None and isinstance(extra, dict):
                tools_kwargs = extra.get("tools_kwargs")
            messages = nt["raw_prompt"][i] if "raw_prompt" in nt else None
            interaction_kwargs = nt["interaction_kwargs"][i] if "interaction_kwargs" in nt else None
            if interaction_kwargs is None and isinstance(extra, dict):
                interaction_kwargs = extra.get("interaction_kwargs")
            out.append(
                AgentSample(
                    prompt_ids=ids[i][mask[i]].tolist(),
                    messages=None if messages is None else [dict(m) for m in messages],
                    sampling=dict(sampling),
                    tools_kwargs=dict(tools_kwargs or {}),
                    extra_info=extra,
                    index=i,
                    interaction_kwargs=None if interaction_kwargs is None else dict(interaction_kwargs),
                    row={key: column[i] for key, column in nt.items()},
                )
            )
        return out

    def make_engine(self, eos_ids: list[int], pad: int) -> AsyncRolloutEngine:
        """The engine the episodes call: the wrapped rollout's own async engine when it offers one
        (`rollout.async_engine(eos_token_ids, pad_token_id, with_logprobs)`, e.g. an adapter over a
        server that schedules requests itself), else a `MicroBatchEngine` over its `generate_sequences`."""
        factory = getattr(self.inner, "async_engine", None)
        if factory is not None:
            return factory(eos_ids, pad, self.with_logprobs)
        return MicroBatchEngine(
            rollout_batch_generator(self.inner, eos_ids, pad, self.with_logprobs), executor=self._engine_thread
        )

    @rollout_trace_op
    async def run_episode(self, engine: AsyncRolloutEngine, sample: AgentSample, agent_name: str) -> Trajectory:
        """One episode through the named loop (a span of its own when traced)."""
        return await self.agent_loop(agent_name).run_episode(engine, sample)

    async def run_episodes(
        self,
        samples: list[AgentSample],
        agent_names: list[str],
        eos_ids,
        pad,
        traces: list[dict] | None = None,
        num_to_finish: int | None = None,
    ) -> tuple:
        """Every episode concurrently; returns (trajectories in sample order, engine batch stats or None).

        Each trajectory's `versions` are the (oldest, newest) weight versions its model turns report
        (None when the engine reports none). `traces`: per sample, the `rollout_trace_attr` keyword
        arguments (None: no tags). `num_to_finish`: cancel the episodes still running once this many
        have finished; their trajectories are None (None: wait for all)."""
        engine = self.make_engine(eos_ids, pad)

        async def episode(sample: AgentSample, name: str, trace: dict) -> Trajectory:
            episode_engine = EpisodeEngine(engine, self.tokenizer)
            with rollout_trace_attr(**trace):
                async with engine.client():
                    trajectory = await self.run_episode(episode_engine, sample, name)
            trajectory.versions = episode_engine.versions()
            if trajectory.routed_experts is None and episode_engine.routed_experts is not None:
                trajectory.routed_experts = episode_engine.routed_experts
            return trajectory

        traces = traces or [{"trace": False}] * len(samples)
        tasks = [asyncio.ensure_future(episode(*args)) for args in zip(samples, agent_names, traces)]
        try:
            if num_to_finish is not None and num_to_finish < len(tasks):
                await _wait_for_finished(tasks, num_to_finish)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                trajectories = [_result_unless_cancelled(task) for task in tasks]
            else:
                trajectories = await asyncio.gather(*tasks)
            return trajectories, getattr(engine, "stats", None)
        finally:
            for task in tasks:
                task.cancel()
            if hasattr(engine, "aclose"):
                await engine.aclose()
            if isinstance(engine, MicroBatchEngine):
                # a batch of cancelled episodes may still run in the engine thread: return only when it
                # is idle (the thread runs jobs in order), so weight sync or sleep never meets a live batch
                await asyncio.get_running_loop().run_in_executor(self._engine_thread, _idle)

    def generate_sequences(self, prompts):
        if self._tp_size > 1:
            return self._generate_as_group(prompts)
        return self._generate_episodes(prompts)

    def _generate_as_group(self, prompts):
        """Tensor-parallel engine: the group's first rank runs every episode of the group, the others serve.

        The engine's ranks must make the same calls in the same order, which episodes on different
        ranks (each its own number of turns) cannot. So, as upstream's server mode does, one agent
        loop drives the engine: the group's prompts are gathered to its first rank, which runs them;
        before each of its engine calls it broadcasts the call, and the other ranks enter the engine
        with no requests of their own (the engine runs the union of the group's requests, see
        external_engine.py). At the end the leader broadcasts the finished batch and each rank keeps
        its own rows.
        """
        import torch.distributed as dist

        from verl.protocol import DataProto

        group, leader = self._tp_group, dist.get_global_rank(self._tp_group, 0)
        parts: list = [None] * self._tp_size
        dist.all_gather_object(parts, prompts, group=group)
        n = int(prompts.meta_info.get("n", 1))
        lo = sum(len(p) for p in parts[: self._tp_rank]) * n
        hi = lo + len(prompts) * n
        if self._tp_rank == 0:
            inner = self.inner
            self.inner = _BroadcastingRollout(inner, group, leader)
            try:
                out = self._generate_episodes(DataProto.concat(parts))
            finally:
                self.inner = inner
                dist.broadcast_object_list([None], src=leader, group=group)  # release the servers
            message = [out]
        else:
            while True:
                message = [None]
                dist.broadcast_object_list(message, src=leader, group=group)
                if message[0] is None:
                    break
                self.inner.generate_sequences(_no_requests(message[0]))
            message = [None]
        dist.broadcast_object_list(message, src=leader, group=group)
        out = message[0]
        return out.slice(lo, hi) if hasattr(out, "slice") else out[lo:hi]

    def _generate_episodes(self, prompts):
        start = time.perf_counter()
        meta = dict(prompts.meta_info)
        n = int(meta.get("n", 1))
        if n > 1:
            prompts = prompts.repeat(repeat_times=n, interleave=True)
        eos_ids, pad = self._token_ids(meta)
        refresh = self.weight_refresh if meta.get("partial_rollout") else None
        first_version = None if refresh is None else int(refresh.version)
        samples = self.samples(prompts, meta)
        names = prompts.non_tensor_batch.get("agent_name")
        names = [self.default_agent if not name else str(name) for name in names] if names is not None else None
        num_to_finish = None
        if self.over_sample_rate > 0 and not meta.get("validate", False):  # upstream never cuts validation
            num_to_finish = max(1, int(len(samples) * (1 - self.over_sample_rate)))
        trajectories, stats = run_sync(
            self.run_episodes(
                samples,
                names or [self.default_agent] * len(samples),
                eos_ids,
                pad,
                traces=trace_attributes(prompts, meta),
                num_to_finish=num_to_finish,
            )
        )

        out = trajectories_to_proto(prompts, trajectories, self.settings.response_length, pad, self.with_logprobs, meta)
        finished = [t for t in trajectories if t is not None]
        if refresh is not None:  # an episode whose turns reported no version sampled only with the first
            for key, pick in (("weight_version", 0), ("weight_version_max", 1)):
                out.non_tensor_batch[key] = np.array(
                    [first_version if t is None or t.versions is None else t.versions[pick] for t in trajectories],
                    dtype=np.int64,
                )
        metrics = dict(meta.get("metrics", {}))
        metrics.update(_episode_metrics(finished))
        if num_to_finish is not None:
            metrics["agent_loop/aborted_ratio"] = 1.0 - len(finished) / len(trajectories)
        if stats is not None:
            metrics["agent_loop/engine_batches"] = float(stats.num_batches)
            metrics["agent_loop/engine_batch_size_mean"] = stats.num_requests / max(stats.num_batches, 1)
            metrics["timing_s/agent_loop_generate"] = stats.generate_s
        metrics["timing_s/agent_loop"] = time.perf_counter() - start
        out.meta_info["metrics"] = metrics
        return out


def _init_tracing(trace: TraceConfig, project_name: str | None, experiment_name: str | None) -> None:
    """Configure this process's rollout tracer from the rollout config's `trace` section (once per process:
    `RolloutTraceConfig.init` keeps the first choice)."""
    if trace.backend is None:
        return
    if project_name is None or experiment_name is None:
        raise ValueError(
            f"actor_rollout_ref.rollout.trace.backend={trace.backend} names traces after the trainer's project and "
            "experiment: pass project_name and experiment_name to AgentLoopRollout (the worker passes "
            "trainer.project_name / trainer.experiment_name)"
        )
    limit = trace.max_samples_per_step_per_worker
    RolloutTraceConfig.init(
        project_name,
        experiment_name,
        trace.backend,
        bool(trace.token2text),
        None if limit is None else int(limit),
    )


def trace_attributes(prompts, meta: dict) -> list[dict]:
    """Per row, the `rollout_trace_attr` keyword arguments (module docstring: tags and which rows are traced)."""
    B = len(prompts)
    if RolloutTraceConfig.get_backend() is None:
        return [{"trace": False}] * B
    nt = prompts.non_tensor_batch
    if "index" in nt:
        index = list(nt["index"])
    elif "extra_info" in nt:
        index = [e.get("index", i) if isinstance(e, dict) else i for i, e in enumerate(nt["extra_info"])]
    else:
        index = list(range(B))
    index = [i.item() if isinstance(i, np.generic) else i for i in index]
    limit = RolloutTraceConfig.get_instance().max_samples_per_step_per_worker
    unique = list(dict.fromkeys(index))
    if limit is not None and limit < len(unique):
        chosen = np.random.choice(len(unique), int(limit), replace=False)
        traced = {unique[int(k)] for k in chosen}
    else:
        traced = set(unique)
    step, validate = int(meta.get("global_steps", -1)), bool(meta.get("validate", False))
    return [
        {**info, "name": "agent_loop", "trace": info["sample_index"] in traced}
        for info in trajectory_info(step, index, validate)
    ]


async def _wait_for_finished(tasks: list[asyncio.Task], count: int) -> None:
    """Return once `count` tasks have finished (an episode's error is raised at once)."""
    pending = set(tasks)
    while len(tasks) - len(pending) < count:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()


def _result_unless_cancelled(task: asyncio.Task):
    if task.cancelled():
        return None
    return task.result()


def _idle() -> None:
    """A no-op job: when the engine thread runs it, every job queued before it has finished."""


class EpisodeEngine(AsyncRolloutEngine):
    """One episode's view of the shared engine: passes every call through (a traced span per model
    turn) and keeps the oldest and newest weight version the engine reported for its model turns, and
    the routing its last model call recorded (R3: that call's forwards saw the whole context)."""

    def __init__(self, engine: AsyncRolloutEngine, tokenizer=None):
        self.engine = engine
        self.tokenizer = tokenizer  # decodes the traced turns with trace.token2text
        self.low: int | None = None
        self.high: int | None = None
        self.routed_experts = None

    @rollout_trace_op
    async def generate(self, prompt_ids, sampling, max_new_tokens):
        out = await self.engine.generate(prompt_ids, sampling, max_new_tokens)
        if out.version_min is not None and out.token_ids:
            self.low = out.version_min if self.low is None else min(self.low, out.version_min)
            high = out.version_max if out.version_max is not None else out.version_min
            self.high = high if self.high is None else max(self.high, high)
        if out.routed_experts is not None:
            self.routed_experts = out.routed_experts
        return out

    def client(self):
        return self.engine.client()

    def versions(self) -> tuple[int, int] | None:
        return None if self.low is None else (self.low, self.high)


class _BroadcastingRollout:
    """The group leader's engine: announces each call (its meta_info) to the serving ranks first."""

    def __init__(self, inner, group, leader: int):
        self.inner, self.group, self.leader = inner, group, leader

    def generate_sequences(self, batch):
        import torch.distributed as dist

        dist.broadcast_object_list([dict(batch.meta_info)], src=self.leader, group=self.group)
        return self.inner.generate_sequences(batch)


def _no_requests(meta: dict):
    """An empty prompt batch with the leader's call's meta_info: a serving rank's share of a call."""
    from verl.protocol import DataProto

    empty = torch.zeros((0, 1), dtype=torch.long)
    return DataProto.from_dict(
        tensors={"input_ids": empty, "attention_mask": empty.clone(), "position_ids": empty.clone()}, meta_info=meta
    )


def _load_interactions(multi_turn: MultiTurnConfig) -> dict:
    if not multi_turn.interaction_config_path:
        return {}
    from verl.interactions.utils.interaction_registry import initialize_interactions_from_config

    return initialize_interactions_from_config(multi_turn.interaction_config_path)


def _episode_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    keys = sorted({k for t in trajectories for k in t.metrics})
    metrics = {}
    for key in keys:
        values = [t.metrics[key] for t in trajectories if key in t.metrics]
        metrics[f"agent_loop/{key}"] = float(np.mean(values))
    return metrics


def _routed_experts(trajectories: list[Trajectory], P: int, R: int) -> torch.Tensor | None:
    """[B, P + R, layers, k] in the batch's layout (prompt left-padded, response from column P), zeros at
    padding, when the episodes carry routing (R3); None when none does. An episode's routing covers its
    tokens up to its last model call; tokens it appended after that call (a last tool or user turn) get
    zeros, as upstream: they come after every trained token, so no trained log-prob depends on them."""
    routed = [t for t in trajectories if t is not None and t.routed_experts is not None]
    if not routed:
        return None
    if len(routed) != sum(t is not None for t in trajectories):
        raise RuntimeError("some episodes carry MoE routing and others do not: the engine recorded it for some calls")
    first = torch.as_tensor(routed[0].routed_experts)
    out = torch.zeros((len(trajectories), P + R, *first.shape[1:]), dtype=first.dtype)
    for row, t in enumerate(trajectories):
        if t is None:
            continue
        routing = torch.as_tensor(t.routed_experts)
        n_prompt, n_response = len(t.prompt_ids), min(len(t.response_ids), R)
        if len(routing) > len(t.prompt_ids) + len(t.response_ids):
            raise RuntimeError(
                f"an episode's routing covers {len(routing)} tokens but the episode has "
                f"{len(t.prompt_ids) + len(t.response_ids)}: its last model call did not continue its own tokens"
            )
        out[row, P - n_prompt : P] = routing[:n_prompt]
        response = routing[n_prompt : n_prompt + n_response]
        out[row, P : P + len(response)] = response
    return out


def trajectories_to_proto(prompts, trajectories: list[Trajectory], response_length: int, pad: int, with_logprobs, meta):
    """The rollout output layout (module docstring), row i from trajectory i; a None trajectory (an
    episode cut by over-sampling) gives a padding row with the incoming prompt and an empty response."""
    from tensordict import TensorDict

    from verl.protocol import DataProto

    B, P = prompts.batch["input_ids"].shape
    R = int(response_length)
    device = prompts.batch["input_ids"].device
    prompt_ids = torch.full((B, P), pad, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    responses = torch.full((B, R), pad, dtype=torch.long)
    response_attn = torch.zeros((B, R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    for row, t in enumerate(trajectories):
        if t is None:  # cut by over-sampling: the prompt as it came, nothing to train on (module docstring)
            prompt_ids[row] = prompts.batch["input_ids"][row].cpu()
            prompt_mask[row] = prompts.batch["attention_mask"][row].cpu().long()
            continue
        if len(t.prompt_ids) > P:
            raise ValueError(
                f"an episode's prompt has {len(t.prompt_ids)} tokens (with the tool schemas rendered by the chat "
                f"template) but prompts are {P} tokens wide; raise data.max_prompt_length"
            )
        n = min(len(t.response_ids), R)
        prompt_ids[row, P - len(t.prompt_ids) :] = torch.tensor(t.prompt_ids, dtype=torch.long)
        prompt_mask[row, P - len(t.prompt_ids) :] = 1
        responses[row, :n] = torch.tensor(t.response_ids[:n], dtype=torch.long)
        response_attn[row, :n] = 1
        response_mask[row, :n] = torch.tensor(t.response_mask[:n], dtype=torch.long)
        if with_logprobs and t.response_logprobs is not None:
            logprobs[row, :n] = torch.tensor(t.response_logprobs[:n], dtype=torch.float32)
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    response_positions = prompt_positions[:, -1:] + torch.arange(1, R + 1)
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=-1),
        "attention_mask": torch.cat([prompt_mask, response_attn], dim=-1),
        "position_ids": torch.cat([prompt_positions, response_positions], dim=-1),
        "response_mask": response_mask,
    }
    if with_logprobs:
        tensors["rollout_log_probs"] = logprobs
    routing = _routed_experts(trajectories, P, R)
    if routing is not None:
        tensors["routed_experts"] = routing
    mask_dtype = prompts.batch["attention_mask"].dtype
    for key in ("attention_mask", "response_mask"):
        tensors[key] = tensors[key].to(mask_dtype)
    batch = TensorDict({k: v.to(device) for k, v in tensors.items()}, batch_size=[B])
    non_tensor = dict(prompts.non_tensor_batch)
    non_tensor["__num_turns__"] = np.array([0 if t is None else t.num_turns for t in trajectories], dtype=np.int64)
    if any(t is not None and t.turn_scores for t in trajectories):
        turn_scores = np.empty(B, dtype=object)
        turn_scores[:] = [[] if t is None else list(t.turn_scores) for t in trajectories]
        non_tensor["turn_scores"] = turn_scores
    # upstream's `tool_extra_fields`: each episode's fields as one dict, which the naive and rate-limited reward
    # managers merge into the reward function's extra_info (tool_rewards, turn_scores, a loop's own fields)
    tool_extra_fields = np.empty(B, dtype=object)
    tool_extra_fields[:] = [
        None
        if t is None
        else {"turn_scores": list(t.turn_scores), "tool_rewards": list(t.tool_rewards), **t.extra_fields}
        for t in trajectories
    ]
    non_tensor["tool_extra_fields"] = tool_extra_fields
    for key in sorted({key for t in trajectories if t is not None for key in t.extra_fields}):
        column = np.empty(B, dtype=object)  # upstream's rule: None where an episode did not set the key
        column[:] = [None if t is None else t.extra_fields.get(key) for t in trajectories]
        non_tensor[key] = column
    if trajectories and all(t is not None and t.reward_score is not None for t in trajectories):
        # the loops scored their episodes: the reward manager returns rm_scores as they are (upstream)
        last = (response_attn.sum(-1) - 1).clamp(min=0)
        rm_scores = torch.zeros((B, R), dtype=torch.float32)
        rm_scores[torch.arange(B), last] = torch.tensor([float(t.reward_score) for t in trajectories])
        batch["rm_scores"] = rm_scores.to(device)

    meta = {k: v for k, v in meta.items() if k != "metrics"}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)


__all__ = [
    "PARTIAL_ROLLOUT_KEYS",
    "SAMPLING_KEYS",
    "AgentLoopRollout",
    "EpisodeEngine",
    "settings_from_config",
    "trace_attributes",
    "trajectories_to_proto",
]
