"""Upstream verl's import path for rollout correction; the code lives in `verl.algorithms.rollout_corr`.

Every public name there is re-exported unchanged (the same objects). One name is this module's own:
`apply_rollout_correction`, the bypass-mode entry point of upstream's earlier releases (replaced by
`apply_bypass_mode`), which recipes written then (verl-recipe's rep_exp, specRL) still call.
"""

from __future__ import annotations

from collections.abc import Mapping

from verl.algorithms import rollout_corr as _impl
from verl.algorithms.rollout_corr import *  # noqa: F403  (the whole public surface, by design)
from verl.algorithms.rollout_corr import RolloutCorrectionConfig, apply_bypass_mode

__all__ = [*_impl.__all__, "apply_rollout_correction"]

_RETIRED_KEYS = {
    "rollout_token_veto_threshold": "veto any response with a token ratio below a threshold",
    "rollout_rs_threshold_lower": "a separate lower rejection bound",
}
"""Keys of the earlier `algorithm.rollout_correction` schema with no counterpart now, and what they did."""


def _current_schema(rollout_corr_config) -> RolloutCorrectionConfig:
    """The earlier schema's node in the current one: `use_policy_gradient` becomes `loss_type`
    (`reinforce` for True, else `ppo_clip`); the retired keys must be unset."""
    if rollout_corr_config is None or isinstance(rollout_corr_config, RolloutCorrectionConfig):
        return rollout_corr_config or RolloutCorrectionConfig(bypass_mode=True)
    node = rollout_corr_config
    values = dict(node.items()) if isinstance(node, Mapping) or hasattr(node, "items") else dict(vars(node))
    for key, meaning in _RETIRED_KEYS.items():
        if values.pop(key, None) is not None:
            raise ValueError(
                f"algorithm.rollout_correction.{key} ({meaning}) belongs to an earlier rollout-correction schema and "
                "has no counterpart now; set it to null and express the rejection with rollout_rs options "
                f"(one of {list(_impl.SUPPORTED_ROLLOUT_RS_OPTIONS)}) and rollout_rs_threshold"
            )
    if "use_policy_gradient" in values:
        values.setdefault("loss_type", "reinforce" if values.pop("use_policy_gradient") else "ppo_clip")
    return RolloutCorrectionConfig.from_config(values)


def apply_rollout_correction(batch, rollout_corr_config=None, policy_loss_config=None) -> None:
    """Upstream's earlier bypass mode: `old_log_probs` := `rollout_log_probs` on `batch`, and the
    actor's `policy_loss_config` (an actor's `policy_loss` node, edited in place) gets the
    rollout-correction settings. `use_policy_gradient=true` trained with the policy-gradient loss
    with importance weights (now `loss_type=reinforce`), false kept PPO's clipped loss on
    pi/pi_rollout (now `loss_type=ppo_clip`); both are the `bypass_mode` loss now, which
    `apply_bypass_mode` selects."""
    if "rollout_log_probs" not in batch.batch:
        raise ValueError(
            "bypass_mode=True requires rollout_log_probs in batch. Ensure rollout worker is configured to "
            "calculate_log_probs=true (actor_rollout_ref.rollout.calculate_log_probs=true)."
        )
    apply_bypass_mode(batch, _current_schema(rollout_corr_config), policy_loss_config)
