"""The PPO/GRPO driver: one Python process that holds the dataflow and dispatches to worker groups.

`RayPPOTrainer.step()` reads like the algorithm, one call per phase:

    batch = next prompts -> generate (n samples each) -> reward -> old log-probs -> ref log-probs
          -> values -> advantages (driver side, pure math) -> update critic -> update actor

Design decisions:
- Each phase is a short method; variants are composed in, never nested inside `step()`: ReMax's
  greedy baseline is `_compute_remax_baseline`, DAPO's dynamic sampling is the
  `_collect_filtered_batch` rollout strategy chosen once in `__init__`.
- Advantage estimators are looked up in core_algos' table; their keyword inputs are filled from
  what the batch has (`_estimator_kwargs`), so adding an estimator never touches the driver.
- Checkpoints: workers write `global_step_N/{actor,critic}`; the driver writes `data.pt`
  (dataloader position, KL controller, driver RNG) and then, last and atomically,
  `latest_checkpointed_iteration.txt`. A crash at any point of a save leaves the previous
  checkpoint as the one resume picks.
- uids are deterministic (`<step>_<index>`) rather than random, so a resumed run groups samples
  exactly as an uninterrupted run does.
- Non-finite losses: the workers skip an optimizer step whose gradient norm is NaN/inf and report
  it (`*/skipped_nonfinite_grad`); the driver counts such steps in a row and stops with
  `NonFiniteLossError` after `trainer.max_consecutive_nonfinite_steps`, before that step's
  checkpoint, so the last checkpoint is one saved before the trouble began or during it (its
  weights unchanged by the skipped updates).
- Checkpoints are loaded with `weights_only=True` (see verl.utils.checkpoint.safe_load).
- Speed paths (verl.utils.speed_paths): the workers report theirs once their models are built;
  `fit()` logs them at start, writes `speed_paths.yaml` beside the resolved config and adds
  `perf/<name>` to every step's metrics, so a fast path that is off is never silent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.async_rollout import (
    configure_off_policy_correction,
    importance_weight_metrics,
    staleness_threshold,
)
from verl.trainer.ppo.checkpointer import Checkpointer
from verl.trainer.ppo.dataloaders import create_dataloaders
from verl.trainer.ppo.generation import GEN_BATCH_KEYS, generation_input, with_generation
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    reduce_metrics,
)
from verl.trainer.ppo.rollout_corr_helper import (
    apply_bypass_mode,
    compute_rollout_correction_and_add_to_batch,
    configure_rollout_correction,
)
from verl.trainer.ppo.step_records import NonFiniteLossError as NonFiniteLossError  # main_ppo and tests import it here
from verl.trainer.ppo.step_records import NonFiniteStreak, dump_rollouts
from verl.trainer.ppo.validator import Validator, due
from verl.utils import speed_paths
from verl.utils.checkpoint.safe_load import from_plain, numpy_rng_state, set_numpy_rng_state, to_plain
from verl.utils.logging_utils import get_logger
from verl.utils.profiler import StepProfiler, resolve_role_profilers
from verl.utils.speed_paths import SpeedPath
from verl.utils.timer import marked_timer

logger = get_logger(__name__, "INFO")


class Role(Enum):
    """The roles a worker process can play; several may share one process (colocation)."""

    Actor = 0
    Rollout = 1
    ActorRollout = 2
    Critic = 3
    RefPolicy = 4
    RewardModel = 5
    ActorRolloutRef = 6


@dataclass
class _StepState:
    """What a step accumulates besides the batch: phase timings and metrics."""

    timing: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def _meta_metrics(output: DataProto) -> dict[str, float]:
    return reduce_metrics(output.meta_info.get("metrics", {}))


class RayPPOTrainer:
    """Driver of PPO-family training over Ray worker groups (upstream-compatible constructor)."""

    def __init__(
        self,
        config,
        tokenizer,
        role_worker_mapping: dict[Role, Any],
        resource_pool_manager,
        ray_worker_group_cls=None,
        processor=None,
        reward_fn=None,
        val_reward_fn=None,
        train_dataset=None,
        val_dataset=None,
        collate_fn=None,
        train_sampler=None,
        device_name: str | None = None,
    ):
        from verl.single_controller.ray import RayWorkerGroup

        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        self.role_worker_mapping = role_worker_mapping
        self.resource_pool_manager = resource_pool_manager
        self.ray_worker_group_cls = ray_worker_group_cls or RayWorkerGroup
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.device_name = device_name

        algo = config.algorithm
        self.use_critic = Role.Critic in role_worker_mapping
        self.use_reference_policy = Role.RefPolicy in role_worker_mapping or Role.ActorRolloutRef in role_worker_mapping
        self.use_rm = Role.RewardModel in role_worker_mapping
        self.kl_ctrl_in_reward = (
            core_algos.get_kl_controller(
                algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.get("target_kl"), algo.kl_ctrl.get("horizon")
            )
            if algo.use_kl_in_reward
            else None
        )
        filter_groups = algo.get("filter_groups") or {}
        self._rollout_strategy = (
            self._collect_filtered_batch if filter_groups.get("enable", False) else self._generate_and_score
        )
        self._async_rollout = None  # AsyncRolloutSource, built in init_workers when generation runs ahead
        if staleness_threshold(config) > 0:
            configure_off_policy_correction(config)
        # both may hand settings to the workers' configs, so they run before the workers are built
        self.rollout_correction = configure_rollout_correction(config)
        self.profiler_config = resolve_role_profilers(config)
        self._step_profiler = StepProfiler(self.profiler_config)
        _check_estimator_inputs(config)
        self.global_steps = 0
        self._nonfinite = NonFiniteStreak(config.trainer.max_consecutive_nonfinite_steps)
        self._create_dataloader(train_dataset, val_dataset, collate_fn, train_sampler)

    # ------------------------------------------------------------------ setup
    def _create_dataloader(self, train_dataset, val_dataset, collate_fn, train_sampler) -> None:
        self.train_dataloader, self.val_dataloader = create_dataloaders(
            self.config.data, train_dataset, val_dataset, collate_fn, train_sampler
        )
        self._train_iter = None
        self._uids_drawn = (-1, 0)  # (step, prompts drawn in it): see _next_batch
        total = self.config.trainer.get("total_training_steps")
        self.total_training_steps = total or len(self.train_dataloader) * self.config.trainer.total_epochs
        logger.info(
            f"train batches per epoch: {len(self.train_dataloader)}, total training steps: {self.total_training_steps}"
        )

    def init_workers(self) -> None:
        """Create the resource pools, spawn one worker group per pool and build the models."""
        from verl.single_controller.ray import RayClassWithInitArgs, create_colocated_worker_cls

        self.resource_pool_manager.create_resource_pool()
        arc = self.config.actor_rollout_ref
        roles_in_pool: dict[Any, dict[str, RayClassWithInitArgs]] = {}

        profiled_env = self.profiler_config.worker_runtime_env()  # nsys: start each worker under nsys

        def add(role: Role, name: str, cls_with_args: RayClassWithInitArgs) -> None:
            pool = self.resource_pool_manager.get_resource_pool(role)
            if profiled_env:
                cls_with_args.update_options({"runtime_env": profiled_env})
            roles_in_pool.setdefault(pool, {})[name] = cls_with_args

        # the agent-loop rollout names its traces after the run (rollout.trace)
        names = {
            "project_name": self.config.trainer.project_name,
            "experiment_name": self.config.trainer.experiment_name,
        }
        actor_role = Role.ActorRolloutRef if Role.ActorRolloutRef in self.role_worker_mapping else Role.ActorRollout
        worker_role = "actor_rollout_ref" if actor_role == Role.ActorRolloutRef else "actor_rollout"
        add(
            actor_role,
            "actor_rollout",
            RayClassWithInitArgs(self.role_worker_mapping[actor_role], config=arc, role=worker_role, **names),
        )
        if self.use_critic:
            add(
                Role.Critic,
                "critic",
                RayClassWithInitArgs(self.role_worker_mapping[Role.Critic], config=self.config.critic),
            )
        if Role.RefPolicy in self.role_worker_mapping:
            add(
                Role.RefPolicy,
                "ref",
                RayClassWithInitArgs(self.role_worker_mapping[Role.RefPolicy], config=arc, role="ref"),
            )
        if Role.Rollout in self.role_worker_mapping:  # generation in its own pool (async training)
            add(
                Role.Rollout,
                "rollout",
                RayClassWithInitArgs(self.role_worker_mapping[Role.Rollout], config=arc, role="rollout", **names),
            )
        if self.use_rm:
            add(
                Role.RewardModel,
                "rm",
                RayClassWithInitArgs(self.role_worker_mapping[Role.RewardModel], config=self.config.reward_model),
            )

        timeout = self.config.trainer.get("rpc_timeout_s")
        groups: dict[str, Any] = {}
        for pool, class_dict in roles_in_pool.items():
            colocated = create_colocated_worker_cls(class_dict)
            kwargs = {"resource_pool": pool, "ray_cls_with_init": colocated}
            if timeout:
                kwargs["timeout_s"] = timeout
            wg = self.ray_worker_group_cls(**kwargs)
            groups.update(wg.spawn(prefix_set=class_dict.keys()))

        # Build order: helpers first, the actor last (its rollout engine sizes itself after them).
        if self.use_critic:
            self.critic_wg = groups["critic"]
            self.critic_wg.init_model()
        if Role.RefPolicy in self.role_worker_mapping:
            self.ref_policy_wg = groups["ref"]
            self.ref_policy_wg.init_model()
        if self.use_rm:
            self.rm_wg = groups["rm"]
            self.rm_wg.init_model()
        self.actor_rollout_wg = groups["actor_rollout"]
        self.actor_rollout_wg.init_model()
        if actor_role == Role.ActorRolloutRef:
            self.ref_policy_wg = self.actor_rollout_wg
        if "rollout" in groups:
            from verl.trainer.ppo.async_rollout import AsyncRolloutSource

            self.rollout_wg = groups["rollout"]
            self.rollout_wg.init_model()
            self._async_rollout = AsyncRolloutSource(
                self.config,
                self.rollout_wg,
                self.actor_rollout_wg,
                next_prompts=self._next_batch,
                score=self._compute_reward,
                tokenizer=self.tokenizer,
                current_step=lambda: self.global_steps,
                total_steps=lambda: self.total_training_steps,
            )
            self._rollout_strategy = self._async_rollout
        self._worker_speed_paths = self._collect_worker_speed_paths()
        groups = {id(g): g for g in (getattr(self, n, None) for n in _WORKER_GROUPS) if g is not None}
        self._step_profiler = StepProfiler(self.profiler_config, groups.values())

    def _collect_worker_speed_paths(self) -> list[SpeedPath]:
        """The speed paths every worker group reports (a worker class without the `speed_paths` RPC,
        such as a user's own, reports none)."""
        paths = []
        for name in ("actor_rollout_wg", "critic_wg", "rm_wg", "rollout_wg"):
            group = getattr(self, name, None)
            if group is not None and hasattr(group, "speed_paths"):
                paths += [SpeedPath.from_dict(d) for rank_paths in group.speed_paths() for d in rank_paths]
        return speed_paths.merge(paths)

    def current_speed_paths(self) -> list[SpeedPath]:
        """Every speed path of this run and whether it is on now (see `verl.utils.speed_paths`); the
        shared-memory transport can turn off after start (a worker that fails its first-call probe)."""
        paths = list(getattr(self, "_worker_speed_paths", []))
        group = getattr(self, "actor_rollout_wg", None)
        if group is not None and hasattr(group, "shm_speed_path"):
            paths.append(group.shm_speed_path())
        return paths

    # ------------------------------------------------------------------ the step
    def step(self) -> dict[str, Any]:
        """One PPO/GRPO iteration over one training batch; returns the step's metrics."""
        state = _StepState()
        with marked_timer("step", state.timing):
            batch = self._rollout_strategy(state)
            if self.config.trainer.get("balance_batch", True):
                self._balance_batch(batch, state)
            batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()

            with marked_timer("old_log_prob", state.timing):
                batch = self._compute_old_log_prob(batch, state)
            if self.use_reference_policy:
                with marked_timer("ref", state.timing):
                    batch = self._compute_ref_log_prob(batch)
            if self.use_critic:
                with marked_timer("values", state.timing):
                    batch = self._compute_values(batch)
            batch = self._correct_rollout(batch, state)
            with marked_timer("adv", state.timing):
                batch = self._compute_advantage(batch, state)
            if self.use_critic:
                with marked_timer("update_critic", state.timing):
                    state.metrics.update(self._update_critic(batch))
            if self.global_steps > self.config.trainer.get("critic_warmup", 0):
                self._balance_update_work(batch)
                with marked_timer("update_actor", state.timing):
                    state.metrics.update(self._update_actor(batch))

        state.metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        state.metrics.update(compute_timing_metrics(batch, state.timing))
        n_devices = self.config.trainer.nnodes * self.config.trainer.n_gpus_per_node
        state.metrics.update(compute_throughput_metrics(batch, state.timing, n_devices))
        self._last_batch = batch
        return state.metrics

    # ------------------------------------------------------------------ phases
    def _generate_and_score(self, state: _StepState) -> DataProto:
        """Default rollout strategy: one batch of prompts, n samples each, scored."""
        batch = self._next_batch()
        batch = self._generate(batch, state)
        return self._compute_reward(batch, state)

    def _collect_filtered_batch(self, state: _StepState) -> DataProto:
        """DAPO dynamic sampling: keep generating until train_batch_size prompts have groups whose
        `filter_groups.metric` is not constant (constant groups carry no GRPO signal)."""
        cfg = self.config.algorithm.filter_groups
        target = self.config.data.train_batch_size
        kept: list[DataProto] = []
        num_prompts = num_gen_batches = 0
        while num_prompts < target:
            max_batches = cfg.get("max_num_gen_batches", 0)
            if max_batches and num_gen_batches >= max_batches:
                raise RuntimeError(
                    f"dynamic sampling generated {num_gen_batches} batches but only {num_prompts} of "
                    f"{target} prompts had non-constant '{cfg.metric}'; the data is too easy or too hard "
                    "for the model. Raise algorithm.filter_groups.max_num_gen_batches (0 = unlimited) "
                    "or disable algorithm.filter_groups.enable"
                )
            batch = self._compute_reward(self._generate(self._next_batch(), state), state)
            num_gen_batches += 1
            metric = cfg.get("metric") or "seq_final_reward"
            values = self._group_filter_metric(batch, metric)
            keep_mask, _ = core_algos.filter_groups_by_metric_variance(values, batch.non_tensor_batch["uid"])
            keep_idx = np.nonzero(np.asarray(keep_mask))[0]
            if len(keep_idx):
                kept.append(batch.select_idxs(keep_idx))
                num_prompts += len(keep_idx) // self.config.actor_rollout_ref.rollout.n
        state.metrics["train/num_gen_batches"] = num_gen_batches
        batch = DataProto.concat(kept)
        return batch[: target * self.config.actor_rollout_ref.rollout.n]

    @staticmethod
    def _group_filter_metric(batch: DataProto, metric: str) -> np.ndarray:
        if metric in ("seq_final_reward", "seq_reward"):
            key = "token_level_rewards" if metric == "seq_final_reward" else "token_level_scores"
            return batch.batch[key].sum(-1).numpy()
        if metric in batch.non_tensor_batch:
            return np.asarray(batch.non_tensor_batch[metric], dtype=np.float64)
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r} is neither seq_final_reward/seq_reward nor a "
            f"reward extra info key; available: {sorted(batch.non_tensor_batch)}"
        )

    def _next_batch(self) -> DataProto:
        """The next batch of prompts as a DataProto, with a deterministic uid per prompt."""
        batch_dict = next(self._train_iter, None) if self._train_iter is not None else None
        if batch_dict is None:  # no epoch started yet, or the last one ended: begin the next
            self._train_iter = iter(self.train_dataloader)
            batch_dict = next(self._train_iter)
        batch = DataProto.from_single_dict(batch_dict)
        # `<step>_<index>`, the index counting every prompt drawn in this step: dynamic sampling draws
        # several batches per step, and a uid repeated across them would merge unrelated prompts'
        # groups (GRPO's baseline, the filter's variance). The first batch's uids are unchanged.
        first = self._uids_drawn[1] if self._uids_drawn[0] == self.global_steps else 0
        batch.non_tensor_batch["uid"] = np.array(
            [f"{self.global_steps}_{first + i}" for i in range(len(batch))], dtype=object
        )
        self._uids_drawn = (self.global_steps, first + len(batch))
        return batch

    def _gen_batch(self, batch: DataProto, **meta) -> DataProto:
        multi_turn = self.config.actor_rollout_ref.rollout.get("multi_turn", {}).get("enable", False)
        return generation_input(batch, self.tokenizer, self.global_steps, multi_turn, **meta)

    def _generate(self, batch: DataProto, state: _StepState) -> DataProto:
        n = self.config.actor_rollout_ref.rollout.n
        with marked_timer("gen", state.timing):
            gen_batch = self._gen_batch(batch).repeat(repeat_times=n, interleave=True)
            gen_out = self.actor_rollout_wg.generate_sequences(gen_batch)
        state.metrics.update(_meta_metrics(gen_out))
        if self.config.algorithm.adv_estimator == "remax":
            with marked_timer("gen_max", state.timing):
                batch.batch["reward_baselines"] = self._compute_remax_baseline(batch, state)
        batch = batch.repeat(repeat_times=n, interleave=True)
        for key in GEN_BATCH_KEYS:
            batch.batch.pop(key)
        return batch.union(gen_out)

    def _compute_remax_baseline(self, batch: DataProto, state: _StepState) -> torch.Tensor:
        """ReMax: the reward of the greedy response to each prompt is that prompt's baseline."""
        greedy = self.actor_rollout_wg.generate_sequences(self._gen_batch(batch, do_sample=False))
        return self._score(_with_generation(batch, greedy), state, count=False).sum(-1)

    def _score(self, batch: DataProto, state: _StepState, count: bool = True) -> torch.Tensor:
        """Token-level scores [B, R]: the reward model's (if any) plus the rule reward function's."""
        scores = None
        if self.use_rm:
            scores = self.rm_wg.compute_rm_score(batch).batch["rm_scores"]
        if self.reward_fn is not None:
            result = self.reward_fn(batch, return_dict=True)
            rule = result["reward_tensor"]
            scores = rule if scores is None else scores + rule
            extra = result.get("reward_extra_info", {})
            if count:
                if "reward_error" in extra:
                    state.metrics["reward/num_errors"] = float(
                        np.sum(np.asarray(extra["reward_error"], dtype=np.float64))
                    )
                for key, values in extra.items():
                    if len(values) == len(batch):
                        batch.non_tensor_batch[key] = np.asarray(values)
        if scores is None:
            raise RuntimeError("no reward: enable reward_model or give a reward function (custom_reward_function.path)")
        return scores

    def _compute_reward(self, batch: DataProto, state: _StepState) -> DataProto:
        with marked_timer("reward", state.timing):
            batch.batch["token_level_scores"] = self._score(batch, state)
            if self.kl_ctrl_in_reward is not None:
                state.metrics.update(self._apply_kl_in_reward(batch))
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        return batch

    def _apply_kl_in_reward(self, batch: DataProto) -> dict[str, float]:
        # The in-reward KL needs the current policy and reference log-probs before the reward is
        # final; compute them here (they are reused by the later phases and not recomputed).
        if (
            "old_log_probs" not in batch.batch
            and self.rollout_correction is not None
            and self.rollout_correction.bypass_mode
        ):
            apply_bypass_mode(batch)  # bypass mode: the rollout's log-probs are the policy's here too
        if "old_log_probs" not in batch.batch:
            out = self.actor_rollout_wg.compute_log_prob(batch)
            # sum_pi_squared too: the old-log-prob phase is skipped later, and the estimator may need it
            batch.union(out.select(batch_keys=[k for k in ("old_log_probs", "sum_pi_squared") if k in out.batch]))
        if "ref_log_prob" not in batch.batch:
            batch.union(self.ref_policy_wg.compute_ref_log_prob(batch))
        rewards, current_kl = core_algos.apply_kl_penalty_tensors(
            batch.batch["token_level_scores"],
            batch.batch["old_log_probs"],
            batch.batch["ref_log_prob"],
            batch.batch["response_mask"],
            kl_coef=self.kl_ctrl_in_reward.value,
            kl_penalty=self.config.algorithm.kl_penalty,
        )
        batch.batch["token_level_rewards"] = rewards
        current_kl = float(current_kl)
        metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": self.kl_ctrl_in_reward.value}
        self.kl_ctrl_in_reward.update(current_kl=current_kl, n_steps=self.config.data.train_batch_size)
        return metrics

    def _balance_batch(self, batch: DataProto, state: _StepState | None, work: list[int] | None = None) -> None:
        """Reorder samples so each data-parallel rank receives about the same work: tokens per row, or
        `work` per row when given (then no `global_seqlen/*` metrics)."""
        from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions, log_seqlen_unbalance

        world_size = self.actor_rollout_wg.world_size
        seqlens = batch.batch["attention_mask"].sum(-1).tolist()
        weights = seqlens if work is None else work
        groups = _equal_groups(batch.non_tensor_batch.get("uid"), world_size)
        if groups is not None:
            # Whole groups (one prompt's samples) go to one rank, contiguously: the actor then runs
            # each prompt once per micro-batch (`actor.share_prompt_forward`) instead of once per
            # rank and micro-batch it was scattered over.
            group_lens = [sum(weights[i] for i in rows) for rows in groups]
            group_parts = get_seqlen_balanced_partitions(group_lens, k_partitions=world_size, equal_size=True)
            partitions = [[i for g in sorted(part) for i in groups[g]] for part in group_parts]
        elif work is not None:
            return  # rows are already balanced by tokens; without groups there is little to gain
        else:
            partitions = get_seqlen_balanced_partitions(seqlens, k_partitions=world_size, equal_size=True)
        batch.reorder(torch.tensor([i for part in partitions for i in part]))
        if state is not None and work is None:
            state.metrics.update(
                log_seqlen_unbalance(seqlen_list=seqlens, partitions=partitions, prefix="global_seqlen")
            )

    def _balance_update_work(self, batch: DataProto) -> None:
        """Before a one-mini-batch actor update that leaves zero-advantage rows out
        (`actor.skip_zero_advantage_rows`): balance the rows that will be trained, not all rows.
        The update waits for its slowest rank, and GRPO's all-alike groups (zero advantage) can
        gather on one rank. One mini-batch only, so the order changes no optimizer step."""
        from verl.workers.actor.dp_actor import rows_with_advantage, skips_zero_advantage_rows

        actor = self.config.actor_rollout_ref.actor
        if not (
            self.config.trainer.get("balance_batch", True)
            and skips_zero_advantage_rows(actor)
            and actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n >= len(batch)
        ):
            return
        trained = rows_with_advantage(batch.batch["advantages"], batch.batch["response_mask"])
        if bool(trained.all()):
            return
        work = (batch.batch["attention_mask"].sum(-1) * trained).tolist()
        self._balance_batch(batch, None, work=work)

    def _reuses_current_log_probs(self) -> bool:
        """Strictly on-policy training (one PPO epoch over one mini-batch, nothing else reading the
        old log-probs) needs no separate old-log-prob pass: they equal the current policy's, so the
        actor uses its own detached log-probs (ratio exactly 1), saving a forward over the batch."""
        arc = self.config.actor_rollout_ref
        return (
            not arc.actor.get("recompute_log_prob", False)
            and arc.actor.ppo_epochs == 1
            and arc.actor.ppo_mini_batch_size == self.config.data.train_batch_size
            and not self.config.algorithm.use_kl_in_reward
            and not arc.rollout.get("calculate_log_probs", False)
            and not arc.actor.get("calculate_sum_pi_squared", False)
        )

    def _compute_old_log_prob(self, batch: DataProto, state: _StepState) -> DataProto:
        if "old_log_probs" in batch.batch or self._reuses_current_log_probs():
            return batch
        if self.rollout_correction is not None and self.rollout_correction.bypass_mode:
            apply_bypass_mode(batch)  # the rollout's log-probs are the old ones: no forward pass
            return batch
        out = self.actor_rollout_wg.compute_log_prob(batch)
        state.metrics.update(_meta_metrics(out))
        if "entropys" in out.batch:
            entropys = out.batch.pop("entropys")
            actor_cfg = self.config.actor_rollout_ref.actor
            state.metrics["actor/entropy"] = core_algos.agg_loss(
                entropys, batch.batch["response_mask"], actor_cfg.loss_agg_mode, actor_cfg.get("loss_scale_factor")
            ).item()
        if "rollout_log_probs" in batch.batch:
            state.metrics.update(_rollout_mismatch_metrics(batch, out.batch["old_log_probs"]))
            if self._async_rollout is not None:
                cap = self.config.actor_rollout_ref.actor.get("tis_imp_ratio_cap")
                state.metrics.update(
                    importance_weight_metrics(
                        out.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"], cap
                    )
                )
        return batch.union(out)

    def _compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        if "ref_log_prob" in batch.batch:
            return batch
        return batch.union(self.ref_policy_wg.compute_ref_log_prob(batch))

    def _compute_values(self, batch: DataProto) -> DataProto:
        return batch.union(self.critic_wg.compute_values(batch))

    def _correct_rollout(self, batch: DataProto, state: _StepState) -> DataProto:
        """Rollout correction, decoupled mode (`algorithm.rollout_correction`): importance weights of
        pi_old / pi_rollout and rejection of what leaves the trust region, written into the batch for
        the advantage and the actor, and the rollout_corr/* metrics; whenever the rollout returned
        log-probs (bypass mode corrects inside the actor's loss instead)."""
        rc = self.rollout_correction
        if rc is None or rc.bypass_mode or "rollout_log_probs" not in batch.batch:
            return batch
        with marked_timer("rollout_correction", state.timing):
            batch, metrics = compute_rollout_correction_and_add_to_batch(batch, rc)
        state.metrics.update(metrics)
        return batch

    def _compute_advantage(self, batch: DataProto, state: _StepState) -> DataProto:
        """Driver-side advantage estimation: core_algos picks the inputs the estimator takes."""
        algo = self.config.algorithm
        inputs = {
            "token_level_rewards": batch.batch["token_level_rewards"],
            "response_mask": batch.batch["response_mask"],
            "index": batch.non_tensor_batch["uid"],
            "gamma": algo.get("gamma", 1.0),
            "lam": algo.get("lam", 1.0),
            "norm_adv_by_std_in_grpo": algo.get("norm_adv_by_std_in_grpo", True),
        }
        optional = ("values", "reward_baselines", "old_log_probs", "sum_pi_squared", "rollout_is_weights")
        inputs.update({k: batch.batch[k] for k in optional if k in batch.batch})
        advantages, returns = core_algos.compute_advantage_from_tensors(algo.adv_estimator, **inputs)
        batch.batch["advantages"] = advantages
        batch.batch["returns"] = returns
        if algo.get("use_pf_ppo", False) and algo.adv_estimator == "gae":  # upstream applies it to GAE only
            # seeded by the step, so a resumed run draws the same rows
            generator = torch.Generator().manual_seed(
                int(self.config.data.get("seed") or 0) * 100_003 + self.global_steps
            )
            pf = algo.pf_ppo
            batch = core_algos.compute_pf_ppo_reweight_data(batch, pf.reweight_method, pf.weight_pow, generator)
        return batch

    def _update_critic(self, batch: DataProto) -> dict[str, float]:
        return _meta_metrics(self.critic_wg.update_critic(batch))

    def _update_actor(self, batch: DataProto) -> dict[str, float]:
        batch.meta_info["multi_turn"] = self.config.actor_rollout_ref.rollout.get("multi_turn", {}).get("enable", False)
        return _meta_metrics(self.actor_rollout_wg.update_actor(batch))

    # ------------------------------------------------------------------ validation
    @property
    def validator(self) -> Validator:
        """Built on first use: the rollout worker group it generates with exists after `init_workers()`."""
        return Validator(
            self.config.trainer,
            self.config.actor_rollout_ref.rollout,
            self.val_dataloader,
            self.val_reward_fn,
            self.actor_rollout_wg,
            self.tokenizer,
        )

    def _validate(self) -> dict[str, float]:
        return self.validator.run(self.global_steps)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train for `total_training_steps` steps; validate every `test_freq`, save every `save_freq`.

        Returns the last step's metrics.
        """
        from tqdm import tqdm

        from verl.trainer.config import save_resolved_config
        from verl.utils.tracking import Tracking

        trainer_cfg = self.config.trainer
        tracker = Tracking(
            project_name=trainer_cfg.project_name,
            experiment_name=trainer_cfg.experiment_name,
            default_backend=trainer_cfg.logger,
            config=self.config,
            run_dir=trainer_cfg.get("run_dir"),
        )
        paths = self.current_speed_paths()
        speed_paths.report(paths, logger)
        if trainer_cfg.get("run_dir"):
            save_resolved_config(self.config, trainer_cfg.run_dir)
            speed_paths.save(paths, trainer_cfg.run_dir)
        self.tracker = tracker
        self._load_checkpoint()
        last: dict[str, float] = {}
        validator = self.validator
        if validator.should_validate_before_training():
            last = self._validate()
            tracker.log(last, step=self.global_steps)
            if trainer_cfg.get("val_only", False):
                tracker.finish()
                return last

        progress = tqdm(
            total=self.total_training_steps,
            initial=self.global_steps,
            desc="Training Progress",
            disable=not trainer_cfg.get("progress_bar", True),
        )
        while self.global_steps < self.total_training_steps:
            self.global_steps += 1
            is_last = self.global_steps >= self.total_training_steps
            self._step_profiler.begin(self.global_steps)
            metrics = self.step()
            self._update_curriculum()
            if self._nonfinite.record(metrics):
                tracker.log(metrics, step=self.global_steps)
                progress.close()
                raise self._nonfinite.error(self.global_steps)
            if trainer_cfg.rollout_data_dir:
                dump_rollouts(self._last_batch, self.tokenizer, trainer_cfg.rollout_data_dir, self.global_steps)
            timing: dict[str, float] = {}
            if validator.should_validate(self.global_steps, is_last):
                with marked_timer("testing", timing):
                    metrics.update(self._validate())
            if due(trainer_cfg.get("save_freq", -1), self.global_steps, is_last):
                with marked_timer("save_checkpoint", timing):
                    self._save_checkpoint()
            self._step_profiler.end(self.global_steps)
            metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
            metrics.update(speed_paths.metrics(self.current_speed_paths()))
            metrics["training/global_step"] = self.global_steps
            metrics["training/epoch"] = self.train_dataloader.epoch
            tracker.log(metrics, step=self.global_steps)
            progress.update(1)
            last = metrics
        progress.close()
        # stop the data loader's worker processes (data.dataloader_num_workers) now, not when the
        # TaskRunner's process ends under them (their death then reads as an error)
        self._train_iter = None
        tracker.finish()
        return last

    def _update_curriculum(self) -> None:
        """Hand the step's batch to a curriculum sampler (`data.sampler.class_path`), which may reorder
        what the next steps draw."""
        from verl.experimental.dataset.sampler import AbstractCurriculumSampler

        if isinstance(self.train_dataloader.sampler, AbstractCurriculumSampler):
            self.train_dataloader.sampler.update(batch=self._last_batch)

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpointer(self) -> Checkpointer:
        """Built on first use: the worker groups it saves exist only after `init_workers()`."""
        return Checkpointer(self.config.trainer, self.actor_rollout_wg, self.critic_wg if self.use_critic else None)

    def _save_checkpoint(self) -> str:
        """Save the workers and the driver's own state (dataloader, RNGs, KL coefficient, queued groups)."""
        driver_state = {
            "dataloader": self.train_dataloader.state_dict(),
            "global_steps": self.global_steps,
            "kl_coef": None if self.kl_ctrl_in_reward is None else self.kl_ctrl_in_reward.value,
            "rng": {"python": random.getstate(), "numpy": numpy_rng_state(), "torch": torch.get_rng_state()},
        }
        if self._async_rollout is not None:  # the drawn-but-untrained groups (the dataloader counts them)
            driver_state["async_rollout"] = to_plain(self._async_rollout.state_dict())
        return self.checkpointer.save(self.global_steps, driver_state)

    def _load_checkpoint(self) -> None:
        state = self.checkpointer.load()
        if state is None:
            return
        self.global_steps = state["global_steps"]
        self.train_dataloader.load_state_dict(state["dataloader"])
        self._train_iter = None
        if self._async_rollout is not None and "async_rollout" in state:
            self._async_rollout.load_state_dict(from_plain(state["async_rollout"]))
        if self.kl_ctrl_in_reward is not None and state.get("kl_coef") is not None:
            self.kl_ctrl_in_reward.value = state["kl_coef"]
        rng = state["rng"]
        random.setstate(rng["python"])
        set_numpy_rng_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])


