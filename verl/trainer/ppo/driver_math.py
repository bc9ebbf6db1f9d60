"""What the driver computes on a step's batch between two worker calls, as plain functions.

`RayPPOTrainer`'s phases decide which worker group runs when; the batch arithmetic they do on the
driver lives here, as functions of the batch and config sections (never the trainer or a worker
group), so each is tested alone: the final reward (KL-in-reward), the advantages (and PF-PPO's
redraw), and the metrics of the old-log-prob pass. The tensor math itself is `core_algos`'.
"""

from __future__ import annotations

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.async_rollout import importance_weight_metrics

ESTIMATOR_OPTIONAL_INPUTS = ("values", "reward_baselines", "old_log_probs", "sum_pi_squared", "rollout_is_weights")
"""Batch keys handed to the advantage estimator when present (core_algos keeps those it takes)."""

_NEEDS_SUM_PI_SQUARED = ("optimal_token_baseline", "tir_optimal_token_baseline")


def kl_controller(algo_cfg):
    """The KL coefficient's controller of `algorithm.kl_ctrl` (fixed or adaptive)."""
    kl = algo_cfg.kl_ctrl
    return core_algos.get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)


def apply_kl_in_reward(batch: DataProto, kl_ctrl, kl_penalty: str, n_steps: int) -> dict[str, float]:
    """`algorithm.use_kl_in_reward`: token_level_rewards = token_level_scores - beta * KL estimate
    per token (`kl_penalty`, from old_log_probs and ref_log_prob), beta = `kl_ctrl.value`; then
    the controller sees the batch's KL (`n_steps`: `data.train_batch_size`). Returns the
    actor/reward_kl_penalty{,_coeff} metrics."""
    kl_coef = kl_ctrl.value
    rewards, current_kl = core_algos.apply_kl_penalty_tensors(
        batch.batch["token_level_scores"],
        batch.batch["old_log_probs"],
        batch.batch["ref_log_prob"],
        batch.batch["response_mask"],
        kl_coef=kl_coef,
        kl_penalty=kl_penalty,
    )
    batch.batch["token_level_rewards"] = rewards
    current_kl = float(current_kl)
    kl_ctrl.update(current_kl=current_kl, n_steps=n_steps)
    return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": kl_coef}


def estimate_advantages(batch: DataProto, estimator, **options) -> None:
    """`advantages` and `returns` [B, R] of `batch` by the estimator `estimator` (a name), written into
    the batch. The estimator gets what it takes of the batch's token_level_rewards, response_mask,
    `uid` (as `index`) and `ESTIMATOR_OPTIONAL_INPUTS`, and of `options` (gamma, lam,
    norm_adv_by_std_in_grpo, config, ...)."""
    inputs = {
        "token_level_rewards": batch.batch["token_level_rewards"],
        "response_mask": batch.batch["response_mask"],
        **options,
    }
    if "uid" in batch.non_tensor_batch:
        inputs["index"] = batch.non_tensor_batch["uid"]
    inputs.update({k: batch.batch[k] for k in ESTIMATOR_OPTIONAL_INPUTS if k in batch.batch})
    batch.batch["advantages"], batch.batch["returns"] = core_algos.compute_advantage_from_tensors(estimator, **inputs)


def gdpo_inputs(batch: DataProto, algo_cfg) -> dict:
    """GDPO's reward components: the `algorithm.gdpo_reward_keys` columns the reward function's extra info
    put in the batch, and their weights."""
    keys = list(algo_cfg.get("gdpo_reward_keys") or [])
    missing = [k for k in keys if k not in batch.non_tensor_batch]
    if missing:
        raise KeyError(
            f"algorithm.gdpo_reward_keys {missing} are not in the batch: the reward function must return a dict "
            f"holding them (available columns: {sorted(batch.non_tensor_batch)})"
        )
    weights = algo_cfg.get("gdpo_reward_weights")
    return {
        "reward_components": [batch.non_tensor_batch[k] for k in keys],
        "reward_weights": list(weights) if weights is not None else None,
    }


