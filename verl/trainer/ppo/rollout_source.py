"""Where a training step's batch comes from: a `RolloutSource` hands out generated, scored samples.

`RayPPOTrainer.step()` begins with `batch = self.rollout_source.next_batch(state)`; the trainer
has `build_rollout_source` choose the source once, when its worker groups exist:

    SyncRolloutSource        one batch of prompts, n samples each, scored (the default)
    FilteringRolloutSource   DAPO's dynamic sampling (`algorithm.filter_groups.enable`): generate
                             and score batch after batch, keep the groups whose metric varies,
                             until `data.train_batch_size` groups are kept
    AsyncRolloutSource       generation running ahead of training in its own pool
                             (`async_training.staleness_threshold >= 1`, verl.trainer.ppo.async_rollout)

Every source is built from explicit parts, never from the trainer object:
- `PromptStream`: the training dataloader, one batch of prompts per call, epoch after epoch;
- `RolloutGenerator`: the rollout worker group's `generate_sequences`, n samples per prompt
  (and, for ReMax, the greedy response whose score is each prompt's baseline); with
  `rollout.skip_rollout` wrapped in a `ReplayingGenerator` (rollout_skip.py) that replays the
  first rollout it dumped;
- `RewardScorer`: `token_level_scores` from the reward model worker group and/or the rule reward
  function.

A source's batch carries `token_level_scores`, not yet `token_level_rewards`: the final reward is
a phase of the step, because with `algorithm.use_kl_in_reward` it subtracts a KL penalty that
needs the step's old and reference log-probs. DAPO's filter therefore reads the scores, for
`seq_final_reward` too: without KL-in-reward the two are the same tensor; with it the penalty is
applied once, to the kept groups, and a penalty that differs from sample to sample would
otherwise make nearly every group look informative (the source warns when built so).

`RolloutSource` is a `Protocol`: the async source meets it by its shape, so async_rollout.py
needs nothing from this module, and this module (which chooses between all three) imports it
without a cycle. A source's `state_dict()` is what a checkpoint must keep for it beyond the
dataloader position (the async source's drawn-but-untrained groups); the synchronous sources keep
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.async_rollout import AsyncRolloutSource
from verl.trainer.ppo.generation import GEN_BATCH_KEYS, generation_input, with_generation
from verl.trainer.ppo.metric_utils import reduce_metrics
from verl.trainer.ppo.rollout_skip import (
    ReplayingGenerator,
    RolloutDump,
    StepReplayingGenerator,
    dump_path,
    step_dump_root,
)
from verl.utils.logging_utils import get_logger
from verl.utils.timer import marked_timer
from verl.workers.rollout.base import runs_agent_loops

logger = get_logger(__name__, "INFO")


@dataclass
class StepState:
    """What a step accumulates besides the batch: phase timings (`timing_s/<phase>`) and metrics."""

    timing: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def meta_metrics(output: DataProto) -> dict[str, float]:
    """The metrics a worker group reported with its output (`meta_info["metrics"]`), reduced."""
    return reduce_metrics(output.meta_info.get("metrics", {}))


class PromptStream:
    """The training prompts: each call returns the next dataloader batch as a DataProto, a new
    epoch begun when the last one ends.

    Each prompt gets the uid `<step>_<index>`, `step` from `current_step()` (the trainer's step)
    and the index counting every prompt drawn in that step: dynamic sampling draws several batches
    per step, and a uid repeated across them would merge unrelated prompts' groups (GRPO's
    baseline, the filter's variance). Deterministic rather than random, so a resumed run groups
    samples exactly as an uninterrupted one.
    """

    def __init__(self, dataloader, current_step: Callable[[], int]):
        self.dataloader = dataloader
        self.current_step = current_step
        self._batches = None
        self._drawn = (-1, 0)  # (step, prompts drawn in it)

    def __call__(self) -> DataProto:
        batch_dict = next(self._batches, None) if self._batches is not None else None
        if batch_dict is None:  # no epoch started yet, or the last one ended: begin the next
            self._batches = iter(self.dataloader)
            batch_dict = next(self._batches)
        batch = DataProto.from_single_dict(batch_dict)
        step = self.current_step()
        first = self._drawn[1] if self._drawn[0] == step else 0
        batch.non_tensor_batch["uid"] = np.array([f"{step}_{first + i}" for i in range(len(batch))], dtype=object)
        self._drawn = (step, first + len(batch))
        return batch

    def restart(self) -> None:
        """Drop the epoch in progress: after the dataloader's position was loaded from a checkpoint,
        and at the end of training (which stops the loader's worker processes now, not when the
        process that owns them ends under them and their death reads as an error)."""
        self._batches = None


class RewardScorer:
    """`token_level_scores` [B, R] of generated samples: the reward model's (`reward_model`, its
    worker group) when there is one, else the reward function's (`reward_fn`); one must exist.

    With a reward model its scores are the reward and the reward function is not called, as upstream's
    reward managers return `rm_scores` unchanged (a reward model with custom_reward_function.path is
    refused by the config check: upstream then hands the model to the function through a router).

    The rule function's per-sample extra info (`reward_extra_info`, e.g. DAPO's `acc`) is written
    into the batch's non-tensor columns, where the group filter and the rollout dump read it, and
    its error count becomes `reward/num_errors`.
    """

    def __init__(self, reward_fn=None, reward_model=None):
        self.reward_fn = reward_fn
        self.reward_model = reward_model

    def __call__(self, batch: DataProto, state: StepState) -> DataProto:
        with marked_timer("reward", state.timing):
            batch.batch["token_level_scores"] = self.scores(batch, state)
        return batch

    def scores(self, batch: DataProto, state: StepState | None = None) -> torch.Tensor:
        """The scores alone; with `state` None nothing is recorded (ReMax's greedy baseline)."""
        if self.reward_model is not None:
            return self.reward_model.compute_rm_score(batch).batch["rm_scores"]
        scores = None
        if self.reward_fn is not None:
            result = self.reward_fn(batch, return_dict=True)
            scores = result["reward_tensor"]
            extra = result.get("reward_extra_info", {})
            if state is not None:
                if "reward_error" in extra:
                    state.metrics["reward/num_errors"] = float(np.sum(np.asarray(extra["reward_error"], np.float64)))
                for key, values in extra.items():
                    if len(values) == len(batch):
                        batch.non_tensor_batch[key] = np.asarray(values)
        if scores is None:
            raise RuntimeError("no reward: enable reward_model or give a reward function (custom_reward_function.path)")
        return scores


class RolloutGenerator:
    """The rollout worker group's `generate_sequences`: `generator(prompts, state)` turns B prompt
    rows into B * n sample rows (each prompt's n samples adjacent, sharing its uid) that hold the
    responses.

    worker_group: the group that generates (the hybrid actor-rollout group).
    current_step: `() -> int`, stamped into the rollout's meta_info.
    baseline_scorer: for ReMax, the scorer of each prompt's greedy response, whose score becomes
        the prompt's `reward_baselines`; None otherwise.
    vision_token_ids: a vision-language policy's image/video placeholder tokens, which a response
        must not hold (`vision_placeholder_ids`); empty for a text policy.
    """

    def __init__(
        self, worker_group, tokenizer, n: int, multi_turn: bool, current_step, baseline_scorer=None, vision_token_ids=()
    ):
        self.worker_group = worker_group
        self.tokenizer = tokenizer
        self.n = n
        self.multi_turn = multi_turn
        self.current_step = current_step
        self.baseline_scorer = baseline_scorer
        self.vision_token_ids = tuple(vision_token_ids)

    def __call__(self, batch: DataProto, state: StepState) -> DataProto:
        with marked_timer("gen", state.timing):
            gen_batch = self._input(batch).repeat(repeat_times=self.n, interleave=True)
            gen_out = self.worker_group.generate_sequences(gen_batch)
        check_no_vision_tokens(gen_out, self.vision_token_ids, self.current_step())
        state.metrics.update(meta_metrics(gen_out))
        if self.baseline_scorer is not None:
            with marked_timer("gen_max", state.timing):
                batch.batch["reward_baselines"] = self._greedy_baseline(batch)
        batch = batch.repeat(repeat_times=self.n, interleave=True)
        for key in GEN_BATCH_KEYS:
            batch.batch.pop(key)
        return batch.union(gen_out)

    def _input(self, batch: DataProto, **meta) -> DataProto:
        return generation_input(batch, self.tokenizer, self.current_step(), self.multi_turn, **meta)

    def _greedy_baseline(self, batch: DataProto) -> torch.Tensor:
        """ReMax: the score of the greedy response to each prompt is that prompt's baseline [B]."""
        greedy = self.worker_group.generate_sequences(self._input(batch, do_sample=False))
        return self.baseline_scorer.scores(with_generation(batch, greedy)).sum(-1)


def vision_placeholder_ids(processor) -> tuple[int, ...]:
    """The token ids of a vision-language processor that stand for image or video features (the
    `<|image_pad|>` / `<|video_pad|>` runs the model fills with features); () without a processor.
    The `<|vision_start|>` / `<|vision_end|>` marks are left out: in a response they are meaningless
    but harmless, the model replaces no embedding there."""
    if processor is None:
        return ()
    tokenizer = getattr(processor, "tokenizer", processor)
    names = ("<|image_pad|>", "<|video_pad|>")
    ids = tokenizer.convert_tokens_to_ids(list(names))
    return tuple(i for i in ids if i is not None and i != tokenizer.unk_token_id)


def check_no_vision_tokens(gen_out: DataProto, vision_token_ids: tuple[int, ...], step: int) -> None:
    """Stop with the cause when the rollout sampled a vision placeholder token into a response: the
    training forward would count an image token that has no image features and fail deep in the
    model ("Image features and image tokens do not match"). docs/multimodal.md, "Known issue"."""
    if not vision_token_ids:
        return
    responses = gen_out.batch["responses"]
    hit = torch.isin(responses, torch.tensor(vision_token_ids)) & gen_out.batch["response_mask"].bool()
    if bool(hit.any()):
        rows = hit.any(-1).nonzero().flatten().tolist()
        ids = sorted({int(t) for t in responses[hit].tolist()})
        raise RuntimeError(
            f"step {step}: the rollout sampled a vision placeholder token (ids {ids}) into {len(rows)} response(s) "
            f"(rows {rows[:8]}); a response token cannot carry an image, so the actor could not score them. The "
            'rollout engine must not sample these tokens for a vision-language model (docs/multimodal.md, "Known '
            'issue"); a policy far from a trained checkpoint (a random one) samples them often'
        )


class RolloutSource(Protocol):
    """Hands the step its batch of generated, scored samples (see the module docstring)."""

    runs_ahead: bool = False
    """True when samples may come from older weights than the trained ones (the step then reports
    the importance weights of its old log-probs against the rollout's)."""

    def next_batch(self, state: StepState) -> DataProto:
        """The step's batch: `data.train_batch_size` prompts' groups of n samples, with
        `token_level_scores`; timings and metrics go into `state`."""
        ...

    def state_dict(self) -> dict:
        """What a checkpoint keeps for this source beyond the dataloader position."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s result (the synchronous sources keep nothing)."""


class SyncRolloutSource(RolloutSource):
    """One batch of prompts per step, n samples each, scored."""

    def __init__(self, prompts: PromptStream, generator: RolloutGenerator, scorer: RewardScorer):
        self.prompts = prompts
        self.generator = generator
        self.scorer = scorer

    def next_batch(self, state: StepState) -> DataProto:
        return self.scorer(self.generator(self.prompts(), state), state)


class FilteringRolloutSource(RolloutSource):
    """DAPO's dynamic sampling: generate and score batch after batch (each `data.gen_batch_size`
    prompts), keeping the groups whose `metric` is not constant (a group whose samples all score
    alike has zero GRPO advantage and carries no signal), until `train_batch_size` groups are kept;
    the surplus of the last batch is dropped. `train/num_gen_batches` counts the batches.

    metric: `seq_final_reward` / `seq_reward` (a sample's summed score) or a key of the reward
        function's extra info (e.g. `acc`). max_num_gen_batches: give up after that many batches
        (0: never). kl_in_reward: whether the step will subtract a KL penalty from the scores
        (only to warn that `seq_final_reward` filters on the scores, see the module docstring).
    """

    def __init__(
        self,
        prompts: PromptStream,
        generator: RolloutGenerator,
        scorer: RewardScorer,
        *,
        metric: str,
        max_num_gen_batches: int,
        train_batch_size: int,
        kl_in_reward: bool = False,
    ):
        self.prompts = prompts
        self.generator = generator
        self.scorer = scorer
        self.metric = metric
        self.max_num_gen_batches = max_num_gen_batches
        self.train_batch_size = train_batch_size
        if kl_in_reward and metric == "seq_final_reward":
            logger.warning(
                "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward: groups are "
                "filtered on their scores, before the KL penalty (applied once to the kept groups); set "
                "metric=seq_reward to say so explicitly"
            )

    def next_batch(self, state: StepState) -> DataProto:
        n = self.generator.n
        kept: list[DataProto] = []
        num_prompts = num_gen_batches = 0
        while num_prompts < self.train_batch_size:
            if self.max_num_gen_batches and num_gen_batches >= self.max_num_gen_batches:
                raise RuntimeError(
                    f"dynamic sampling generated {num_gen_batches} batches but only {num_prompts} of "
                    f"{self.train_batch_size} prompts had non-constant '{self.metric}'; the data is too easy or "
                    "too hard for the model. Raise algorithm.filter_groups.max_num_gen_batches (0 = unlimited) "
                    "or disable algorithm.filter_groups.enable"
                )
            batch = self.scorer(self.generator(self.prompts(), state), state)
            num_gen_batches += 1
            values = group_filter_values(batch, self.metric)
            keep_mask, _ = core_algos.filter_groups_by_metric_variance(values, batch.non_tensor_batch["uid"])
            keep_idx = np.nonzero(np.asarray(keep_mask))[0]
            if len(keep_idx):
                kept.append(batch.select_idxs(keep_idx))
                num_prompts += len(keep_idx) // n
        state.metrics["train/num_gen_batches"] = num_gen_batches
        return DataProto.concat(kept)[: self.train_batch_size * n]


def group_filter_values(batch: DataProto, metric: str) -> np.ndarray:
    """Per-sample values of `algorithm.filter_groups.metric` [B] (the module docstring says why
    `seq_final_reward` reads the scores)."""
    if metric in ("seq_final_reward", "seq_reward"):
        return batch.batch["token_level_scores"].sum(-1).numpy()
    if metric in batch.non_tensor_batch:
        return np.asarray(batch.non_tensor_batch[metric], dtype=np.float64)
    raise KeyError(
        f"algorithm.filter_groups.metric={metric!r} is neither seq_final_reward/seq_reward nor a "
        f"reward extra info key; available: {sorted(batch.non_tensor_batch)}"
    )


def build_rollout_source(
    config, *, prompts, scorer, actor_wg, tokenizer, current_step, total_steps, rollout_wg=None, processor=None
) -> RolloutSource:
    """The source the config asks for: generation in a pool of its own (`rollout_wg`, async
    training) runs ahead; `algorithm.filter_groups.enable` filters groups (DAPO); else one batch a
    step. The parts: `prompts` (PromptStream), `scorer` (RewardScorer), the worker groups,
    `current_step` / `total_steps` (`() -> int`, the trainer's counters), a vision-language
    policy's `processor` (its placeholder tokens must not appear in responses)."""
    if rollout_wg is not None:
        return AsyncRolloutSource(
            config,
            rollout_wg,
            actor_wg,
            next_prompts=prompts,
            score=scorer,
            tokenizer=tokenizer,
            current_step=current_step,
            total_steps=total_steps,
        )
    rollout, algo = config.actor_rollout_ref.rollout, config.algorithm
    remax = algo.adv_estimator == "remax"
    baseline_scorer = scorer if remax else None
    generator = RolloutGenerator(
        actor_wg,
        tokenizer,
        rollout.n,
        runs_agent_loops(rollout),
        current_step,
        baseline_scorer,
        vision_token_ids=vision_placeholder_ids(processor),
    )
    if rollout.skip_rollout:  # the first rollout is dumped, every later one replays it (rollout_skip.py)
        generator = ReplayingGenerator(generator, RolloutDump(dump_path(config)))
    skip = config.get("skip", None)
    if skip is not None and skip.rollout.enable:  # listed steps replay their dumps (rollout_skip.py)
        skip_cfg = skip.rollout
        root = step_dump_root(config)
        generator = StepReplayingGenerator(generator, root, skip_cfg.steps, skip_cfg.action, current_step)
    if not algo.filter_groups.enable:
        return SyncRolloutSource(prompts, generator, scorer)
    return FilteringRolloutSource(
        prompts,
        generator,
        scorer,
        metric=algo.filter_groups.metric,  # required by the config check when filtering is on
        max_num_gen_batches=algo.filter_groups.max_num_gen_batches,
        train_batch_size=config.data.train_batch_size,
        kl_in_reward=algo.use_kl_in_reward,
    )