_WORKER_GROUPS = ("actor_rollout_wg", "critic_wg", "ref_policy_wg", "rm_wg", "rollout_wg")
_NEEDS_SUM_PI_SQUARED = ("optimal_token_baseline", "tir_optimal_token_baseline")


def _check_estimator_inputs(config) -> None:
    """An estimator's inputs that only a config switch produces must be switched on."""
    estimator = config.algorithm.adv_estimator
    estimator = getattr(estimator, "value", estimator)
    actor = config.actor_rollout_ref.actor
    if estimator in _NEEDS_SUM_PI_SQUARED and not actor.get("calculate_sum_pi_squared", False):
        raise ValueError(
            f"algorithm.adv_estimator={estimator} weighs each token by its score norm, which needs sum_v pi_v^2 "
            "from the actor's log-prob pass; set actor_rollout_ref.actor.calculate_sum_pi_squared=true"
        )


def _equal_groups(uids, world_size: int) -> list[list[int]] | None:
    """Row indices per uid (in order of first appearance) when every group has the same size and
    the number of groups divides evenly over `world_size` ranks; else None (balance rows instead)."""
    if uids is None or len(uids) == 0:
        return None
    index: dict = {}
    for row, uid in enumerate(uids.tolist()):
        index.setdefault(uid, []).append(row)
    groups = list(index.values())
    if len(groups) % world_size or len({len(g) for g in groups}) != 1 or len(groups) == len(uids):
        return None
    return groups


_with_generation = with_generation


def _rollout_mismatch_metrics(batch: DataProto, old_log_probs: torch.Tensor) -> dict[str, float]:
    """training/rollout_probs_diff_*: |p_train - p_rollout| over valid response tokens."""
    mask = batch.batch["response_mask"].bool()
    diff = (old_log_probs.exp() - batch.batch["rollout_log_probs"].exp()).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_max": diff.max().item(),
    }


def __getattr__(name: str):
    # Upstream scripts import ResourcePoolManager from here; it lives in the single controller and is
    # resolved on first use, so importing this module does not import ray.
    if name == "ResourcePoolManager":
        from verl.single_controller.ray import ResourcePoolManager

        return ResourcePoolManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