def gdpo_metrics(batch: DataProto, algo_cfg) -> dict[str, float]:
    """gdpo/<key>/{mean,std,max,min} of each GDPO reward component (upstream's metric names)."""
    if getattr(algo_cfg.adv_estimator, "value", algo_cfg.adv_estimator) != "gdpo":
        return {}
    out = {}
    for key in algo_cfg.get("gdpo_reward_keys") or []:
        if key in batch.non_tensor_batch:
            values = np.asarray(batch.non_tensor_batch[key], dtype=np.float64)
            out.update({f"gdpo/{key}/{s}": float(getattr(np, s)(values)) for s in ("mean", "std", "max", "min")})
    return out


def compute_advantage(batch: DataProto, algo_cfg, pf_ppo_seed: int) -> DataProto:
    """`advantages` and `returns` [B, R] by `algorithm.adv_estimator`, then, for GAE with
    `algorithm.use_pf_ppo`, the batch redrawn by score weight (a generator seeded with
    `pf_ppo_seed`, so a resumed run draws the same rows). Returns the (possibly redrawn) batch."""
    options = {}
    if getattr(algo_cfg.adv_estimator, "value", algo_cfg.adv_estimator) == "gdpo":
        options = gdpo_inputs(batch, algo_cfg)
    estimate_advantages(
        batch,
        algo_cfg.adv_estimator,
        gamma=algo_cfg.gamma,
        lam=algo_cfg.lam,
        norm_adv_by_std_in_grpo=algo_cfg.norm_adv_by_std_in_grpo,
        **options,
    )
    if algo_cfg.use_pf_ppo and algo_cfg.adv_estimator == "gae":  # upstream applies it to GAE only
        pf = algo_cfg.pf_ppo
        generator = torch.Generator().manual_seed(pf_ppo_seed)
        batch = core_algos.compute_pf_ppo_reweight_data(batch, pf.reweight_method, pf.weight_pow, generator)
    return batch


def old_log_prob_metrics(batch: DataProto, out: DataProto, actor_cfg, runs_ahead: bool) -> dict[str, float]:
    """Metrics of the actor's old-log-prob pass `out` over `batch`: actor/entropy (its `entropys`,
    popped from `out`: the batch does not keep them), the gap to the rollout's own log-probs
    (training/rollout_probs_diff_*), and, when the rollout ran ahead (`runs_ahead`), the importance
    weights pi_old / pi_rollout (off_policy/*, truncated at `actor.tis_imp_ratio_cap`)."""
    metrics = {}
    if "entropys" in out.batch:
        entropys = out.batch.pop("entropys")
        metrics["actor/entropy"] = core_algos.agg_loss(
            entropys,
            batch.batch["response_mask"],
            actor_cfg.loss_agg_mode,
            loss_scale_factor=actor_cfg.loss_scale_factor,
        ).item()
    if "rollout_log_probs" in batch.batch:
        old, rollout, mask = out.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"]
        metrics.update(rollout_mismatch_metrics(batch, old))
        if runs_ahead:
            metrics.update(importance_weight_metrics(old, rollout, mask, actor_cfg.tis_imp_ratio_cap))
    return metrics


def rollout_mismatch_metrics(batch: DataProto, old_log_probs: torch.Tensor) -> dict[str, float]:
    """training/rollout_probs_diff_*: |p_train - p_rollout| over valid response tokens."""
    mask = batch.batch["response_mask"].bool()
    diff = (old_log_probs.exp() - batch.batch["rollout_log_probs"].exp()).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_max": diff.max().item(),
    }


def check_estimator_inputs(config) -> None:
    """An estimator's inputs that only a config switch produces must be switched on."""
    estimator = config.algorithm.adv_estimator
    estimator = getattr(estimator, "value", estimator)
    # an FSDP-actor key: the megatron actor's section has none (as upstream's)
    if estimator in _NEEDS_SUM_PI_SQUARED and not config.actor_rollout_ref.actor.get("calculate_sum_pi_squared", False):
        raise ValueError(
            f"algorithm.adv_estimator={estimator} weighs each token by its score norm, which needs sum_v pi_v^2 "
            "from the actor's log-prob pass; set actor_rollout_ref.actor.calculate_sum_pi_squared=true"
        )
