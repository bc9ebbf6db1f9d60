"""Upstream's `RayPPOTrainer` surface for drivers written against it.

verl-recipe's trainers (DAPO, entropy, SPPO, ...) subclass upstream's `RayPPOTrainer`, replace
`fit()` with a loop of their own, and build it from the pieces upstream's trainer exposes: module
functions (`compute_response_mask`, `apply_kl_penalty`, `compute_advantage`), trainer attributes
(`async_rollout_manager`, `ref_in_actor`, `kl_ctrl_in_reward`, ...) and phase methods
(`_get_gen_batch`, `_balance_batch`, `_compute_old_log_prob`, `_update_actor`, ...). This module
holds those pieces, with upstream's names, signatures and return values (volcengine/verl b178a3cd),
as `UpstreamTrainerAPI`, a base of `RayPPOTrainer`; `RayPPOTrainer.step()` calls the same phase
methods, so a subclass that overrides one of them changes this project's loop too.

Design decisions (where this differs from upstream, and why):
- Generation: `async_rollout_manager.generate_sequences(prompts)` sends the prompt rows to the hybrid
  actor-rollout group (upstream's manager talks to rollout servers through agent loops; this
  project's group runs agent loops itself when `multi_turn.enable`). Upstream's dataset gives the
  rollout chat messages and no token ids; this one gives token ids, so `_get_gen_batch` moves
  `input_ids`, `attention_mask` and `position_ids` into the generation batch (upstream's rule before
  its agent loops) and the rollout's output brings them back, prompt plus response.
- `_compute_old_log_prob` returns `(log-probs, mfu)` as upstream's; the MFU is the worker's
  `perf/mfu/actor_infer` when it reports one (CUDA), else 0 (upstream's legacy workers: 0).
- `_balance_batch(..., keep_minibatch=True)` (upstream's balancing inside each mini-batch) is not
  implemented: it raises, naming the alternative, rather than balancing differently.
"""

from __future__ import annotations

import functools

import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.balance import balance_batch
from verl.trainer.ppo.driver_math import apply_kl_in_reward, estimate_advantages
from verl.trainer.ppo.generation import GEN_BATCH_KEYS
from verl.trainer.ppo.step_records import dump_generations, dump_rollouts
from verl.utils.timer import marked_timer
from verl.utils.tracking import select_val_generations

AdvantageEstimator = core_algos.AdvantageEstimator
REWARD_COLUMNS = frozenset({"data_source", "reward_model", "extra_info", "uid"})
"""The prompt columns the reward needs: they stay in the batch (and travel with the generation batch)."""


def compute_response_mask(data: DataProto) -> torch.Tensor:
    """The attention mask's response part [B, R]: its last `responses.shape[1]` columns."""
    response_length = data.batch["responses"].shape[-1]
    return data.batch["attention_mask"][:, -response_length:]


def apply_kl_penalty(data: DataProto, kl_ctrl, kl_penalty: str = "kl") -> tuple[DataProto, dict[str, float]]:
    """`token_level_rewards = token_level_scores - beta * KL` per response token, beta the controller's
    value, KL the `kl_penalty` estimate from `old_log_probs` and `ref_log_prob`; the controller then
    sees the batch's mean KL with n_steps = the batch's row count (upstream's call). Returns
    `(data, {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"})`."""
    if "response_mask" not in data.batch:
        data.batch["response_mask"] = compute_response_mask(data)
    metrics = apply_kl_in_reward(data, kl_ctrl, kl_penalty, n_steps=len(data))
    return data, metrics


def compute_advantage(
    data: DataProto,
    adv_estimator,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
) -> DataProto:
    """`advantages` and `returns` [B, R] by the estimator `adv_estimator` (a name or
    `AdvantageEstimator`), grouping rows by their `uid`; `response_mask` is added when missing. The
    estimator gets whatever it takes of the batch (`values`, `reward_baselines`, `sum_pi_squared`,
    `rollout_is_weights`, ...) and of `config` (the `algorithm` section: an estimator's own options,
    and PF-PPO's redraw of a GAE batch when `config.use_pf_ppo`). `num_repeat` is accepted for
    upstream's signature; no estimator reads it there either."""
    del num_repeat
    if "response_mask" not in data.batch:
        data.batch["response_mask"] = compute_response_mask(data)
    name = adv_estimator.value if isinstance(adv_estimator, AdvantageEstimator) else adv_estimator
    estimate_advantages(
        data, name, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config
    )
    if name == "gae" and config is not None and config.get("use_pf_ppo", False):
        pf = config.pf_ppo
        data = core_algos.compute_pf_ppo_reweight_data(data, pf.get("reweight_method"), pf.get("weight_pow"))
    return data


