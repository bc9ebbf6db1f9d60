"""The PPO/GRPO driver: one Python process that holds the dataflow and dispatches to worker groups.

`RayPPOTrainer.step()` reads like the algorithm, one line per phase:

    generate (n samples per prompt) -> reward -> old log-probs -> reference log-probs -> values
        -> advantages (driver side, pure math) -> update critic -> update actor

with one visible branch: `algorithm.use_kl_in_reward` subtracts a KL penalty from the scores,
which needs the old and reference log-probs, so then those two phases come before the reward.

Design decisions:
- The loop calls components, it does not contain them: the batch comes from a `RolloutSource`
  (rollout_source.py: synchronous, DAPO's dynamic sampling, or async_rollout.py's generation
  running ahead), chosen once in `init_workers` and built from explicit parts (prompt stream,
  generator, reward scorer), never from the trainer; `fit()` asks the `Checkpointer` and the
  `Validator`; worker_groups.py spawns the worker groups, balance.py spreads the batch over the
  ranks, driver_math.py holds the batch arithmetic between worker calls.
- Each phase is a short method that times itself (`timing_s/<phase>`) and returns the batch
  unchanged when the config leaves it out (no critic, no reference, critic warm-up).
- Resumable: uids are deterministic (`<step>_<index>`, see `PromptStream`); the driver's state
  (dataloader position, KL coefficient, RNGs, the async source's queued groups) goes into the
  checkpoint's `data.pt` beside the workers' state.
- Non-finite losses: the driver stops with `NonFiniteLossError` after
  `trainer.max_consecutive_nonfinite_steps` skipped updates in a row (step_records.py).
- Speed paths (verl.utils.speed_paths): the workers report theirs once their models are built;
  `fit()` logs them at start, writes `speed_paths.yaml` beside the resolved config and adds
  `perf/<name>` to every step's metrics, so a fast path that is off is never silent.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from verl.experimental.reward_loop.reward_model import uses_generative_reward_model
from verl.protocol import DataProto
from verl.trainer.config.validate_batches import need_critic
from verl.trainer.ppo import driver_math
from verl.trainer.ppo.async_rollout import configure_off_policy_correction, staleness_threshold
from verl.trainer.ppo.balance import balance_trained_rows
from verl.trainer.ppo.checkpointer import Checkpointer
from verl.trainer.ppo.dataloaders import create_dataloaders
from verl.trainer.ppo.driver_math import (
    apply_kl_in_reward,
    check_estimator_inputs,
    kl_controller,
    old_log_prob_metrics,
)
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    compute_variance_proxy_metrics,
)
from verl.trainer.ppo.prometheus import publish_rollout_metrics
from verl.trainer.ppo.rollout_corr_helper import (
    apply_bypass_mode,
    compute_rollout_correction_and_add_to_batch,
    configure_rollout_correction,
)
from verl.trainer.ppo.rollout_source import (
    PromptStream,
    RewardScorer,
    StepState,
    build_rollout_source,
    meta_metrics,
)
from verl.trainer.ppo.step_records import NonFiniteLossError as NonFiniteLossError  # main_ppo and tests import it here
from verl.trainer.ppo.step_records import NonFiniteStreak, dump_rollouts
from verl.trainer.ppo.upstream_driver import (  # upstream's names, imported from here by recipes' trainers
    AdvantageEstimator as AdvantageEstimator,
)
from verl.trainer.ppo.upstream_driver import UpstreamTrainerAPI
from verl.trainer.ppo.upstream_driver import apply_kl_penalty as apply_kl_penalty
from verl.trainer.ppo.upstream_driver import compute_advantage as compute_advantage
from verl.trainer.ppo.upstream_driver import compute_response_mask as compute_response_mask
from verl.trainer.ppo.validator import Validator, due
from verl.trainer.ppo.worker_groups import WORKER_GROUPS, spawn_worker_groups, worker_speed_paths
from verl.trainer.ppo.worker_groups import Role as Role  # upstream's import path for scripts' role mappings
from verl.utils import speed_paths
from verl.utils.checkpoint.safe_load import from_plain, numpy_rng_state, set_numpy_rng_state, to_plain
from verl.utils.logging_utils import get_logger
from verl.utils.profiler import StepProfiler, resolve_role_profilers
from verl.utils.speed_paths import SpeedPath
from verl.utils.timer import marked_timer
from verl.utils.tracking import ValidationGenerationsLogger

logger = get_logger(__name__, "INFO")


class RayPPOTrainer(UpstreamTrainerAPI):
    """Driver of PPO-family training over Ray worker groups (upstream-compatible constructor).

    Upstream's phase methods (`_compute_old_log_prob(batch)`, `_update_actor(batch)`, ...; see
    upstream_driver.py) do the worker calls; `step()`'s own phases (`_step_*`) wrap them with the
    timing, metrics and decisions of this project's loop, so a subclass's override of an upstream
    phase takes effect here as in upstream's `fit()`."""

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
        *,
        validate_config: bool = True,
    ):
        """validate_config: check `config` as `main_ppo` does before Ray starts (unknown keys, types,
        batch arithmetic, settings not implemented here), for drivers that build the trainer
        themselves (recipes'); `main_ppo` passes False, having checked it already."""
        from verl.single_controller.ray import RayWorkerGroup

        if validate_config:
            from verl.trainer.config import validate_ppo_config
            from verl.trainer.config.driver_keys import calling_driver_file, driver_keys_near

            # keys the calling driver's own config files declare are its own (verl.trainer.config.driver_keys)
            validate_ppo_config(config, driver_keys=driver_keys_near(calling_driver_file()))

        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        self.role_worker_mapping = role_worker_mapping
        self.resource_pool_manager = resource_pool_manager
        self.ray_worker_group_cls = ray_worker_group_cls or RayWorkerGroup
        self.reward_scorer = RewardScorer(reward_fn)  # the reward model joins it in init_workers
        self.val_reward_fn = val_reward_fn
        self.device_name = device_name or config.trainer.device  # upstream: the config's device when not given

        algo = config.algorithm
        # upstream's rule: the config decides (critic.enable, else GAE); recipes' drivers map a critic always
        trains_critic = need_critic(config)
        self.use_critic = trains_critic and Role.Critic in role_worker_mapping
        if trains_critic and Role.Critic not in role_worker_mapping:
            raise ValueError(
                f"algorithm.adv_estimator={algo.adv_estimator} (or critic.enable=true) trains a critic, but the role "
                "mapping has no Role.Critic worker; add one (verl.workers.fsdp_workers.CriticWorker) or choose an "
                "estimator without a critic (grpo, rloo, ...)"
            )
        self.use_reference_policy = Role.RefPolicy in role_worker_mapping or Role.ActorRolloutRef in role_worker_mapping
        # a generative reward model is served to the reward function, not run by reward-model workers
        self.use_rm = Role.RewardModel in role_worker_mapping and not uses_generative_reward_model(config)
        check_estimator_inputs(config)
        self.validation_generations_logger = ValidationGenerationsLogger(
            config.trainer.project_name, config.trainer.experiment_name
        )
        self._init_driver_state()
        self._create_dataloader(train_dataset, val_dataset, collate_fn, train_sampler)

    def _init_driver_state(self) -> None:
        """The driver's own state, derived from the config. A recipe's trainer whose `__init__` sets
        upstream's attributes itself and never calls this class's (verl-recipe's SPPO) gets it from
        `init_workers` and `_create_dataloader`: what the subclass set is kept."""
        if self.__dict__.get("_driver_state_ready"):
            return
        config = self.config
        defaults = {
            "reward_model_manager": None,  # the generative reward model's servers (init_workers), if any
            "rollout_source": None,  # chosen in init_workers, once its worker groups exist
            "global_steps": 0,
            "_nonfinite": lambda: NonFiniteStreak(config.trainer.max_consecutive_nonfinite_steps),
            "kl_ctrl_in_reward": lambda: kl_controller(config.algorithm) if config.algorithm.use_kl_in_reward else None,
        }
        for name, value in defaults.items():
            if name not in self.__dict__:
                setattr(self, name, value() if callable(value) else value)
        if "reward_scorer" not in self.__dict__:
            self.reward_scorer = RewardScorer(None)
        if staleness_threshold(config) > 0:
            configure_off_policy_correction(config)
        # both may hand settings to the workers' configs, so they run before the workers are built
        self.rollout_correction = configure_rollout_correction(config)
        self.profiler_config = resolve_role_profilers(config)
        self._step_profiler = StepProfiler(self.profiler_config)
        self._driver_state_ready = True

    @property
    def reward_fn(self):
        """The rule reward function the training samples are scored with (reassignable)."""
        return self.reward_scorer.reward_fn

    @reward_fn.setter
    def reward_fn(self, fn) -> None:
        if "reward_scorer" not in self.__dict__:  # a recipe's __init__ that sets it before ours ran
            self.reward_scorer = RewardScorer(fn)
        self.reward_scorer.reward_fn = fn

    # ------------------------------------------------------------------ setup
    def _create_dataloader(self, train_dataset, val_dataset, collate_fn, train_sampler) -> None:
        """The training and validation loaders; a dataset not given is built from `data.train_files` /
        `data.val_files` (upstream's rule: recipes' drivers pass none)."""
        from verl.utils.dataset.rl_dataset import create_rl_dataset

        self._init_driver_state()  # a recipe's __init__ that skipped ours calls this one (see _init_driver_state)
        data = self.config.data
        if train_dataset is None or (val_dataset is None and data.get("val_files")):
            from verl.trainer.default_data import ensure_default_data

            ensure_default_data(self.config)  # the demo's files, for a recipe's driver given `+demo=arith`
        if train_dataset is None:
            train_dataset = create_rl_dataset(data.train_files, data, self.tokenizer, self.processor, is_train=True)
        if val_dataset is None and data.get("val_files"):
            val_dataset = create_rl_dataset(data.val_files, data, self.tokenizer, self.processor, is_train=False)
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.train_dataloader, self.val_dataloader = create_dataloaders(
            self.config.data, train_dataset, val_dataset, collate_fn, train_sampler
        )
        self.prompts = PromptStream(self.train_dataloader, current_step=lambda: self.global_steps)
        total = self.config.trainer.total_training_steps
        self.total_training_steps = total or len(self.train_dataloader) * self.config.trainer.total_epochs
        logger.info(
            f"train batches per epoch: {len(self.train_dataloader)}, total training steps: {self.total_training_steps}"
        )

    def init_workers(self, groups: dict[str, Any] | None = None) -> None:
        """Create the resource pools, spawn one worker group per pool, build the models, and choose
        the rollout source.

        groups: worker groups spawned and built before (`spawn_worker_groups`' result), used instead
        of spawning: a driver that runs several trainers on one set of workers (the in-process
        algorithm tests) pays the workers' start once. They must hold every role of the mapping;
        groups of roles the mapping lacks are never called (their speed paths are still reported).
        """
        self._init_driver_state()
        if groups is None:
            # a critic the config does not train is not started (a recipe's driver maps one always)
            mapping = {r: c for r, c in self.role_worker_mapping.items() if r != Role.Critic or self.use_critic}
            if uses_generative_reward_model(self.config):
                # upstream's reward loop: the reward model is served to the reward function (which starts
                # its servers), so no reward-model workers, whatever the driver mapped
                mapping.pop(Role.RewardModel, None)
            groups = spawn_worker_groups(
                self.config,
                mapping,
                self.resource_pool_manager,
                self.ray_worker_group_cls,
                runtime_env=self.profiler_config.worker_runtime_env(),  # nsys: start each worker under nsys
            )
        for name, group in groups.items():
            setattr(self, name, group)
        self._adopt_worker_groups(groups)

    def _adopt_worker_groups(self, groups: dict[str, Any]) -> None:
        """The driver state built on the worker groups: the generative reward model's servers, the reward
        model group, the rollout source, speed paths, Prometheus addresses, the step profiler. `init_workers`
        calls it; `fit` calls it with the groups a trainer's own `init_workers` assigned (upstream's names:
        `actor_rollout_wg`, `critic_wg`, `ref_policy_wg`, `rm_wg`) when that one never called ours."""
        if uses_generative_reward_model(self.config):  # its servers, before the first reward asks them
            from verl.experimental.reward_loop.reward_model import RewardModelManager

            self.reward_model_manager = RewardModelManager(self.config)
            logger.info("generative reward model served at %s", self.reward_model_manager.get_router_address())
        self.reward_scorer.reward_model = groups.get("rm_wg") if self.use_rm else None
        self.rollout_source = build_rollout_source(
            self.config,
            prompts=self.prompts,
            scorer=self.reward_scorer,
            actor_wg=self.actor_rollout_wg,
            tokenizer=self.tokenizer,
            current_step=lambda: self.global_steps,
            total_steps=lambda: self.total_training_steps,
            rollout_wg=groups.get("rollout_wg"),
            processor=self.processor,
        )
        self._worker_speed_paths = worker_speed_paths(groups)
        # rollout.prometheus.enable: the engines' metrics endpoints, listed in Prometheus's scrape config
        self.rollout_metrics_addresses = publish_rollout_metrics(
            self.config.actor_rollout_ref.rollout.prometheus, groups
        )
        unique = {id(g): g for g in groups.values()}
        self._step_profiler = StepProfiler(self.profiler_config, unique.values())

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
        state = StepState()
        with marked_timer("step", state.timing):
            batch = self.rollout_source.next_batch(state)  # prompts, n samples each, their scores
            self._step_balance(batch, state)
            if self.kl_ctrl_in_reward is None:
                batch = self._step_reward(batch, state)
                batch = self._step_old_log_prob(batch, state)
                batch = self._step_ref_log_prob(batch, state)
            else:  # KL in the reward: the penalty needs the old and reference log-probs, so they come first
                batch = self._step_old_log_prob(batch, state)
                batch = self._step_ref_log_prob(batch, state)
                batch = self._step_reward(batch, state)
            batch = self._step_values(batch, state)
            batch = self._step_correct_rollout(batch, state)
            batch = self._step_advantage(batch, state)
            self._step_update_critic(batch, state)
            self._step_update_actor(batch, state)
        state.metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        state.metrics.update(compute_timing_metrics(batch, state.timing))
        # variance_proxy/*: only when the actor's log-prob pass gave sum_pi_squared (as upstream)
        grad_norm = state.metrics.get("actor/grad_norm")
        state.metrics.update(compute_variance_proxy_metrics(batch, gradient_norm=grad_norm))
        n_devices = self.config.trainer.nnodes * self.config.trainer.n_gpus_per_node
        state.metrics.update(compute_throughput_metrics(batch, state.timing, n_devices))
        self._last_batch = batch
        return state.metrics

    # ------------------------------------------------------------------ phases
    def _step_balance(self, batch: DataProto, state: StepState) -> None:
        """Equal work per data-parallel rank, GRPO groups whole (balance.py); then the token counts
        the throughput metrics read."""
        if self.config.trainer.balance_batch:
            self._balance_batch(batch, state.metrics)
        batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()

    def _step_reward(self, batch: DataProto, state: StepState) -> DataProto:
        """token_level_rewards: the scores, less the KL penalty to the reference policy when
        `algorithm.use_kl_in_reward` (its coefficient from the KL controller, updated once a step)."""
        with marked_timer("reward", state.timing):
            if self.kl_ctrl_in_reward is None:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
                return batch
            algo = self.config.algorithm
            n_steps = self.config.data.train_batch_size
            state.metrics.update(apply_kl_in_reward(batch, self.kl_ctrl_in_reward, algo.kl_penalty, n_steps))
        return batch

    def _reuses_current_log_probs(self, batch: DataProto | None = None) -> bool:
        """Strictly on-policy training (one PPO epoch over one mini-batch, nothing else reading the
        old log-probs) needs no separate old-log-prob pass: they equal the current policy's, so the
        actor uses its own detached log-probs (ratio exactly 1), saving a forward over the batch.
        One mini-batch: the step's batch (`batch`, its prompts x rollout.n rows; else train_batch_size
        prompts) is `ppo_mini_batch_size` prompts; a `data.gen_batch_size` larger than train_batch_size
        without group filtering trains every generated prompt, so more than one."""
        arc = self.config.actor_rollout_ref
        rows = len(batch) if batch is not None else self.config.data.train_batch_size * arc.rollout.n
        return (
            not arc.actor.recompute_log_prob
            and arc.actor.ppo_epochs == 1
            and arc.actor.ppo_mini_batch_size * arc.rollout.n == rows
            and not self.config.algorithm.use_kl_in_reward
            # the rollout's log-probs need a separate old-log-prob pass only where something compares them with it
            # before the update (the update reports their mismatch itself)
            and not (
                arc.rollout.calculate_log_probs
                and (
                    getattr(self, "rollout_correction", None) is not None
                    or getattr(getattr(self, "rollout_source", None), "runs_ahead", False)
                    or _tis_on(arc.actor)
                )
            )
            # an FSDP-actor key (FSDPActorConfig): the megatron actor's section has none (as upstream's)
            and not (arc.actor.strategy != "megatron" and arc.actor.calculate_sum_pi_squared)
        )

    def _step_old_log_prob(self, batch: DataProto, state: StepState) -> DataProto:
        """old_log_probs: the actor's forward pass, unless the rollout's log-probs stand for them
        (async `tis` correction sets them in the source; rollout correction's bypass mode) or
        training is strictly on-policy (`_reuses_current_log_probs`)."""
        with marked_timer("old_log_prob", state.timing):
            if "old_log_probs" in batch.batch or self._reuses_current_log_probs(batch):
                return batch
            if self.rollout_correction is not None and self.rollout_correction.bypass_mode:
                apply_bypass_mode(batch)  # the rollout's log-probs are the old ones: no forward pass
                return batch
            out, _ = self._compute_old_log_prob(batch)
        state.metrics.update(meta_metrics(out))
        actor_cfg = self.config.actor_rollout_ref.actor
        state.metrics.update(old_log_prob_metrics(batch, out, actor_cfg, self.rollout_source.runs_ahead))
        return batch.union(out)

    def _step_ref_log_prob(self, batch: DataProto, state: StepState) -> DataProto:
        if not self.use_reference_policy:
            return batch
        with marked_timer("ref", state.timing):
            return batch.union(self._compute_ref_log_prob(batch))

    def _step_values(self, batch: DataProto, state: StepState) -> DataProto:
        if not self.use_critic:
            return batch
        with marked_timer("values", state.timing):
            return batch.union(self._compute_values(batch))

    def _step_correct_rollout(self, batch: DataProto, state: StepState) -> DataProto:
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

    def _step_advantage(self, batch: DataProto, state: StepState) -> DataProto:
        """Driver-side advantage estimation (driver_math.compute_advantage)."""
        # PF-PPO's draw is seeded by the step, so a resumed run draws the same rows
        seed = int(self.config.data.seed or 0) * 100_003 + self.global_steps
        state.metrics.update(driver_math.gdpo_metrics(batch, self.config.algorithm))
        with marked_timer("adv", state.timing):
            return driver_math.compute_advantage(batch, self.config.algorithm, pf_ppo_seed=seed)

    def _step_update_critic(self, batch: DataProto, state: StepState) -> None:
        if not self.use_critic:
            return
        with marked_timer("update_critic", state.timing):
            state.metrics.update(meta_metrics(self._update_critic(batch)))

    def _step_update_actor(self, batch: DataProto, state: StepState) -> None:
        """After the critic's warm-up steps (`trainer.critic_warmup`)."""
        if self.global_steps <= self.config.trainer.critic_warmup:
            return
        arc = self.config.actor_rollout_ref
        if self.config.trainer.balance_batch:
            balance_trained_rows(batch, self.actor_rollout_wg.world_size, arc.actor, arc.rollout.n)
        with marked_timer("update_actor", state.timing):
            state.metrics.update(meta_metrics(self._update_actor(batch)))

    # ------------------------------------------------------------------ validation
    @property
    def validator(self) -> Validator:
        """Built on each use (the rollout worker group it generates with exists after `init_workers()`,
        and a driver may reassign the parts it reads)."""
        return Validator(
            self.config.trainer,
            self.config.actor_rollout_ref.rollout,
            self.val_dataloader,
            self.val_reward_fn,
            self.actor_rollout_wg,
            self.tokenizer,
        )

    def _validate(self) -> dict[str, float]:
        validator = self.validator
        metrics = validator.run(self.global_steps)
        if validator.last_samples is not None:
            self._maybe_log_val_generations(*validator.last_samples)
        return metrics

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train for `total_training_steps` steps; validate every `test_freq`, save every `save_freq`.

        Returns the last step's metrics.
        """
        from tqdm import tqdm

        from verl.trainer.config import save_resolved_config
        from verl.utils.tracking import Tracking

        self._init_driver_state()
        if self.rollout_source is None:  # a trainer whose own init_workers assigned the worker groups
            groups = {name: getattr(self, name, None) for name in WORKER_GROUPS}
            groups = {name: group for name, group in groups.items() if group is not None}
            if "actor_rollout_wg" not in groups:
                raise RuntimeError(
                    "fit() needs the worker groups: call init_workers() first (or, in an init_workers of your own, "
                    "assign self.actor_rollout_wg and the other groups, upstream's names)"
                )
            self._adopt_worker_groups(groups)
        trainer_cfg = self.config.trainer
        tracker = Tracking(
            project_name=trainer_cfg.project_name,
            experiment_name=trainer_cfg.experiment_name,
            default_backend=trainer_cfg.logger,
            config=self.config,
            run_dir=trainer_cfg.run_dir,
        )
        paths = self.current_speed_paths()
        speed_paths.report(paths, logger)
        if trainer_cfg.run_dir:
            save_resolved_config(self.config, trainer_cfg.run_dir)
            speed_paths.save(paths, trainer_cfg.run_dir)
        self.tracker = tracker
        self._load_checkpoint()
        last: dict[str, float] = {}
        validator = self.validator
        if validator.should_validate_before_training():
            last = self._validate()
            tracker.log(last, step=self.global_steps)
            if trainer_cfg.val_only:
                tracker.finish()
                return last

        progress = tqdm(
            total=self.total_training_steps,
            initial=self.global_steps,
            desc="Training Progress",
            disable=not trainer_cfg.progress_bar,
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
                self.checkpointer.finish_pending(wait=True)  # an earlier step still being written is published
                raise self._nonfinite.error(self.global_steps)
            if trainer_cfg.rollout_data_dir:
                dump_rollouts(self._last_batch, self.tokenizer, trainer_cfg.rollout_data_dir, self.global_steps)
            timing: dict[str, float] = {}
            if validator.should_validate(self.global_steps, is_last):
                with marked_timer("testing", timing):
                    metrics.update(self._validate())
            if due(trainer_cfg.save_freq, self.global_steps, is_last):
                with marked_timer("save_checkpoint", timing):
                    self._save_checkpoint()
            self.checkpointer.finish_pending(wait=False)  # publishes a background-written step once it is complete
            self._step_profiler.end(self.global_steps)
            metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
            metrics.update(speed_paths.metrics(self.current_speed_paths()))
            metrics["training/global_step"] = self.global_steps
            metrics["training/epoch"] = self.train_dataloader.epoch
            tracker.log(metrics, step=self.global_steps)
            progress.update(1)
            last = metrics
            if not is_last:
                self._dataset_batch_end()
        progress.close()
        self.checkpointer.finish_pending(wait=True)  # the run ends with every checkpoint complete
        self.prompts.restart()  # stops the data loader's worker processes (data.dataloader_num_workers) now
        tracker.finish()
        return last

    def _dataset_batch_end(self) -> None:
        """Upstream's hook: a training dataset with `on_batch_end(batch=...)` (a `data.custom_cls` that grows or
        changes itself from what was trained) gets each step's batch, except the last step's. Rows it adds
        are drawn from the next epoch on (the sampler reads the dataset's length when an epoch begins, as
        upstream's random sampler does)."""
        hook = getattr(self.train_dataset, "on_batch_end", None)
        if callable(hook):
            hook(batch=self._last_batch)

    def _update_curriculum(self) -> None:
        """Hand the step's batch to a curriculum sampler (`data.sampler.class_path`), which may reorder
        what the next steps draw."""
        from verl.experimental.dataset.sampler import AbstractCurriculumSampler

        if isinstance(self.train_dataloader.sampler, AbstractCurriculumSampler):
            self.train_dataloader.sampler.update(batch=self._last_batch)

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpointer(self) -> Checkpointer:
        """Built on first use: the worker groups it saves exist only after `init_workers()`. Kept, as
        it holds the step still being written in the background (`checkpoint.async_save`)."""
        if getattr(self, "_checkpointer", None) is None:
            async_save = self.config.actor_rollout_ref.actor.checkpoint.async_save or (
                self.use_critic and self.config.critic.checkpoint.async_save
            )
            self._checkpointer = Checkpointer(
                self.config.trainer,
                self.actor_rollout_wg,
                self.critic_wg if self.use_critic else None,
                async_save=bool(async_save),
            )
        return self._checkpointer

    def _save_checkpoint(self) -> str:
        """Save the workers and the driver's own state (dataloader, RNGs, KL coefficient, queued groups)."""
        driver_state = {
            "dataloader": self.train_dataloader.state_dict(),
            "global_steps": self.global_steps,
            "kl_coef": None if self.kl_ctrl_in_reward is None else self.kl_ctrl_in_reward.value,
            "rng": {"python": random.getstate(), "numpy": numpy_rng_state(), "torch": torch.get_rng_state()},
        }
        source_state = self.rollout_source.state_dict()
        if source_state:  # the async source's drawn-but-untrained groups (the key predates the other sources)
            driver_state["async_rollout"] = to_plain(source_state)
        return self.checkpointer.save(self.global_steps, driver_state)

    def _load_checkpoint(self) -> None:
        state = self.checkpointer.load()
        if state is None:
            return
        self.global_steps = state["global_steps"]
        self.train_dataloader.load_state_dict(state["dataloader"])
        self.prompts.restart()
        if "async_rollout" in state:
            self.rollout_source.load_state_dict(from_plain(state["async_rollout"]))
        if self.kl_ctrl_in_reward is not None and state.get("kl_coef") is not None:
            self.kl_ctrl_in_reward.value = state["kl_coef"]
        rng = state["rng"]
        random.setstate(rng["python"])
        set_numpy_rng_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])


def __getattr__(name: str):
    # Upstream scripts import ResourcePoolManager from here; it lives in the single controller and is
    # resolved on first use, so importing this module does not import ray.
    if name == "ResourcePoolManager":
        from verl.single_controller.ray import ResourcePoolManager

        return ResourcePoolManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tis_on(actor) -> bool:
    """actor.tis_imp_ratio_cap > 0: truncated importance sampling against the rollout's log-probs."""
    cap = actor.get("tis_imp_ratio_cap", -1)
    return cap is not None and cap > 0
