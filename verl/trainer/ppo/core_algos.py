"""Upstream verl's import path for the algorithm math; the code lives in `verl.algorithms`.

The advantage estimators, policy and value losses, KL and loss aggregation moved below the
workers (see `verl/algorithms/__init__.py` and docs/architecture.md) so an actor can import its
loss without importing the trainer. This module re-exports every public name it had, as the very
same objects: `ADV_ESTIMATORS` / `ADV_ESTIMATOR_REGISTRY` and `POLICY_LOSSES` /
`POLICY_LOSS_REGISTRY` are the tables in `verl.algorithms`, so `register_adv_est` and
`register_policy_loss` called through this path register where the workers and the trainer look.

Upstream keeps those tables as globals of this module, and code written for it (its own tests
among them) replaces one by assignment: `core_algos.ADV_ESTIMATOR_REGISTRY = {...}`. The four
table names are therefore properties of this module that read, and on assignment rebind, the
table in `verl.algorithms.advantages` / `policy_losses`; the look-ups there read their module's
table at call time, so the replacement is what `register_*` and `get_*` use from then on.
New code inside `verl/` imports from `verl.algorithms.*` directly.
"""

import sys
import types

from verl.algorithms import advantages, policy_losses
from verl.algorithms.advantages import (
    PF_PPO_REWEIGHT_METHODS,
    AdvantageEstimator,
    compute_advantage_from_tensors,
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_opo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_pf_ppo_reweight_data,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
    pf_ppo_weights,
    register_adv_est,
)
from verl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from verl.algorithms.dapo import compute_overlong_penalty, filter_groups_by_metric_variance
from verl.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_tensors,
    compute_kl_loss,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from verl.algorithms.policy_losses import (
    LOSS_AGG_MODE_OVERRIDES,
    SAPO_LOSS_AGG_MODE,
    PolicyLossFn,
    PolicyLossParams,
    compute_policy_loss,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
    finish_policy_loss,
    get_policy_loss_fn,
    register_policy_loss,
)
from verl.algorithms.rollout_corr import RolloutCorrectionConfig, rollout_correction_tensors
from verl.algorithms.value_losses import compute_entropy_loss, compute_value_loss, explained_variance
from verl.utils.torch_functional import (
    entropy_from_logits,
    entropy_from_logits_with_chunking,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

# The four table names are properties of this module's class (`_CoreAlgosModule`, at the end).
__all__ = [
    "ADV_ESTIMATORS",  # noqa: F822
    "ADV_ESTIMATOR_REGISTRY",  # noqa: F822
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LOSS_AGG_MODE_OVERRIDES",
    "PF_PPO_REWEIGHT_METHODS",
    "POLICY_LOSSES",  # noqa: F822
    "POLICY_LOSS_REGISTRY",  # noqa: F822
    "SAPO_LOSS_AGG_MODE",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "PolicyLossFn",
    "PolicyLossParams",
    "RolloutCorrectionConfig",
    "agg_loss",
    "apply_kl_penalty_tensors",
    "compute_advantage_from_tensors",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_kl_loss",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_overlong_penalty",
    "compute_pf_ppo_reweight_data",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "explained_variance",
    "filter_groups_by_metric_variance",
    "finish_policy_loss",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "kl_penalty_forward",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pf_ppo_weights",
    "register_adv_est",
    "register_policy_loss",
    "rollout_correction_tensors",
]


def _table_property(module: types.ModuleType, name: str, alias: str) -> property:
    """`module.<name>`; assigning rebinds both `module.<name>` and its upstream alias `module.<alias>`."""

    def read(_self):
        return getattr(module, name)

    def replace(_self, table):
        setattr(module, name, table)
        setattr(module, alias, table)

    return property(read, replace, doc=f"`{module.__name__}.{name}` (the same dict as `{alias}`).")


class _CoreAlgosModule(types.ModuleType):
    ADV_ESTIMATORS = ADV_ESTIMATOR_REGISTRY = _table_property(advantages, "ADV_ESTIMATORS", "ADV_ESTIMATOR_REGISTRY")
    POLICY_LOSSES = POLICY_LOSS_REGISTRY = _table_property(policy_losses, "POLICY_LOSSES", "POLICY_LOSS_REGISTRY")


sys.modules[__name__].__class__ = _CoreAlgosModule
