r"""DPPO's binary trust-region losses (arXiv:2602.04879), `dppo_tv` and `dppo_kl`.

Instead of clipping the probability ratio, DPPO keeps or drops each token by a divergence between the
old and the current policy restricted to that token's two outcomes (the sampled token, or not):

- `dppo_tv`: the total variation $|\pi_t - \pi^{old}_t|$. A token with $A_t > 0$ is kept while
  $\pi_t - \pi^{old}_t \le \delta_{high}$, one with $A_t \le 0$ while $\pi_t - \pi^{old}_t \ge -\delta_{low}$.
- `dppo_kl`: the binary KL $p\log\frac{p}{q} + (1-p)\log\frac{1-p}{1-q}$ with $p = \pi^{old}_t$,
  $q = \pi_t$. A token with $A_t > 0$ is kept while that KL is at most $\delta_{high}$ or its probability
  did not rise; one with $A_t \le 0$ while the KL is at most $\delta_{low}$ or its probability did not fall.

The thresholds $\delta$ are the actor's `clip_ratio_low` / `clip_ratio_high` (`clip_ratio` when unset),
read as divergences, not ratio ranges. A kept token's loss is the truncated-IS REINFORCE term
$-A_t\,\mathrm{sg}[\min(\rho_t, c)]\log\pi_t$ with $\rho_t = \exp(\log\pi_t - \log\pi^{old}_t)$ (log clamped
to ±20) and $c$ = `clip_ratio_c`; a dropped token contributes nothing. Metrics: `pg_clipfrac` is the
fraction of dropped tokens, `pg_clipfrac_lower` the fraction of kept tokens whose ratio exceeded $c$,
`ppo_kl` the mean of $\log\pi^{old} - \log\pi$. The ending (weights, aggregation) is `finish_policy_loss`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from verl.algorithms._common import _check_shapes
from verl.algorithms.policy_loss_base import PolicyLossParams, _log_ratio, finish_policy_loss, policy_loss_params

_BINARY_KL_EPS = 1e-8


def _dppo_loss(
    kept_fn,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
    rollout_log_probs: torch.Tensor | None,
    params: PolicyLossParams | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=params.clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    kept = kept_fn(prob.detach(), old_prob.detach(), old_log_prob.detach(), log_prob.detach(), params)
    kept = torch.where(advantages > 0, kept[0], kept[1])
    return finish_policy_loss(
        -advantages * weight * log_prob * kept.to(log_prob.dtype),
        response_mask,
        loss_agg_mode,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=-log_ratio,
        clipped=~kept,
        clipped_lower=kept & (ratio > params.clip_ratio_c),
    )


def _kept_by_tv(prob, old_prob, old_log_prob, log_prob, params):
    change = prob - old_prob
    return change <= params.high, change >= -params.low


def _kept_by_binary_kl(prob, old_prob, old_log_prob, log_prob, params):
    eps = _BINARY_KL_EPS
    kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log((1 - old_prob + eps) / (1 - prob + eps))
    return (kl <= params.high) | (prob <= old_prob), (kl <= params.low) | (prob >= old_prob)


def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    *,
    params: PolicyLossParams | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (`dppo_tv`; module docstring). Shapes [B, R]; returns (scalar loss, metrics)."""
    return _dppo_loss(
        _kept_by_tv,
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        rollout_log_probs,
        params,
    )


def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    *,
    params: PolicyLossParams | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (`dppo_kl`; module docstring). Shapes [B, R]; returns (scalar loss, metrics)."""
    return _dppo_loss(
        _kept_by_binary_kl,
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        rollout_log_probs,
        params,
    )
