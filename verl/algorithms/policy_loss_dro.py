"""Direct Reward Optimization's policy loss (`actor.policy_loss.loss_mode=dro`).

Per token: loss = -(A * log pi - beta / 2 * (log pi - log pi_old)^2), with beta
`actor.policy_loss.dro_beta` (> 0). The first term is the plain policy gradient (no ratio, no
clipping); the quadratic term keeps the new policy near the one that produced the batch (its
gradient is -beta * (log pi - log pi_old), zero on the first step of a batch). Registered in
`verl.algorithms.policy_losses.POLICY_LOSSES`, whose shared ending (`finish_policy_loss`) weights
and aggregates it like every other loss.
"""

from __future__ import annotations

from typing import Any

import torch

from verl.algorithms._common import _check_shapes

__all__ = ["compute_policy_loss_dro"]


def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    *,
    params=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO's loss (module docstring); shapes [B, R]. Metrics: `ppo_kl` (mean of log pi_old - log pi);
    nothing is clipped, so `pg_clipfrac` and `pg_clipfrac_lower` are 0."""
    from verl.algorithms.policy_losses import finish_policy_loss, policy_loss_params

    params = policy_loss_params(config, params)
    beta = params.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(
            f"actor.policy_loss.dro_beta={beta}: loss_mode=dro needs a positive dro_beta (the weight of its squared "
            "log-ratio penalty), e.g. actor.policy_loss.dro_beta=0.1"
        )
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    return finish_policy_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=-log_ratio,
    )