class UpstreamTrainerAPI:
    """The attributes and phase methods upstream's `RayPPOTrainer` gives its subclasses (see the
    module docstring). Mixed into `RayPPOTrainer`, which provides `config`, the worker groups,
    `tokenizer`, `processor`, `global_steps`, `use_critic`, `use_reference_policy` and `_step_profiler`."""

    async_rollout_mode = True  # upstream's trainer always generates through its rollout manager now

    @property
    def async_rollout_manager(self):
        """The trainer's generation handle: upstream's `AgentLoopManager` over the trainer's actor-rollout group;
        a trainer whose own `init_workers` assigns one (or a subclass of it) gets that one."""
        manager = self.__dict__.get("_async_rollout_manager")
        if manager is None:
            from verl.trainer.ppo.agent_loop_manager import AgentLoopManager

            return AgentLoopManager.of_trainer(self)  # not kept: it follows the trainer's current groups
        return manager

    @async_rollout_manager.setter
    def async_rollout_manager(self, manager) -> None:
        self.__dict__["_async_rollout_manager"] = manager

    # upstream's __init__ sets these two from the config; a recipe's __init__ that does the same instead
    # of calling ours assigns them (a cached_property: the assignment is the attribute's value)
    @functools.cached_property
    def hybrid_engine(self) -> bool:
        return bool(self.config.actor_rollout_ref.hybrid_engine)

    @functools.cached_property
    def ref_in_actor(self) -> bool:
        """The reference policy is the actor without its LoRA adapter (upstream's rule)."""
        model = self.config.actor_rollout_ref.model
        return (model.get("lora_rank", 0) or 0) > 0 or model.get("lora_adapter_path") is not None

    # ------------------------------------------------------------------ generation batch
    def _get_gen_batch(self, batch: DataProto) -> DataProto:
        """Move the prompt-side columns out of `batch` into the generation batch; the reward's columns
        (`REWARD_COLUMNS`) stay in `batch` and are copied into the generation batch as well."""
        tensors = [k for k in GEN_BATCH_KEYS if batch.batch is not None and k in batch.batch]
        columns = [k for k in batch.non_tensor_batch if k not in REWARD_COLUMNS]
        gen_batch = batch.pop(batch_keys=tensors, non_tensor_batch_keys=columns)
        gen_batch.non_tensor_batch.update(batch.non_tensor_batch)
        return gen_batch

    # ------------------------------------------------------------------ phases, upstream's signatures
    def _balance_batch(
        self, batch: DataProto, metrics: dict, logging_prefix: str = "global_seqlen", keep_minibatch=False
    ):
        """Reorder `batch` in place so every data-parallel rank gets a like number of tokens (GRPO groups
        kept whole where they split evenly, `balance.py`); the balance statistics go into `metrics` under
        `logging_prefix`."""
        if keep_minibatch:
            raise NotImplementedError(
                "_balance_batch(keep_minibatch=True) (balancing inside each mini-batch) is not implemented here; "
                "call it without keep_minibatch to balance the whole batch, or set trainer.balance_batch=false"
            )
        stats = balance_batch(batch, self.actor_rollout_wg.world_size)
        metrics.update({logging_prefix + k.removeprefix("global_seqlen"): v for k, v in stats.items()})

    def _compute_old_log_prob(self, batch: DataProto) -> tuple[DataProto, float]:
        output = self.actor_rollout_wg.compute_log_prob(batch)
        return output, float(output.meta_info.get("metrics", {}).get("perf/mfu/actor_infer", 0.0) or 0.0)

    def _compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        return self.ref_policy_wg.compute_ref_log_prob(batch)

    def _compute_values(self, batch: DataProto) -> DataProto:
        return self.critic_wg.compute_values(batch)

    def _update_actor(self, batch: DataProto) -> DataProto:
        rollout = self.config.actor_rollout_ref.rollout
        batch.meta_info["multi_turn"] = rollout.multi_turn.enable
        batch.meta_info["temperature"] = rollout.temperature
        return self.actor_rollout_wg.update_actor(batch)

    def _update_critic(self, batch: DataProto) -> DataProto:
        return self.critic_wg.update_critic(batch)

    # ------------------------------------------------------------------ profiling and dumps
    def _start_profiling(self, do_profile: bool) -> None:
        """Start the profilers of `global_profiler.steps` for this step when `do_profile`."""
        if do_profile:
            self._step_profiler.begin(self.global_steps)

    def _stop_profiling(self, do_profile: bool) -> None:
        if do_profile:
            self._step_profiler.end(self.global_steps)

    def _dump_generations(self, inputs, outputs, gts, scores, reward_extra_infos_dict: dict, dump_path: str) -> None:
        """`<dump_path>/<step>.jsonl`: one JSON object per sample with its `input`, `output`, `gts`,
        `score` and `step`, plus each `reward_extra_infos_dict` entry that has one value per sample
        (`step_records.dump_generations`, which `trainer.validation_data_dir` writes with too)."""
        columns = {"input": inputs, "output": outputs, "gts": gts, "score": scores, **reward_extra_infos_dict}
        dump_generations(dump_path, self.global_steps, columns)

    def _maybe_log_val_generations(self, inputs, outputs, scores) -> None:
        """Log `trainer.log_val_generations` of the validation samples (`select_val_generations`) to
        the trackers of `trainer.logger` through `self.validation_generations_logger`."""
        n = self.config.trainer.get("log_val_generations", 0)
        samples = select_val_generations(inputs, outputs, scores, n)
        if samples:
            self.validation_generations_logger.log(self.config.trainer.logger, samples, self.global_steps)

    def _log_rollout_data(self, batch: DataProto, reward_extra_infos_dict: dict, timing_raw: dict, rollout_data_dir):
        """`<rollout_data_dir>/<step>.jsonl`, one line per sample (`step_records.dump_rollouts`)."""
        del reward_extra_infos_dict  # the batch's own columns already hold the reward's extra info
        with marked_timer("dump_rollout_generations", timing_raw):
            dump_rollouts(batch, self.tokenizer, rollout_data_dir, self.global_steps)
