"""Policy losses (`actor.policy_loss.loss_mode`), their parameters and the loss table.

Design decisions:

- Every loss shares one signature, upstream's: `(old_log_prob, log_prob, advantages, response_mask,
  loss_agg_mode, config, rollout_is_weights)` where `config` is the actor's config (or a
  `PolicyLossParams`), plus this build's `rollout_log_probs` and keyword-only `params`. The actor
  calls a user's registered loss written to upstream's signature the way upstream's actor does.
- Every loss shares one ending, `finish_policy_loss`:
  weight the per-token loss by the rollout-correction / truncated-IS weights, aggregate it with
  `agg_loss`, and report `pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl` as masked means. A loss
  therefore only writes its own formula and says which tokens it clipped.
- `PolicyLossParams` is a frozen dataclass of plain numbers, not a config node: the actor reads
  its config and hands the numbers in, so the math never sees a config object.
- `POLICY_LOSSES` is the one table of options; `register_policy_loss` adds to that same dict, so
  registration through `verl.trainer.ppo.core_algos` reaches it as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verl.algorithms._common import _check_shapes, _unknown_name_error
from verl.algorithms.aggregation import agg_loss
from verl.algorithms.dppo_losses import compute_policy_loss_dppo_kl, compute_policy_loss_dppo_tv
from verl.algorithms.policy_loss_base import (  # noqa: F401  (re-exported: upstream-era import path)
    _DEFAULT_PARAMS,
    PolicyLossParams,
    _apply_tis,
    _log_ratio,
    _zero,
    finish_policy_loss,
    policy_loss_metrics,
    policy_loss_params,
)
from verl.algorithms.rollout_corr import RolloutCorrectionConfig, rollout_correction_tensors
from verl.utils.torch_functional import masked_mean


def compute_policy_loss_vanilla(
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
    r"""PPO's clipped surrogate (Schulman et al., arXiv:1707.06347) with clip-higher and dual clip; `vanilla`.

    $\rho = \exp(\log\pi - \log\pi_{old})$ (log-ratio clamped to ±20),
    $\ell = \max(-A\rho,\ -A\,\mathrm{clip}(\rho, 1-\epsilon_{low}, 1+\epsilon_{high}))$; for
    $A<0$ additionally $\ell = \min(\ell, -cA)$ (dual clip, arXiv:1912.09729). DAPO's clip-higher
    (arXiv:2503.14476) is $\epsilon_{high} > \epsilon_{low}$. Optional truncated importance
    sampling multiplies $\ell$ by $\min(\pi_{old}/\pi_{rollout}, C)$. Aggregated by `agg_loss`.

    Shapes: old_log_prob, log_prob, advantages, response_mask (and rollout_log_probs) [B, R].
    Returns (scalar loss, metrics) with `pg_clipfrac` (fraction of tokens where clipping chose
    the clipped term), `pg_clipfrac_lower` (fraction where the dual clip applied) and `ppo_kl`
    (mean of $\log\pi_{old} - \log\pi$).
    """
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * params.clip_ratio_c
    pg_losses = torch.where(advantages < 0, torch.minimum(clip_loss, dual_cap), clip_loss)
    return finish_policy_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=-log_ratio,
        clipped=clipped > unclipped,
        clipped_lower=(clip_loss > dual_cap) & (advantages < 0),
    )


def compute_policy_loss_dro(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
    rollout_is_weights=None, rollout_log_probs=None, *, params: PolicyLossParams | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    r"""Direct Reward Optimization, `dro`: $\ell = -(A\log\pi - \frac{\beta}{2}(\log\pi - \log\pi_{old})^2)$,
    $\beta$ = `policy_loss.dro_beta` > 0: the plain policy gradient (no ratio, nothing clipped) plus a quadratic
    pull towards the policy that produced the batch. Shapes [B, R]; `ppo_kl` as the other losses'."""
    params = policy_loss_params(config, params)
    if params.dro_beta is None or not params.dro_beta > 0:
        raise ValueError(f"actor.policy_loss.dro_beta={params.dro_beta}: loss_mode=dro needs it > 0, e.g. 0.1")
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * params.dro_beta * log_ratio.square())
    return finish_policy_loss(
        pg_losses, response_mask, loss_agg_mode, params, old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs, rollout_is_weights=rollout_is_weights, kl_per_token=-log_ratio,
    )  # fmt: skip


def compute_policy_loss_gspo(
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
    r"""Group Sequence Policy Optimization (Zheng et al., arXiv:2507.18071); `gspo`.

    Sequence-level ratio $s_i = \exp(\frac{1}{|y_i|}\sum_t (\log\pi_{i,t} - \log\pi^{old}_{i,t}))$,
    applied to every token as $s_{i,t} = \mathrm{sg}[s_i]\,\pi_{i,t}/\mathrm{sg}[\pi_{i,t}]$ (same
    value as $s_i$; each token's gradient is $s_i\nabla\log\pi_{i,t}$), log clamped at 10:
    $\ell_{i,t} = \max(-A_{i,t}s_{i,t},\ -A_{i,t}\,\mathrm{clip}(s_{i,t}, 1-\epsilon_{low}, 1+\epsilon_{high}))$.
    GSPO uses small ranges (the paper: 3e-4 / 4e-4) and the paper's aggregation is
    `seq-mean-token-mean`; the `loss_agg_mode` passed is honoured. Metrics as `vanilla`
    (`pg_clipfrac_lower` is 0: no dual clip).
    """
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)
    return finish_policy_loss(
        torch.maximum(unclipped, clipped),
        response_mask,
        loss_agg_mode,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=-log_ratio,
        clipped=clipped > unclipped,
    )


def compute_policy_loss_gpg(
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
    r"""Group Policy Gradient's plain REINFORCE loss (Chu et al., arXiv:2504.02546); `gpg`.

    $\ell_{i,t} = -A_{i,t}\log\pi_{i,t}$: no ratio, no clipping (pair with the `gpg` advantage
    estimator). `pg_clipfrac`/`pg_clipfrac_lower` are 0; `ppo_kl` is still reported.
    """
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    return finish_policy_loss(
        -advantages * log_prob,
        response_mask,
        loss_agg_mode,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=old_log_prob - log_prob,
    )


def _rank_descending(keys: torch.Tensor) -> torch.Tensor:
    """Rank of every element of `keys` (0 = largest), same shape; ties keep flat order."""
    flat = keys.reshape(-1)
    order = torch.argsort(flat, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(flat.numel(), device=flat.device)
    return rank.reshape(keys.shape)


def _token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-token covariance term (A - mean A)(log pi - mean log pi) over the valid tokens of the batch."""
    adv = advantages.detach()
    logp = log_prob.detach()
    return (adv - masked_mean(adv, valid)) * (logp - masked_mean(logp, valid))


def compute_policy_loss_clip_cov(
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
    r"""Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617); `clip_cov`.

    Token covariance $c_{i,t} = (A_{i,t} - \bar A)(\log\pi_{i,t} - \overline{\log\pi})$ over the
    batch's valid tokens. Among valid tokens that PPO's clip did not already clip and with
    $c \in (lb, ub)$, $k = \max(1, \lfloor r\cdot N_{valid}\rfloor)$ are picked uniformly at random
    (all of them if fewer) and their loss is zeroed (gradient cut), which holds back the entropy
    collapse that high-covariance tokens drive. Other tokens:
    $\ell = \max(-A\rho, -A\,\mathrm{clip}(\rho, 1-\epsilon_{low}, 1+\epsilon_{high}))$ (no dual clip).
    `pg_clipfrac` is the fraction of valid tokens cut; `pg_clipfrac_lower` is 0. Config:
    `policy_loss.clip_cov_ratio` ($r$), `clip_cov_lb`, `clip_cov_ub`. Uses torch's global RNG.
    """
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    valid = response_mask != 0
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)
    cov = _token_covariance(advantages, log_prob, valid)
    candidate = valid & ~(clipped > unclipped) & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
    num_valid = valid.sum().to(torch.float64)
    num_cut = torch.clamp(torch.floor(num_valid * params.clip_cov_ratio), min=1)
    random_keys = torch.where(candidate, torch.rand(candidate.shape, device=candidate.device), -1.0)
    cut = candidate & (_rank_descending(random_keys) < num_cut)
    return finish_policy_loss(
        torch.where(cut, 0.0, torch.maximum(unclipped, clipped)),
        response_mask,
        loss_agg_mode,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=-log_ratio,
        clipped=cut,
    )


def compute_policy_loss_kl_cov(
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
    r"""KL-Cov (Cui et al., arXiv:2505.22617); `kl_cov`.

    Unclipped surrogate $\ell = -A\rho$, plus a KL term $\beta\,|\log\rho|$ on the
    $k = \max(1, \lfloor r\cdot N_{valid}\rfloor)$ valid tokens with the largest covariance
    $(A - \bar A)(\log\pi - \overline{\log\pi})$. Config: `policy_loss.kl_cov_ratio` ($r$),
    `policy_loss.ppo_kl_coef` ($\beta$). Metrics: `ppo_kl` is the mean $|\log\rho|$ (as upstream),
    `pg_clipfrac` the fraction of valid tokens that got the KL term, `pg_clipfrac_lower` 0.
    """
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    valid = response_mask != 0
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    cov = _token_covariance(advantages, log_prob, valid)
    num_valid = valid.sum().to(torch.float64)
    num_pen = torch.clamp(torch.floor(num_valid * params.kl_cov_ratio), min=1)
    penalised = valid & (_rank_descending(torch.where(valid, cov, -torch.inf)) < num_pen)
    pg_losses = -advantages * ratio + torch.where(penalised, params.ppo_kl_coef * log_ratio.abs(), 0.0)
    return finish_policy_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=log_ratio.abs(),
        clipped=penalised,
    )


def compute_policy_loss_geo_mean(
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
    r"""Geometric-Mean Policy Optimization (Zhao et al., arXiv:2507.20673); `geo_mean`.

    Token log-ratios $x_t = \log\pi_t - \log\pi^{old}_t$ are clipped in log space on the side the
    advantage pushes: $\tilde x_t = \mathrm{sgn}(A)\min(\mathrm{sgn}(A)x_t,\ \mathrm{sgn}(A)\,
    \mathrm{clip}(x_t, -\epsilon_{low}, \epsilon_{high}))$; the sequence ratio is their geometric
    mean $\rho_i = \exp(\frac{1}{|y_i|}\sum_t\tilde x_t)$ and
    $\mathcal{L} = \frac{1}{|S|}\sum_{i\in S} -\bar A_i\,\rho_i$ with $\bar A_i$ the mean advantage of
    response $i$ over the non-empty responses $S$. GMPO is sequence-level by construction, so
    `loss_agg_mode` is not used. Metrics: `pg_clipfrac` / `pg_clipfrac_lower` = fraction of tokens
    whose log-ratio was clipped with $A>0$ / $A<0$. Truncated importance sampling is not defined
    for it and raises; rollout-correction weights (`rollout_is_weights`) scale each response's term
    by the geometric mean of its token weights (as upstream).
    """
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if rollout_log_probs is not None and params.tis_enabled:
        raise ValueError(
            f"actor.policy_loss.loss_mode=geo_mean has a sequence-level ratio and does not support truncated "
            f"importance sampling (actor.tis_imp_ratio_cap={params.tis_imp_ratio_cap}); set tis_imp_ratio_cap "
            "to -1 or use loss_mode=vanilla"
        )
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -params.low, params.high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    seq_ratio = torch.exp(masked_mean(log_ratio_min, response_mask, axis=-1))
    seq_adv = masked_mean(advantages, response_mask, axis=-1)
    non_empty = (response_mask != 0).any(dim=-1)
    seq_losses = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        # token weights -> one per response, by their geometric mean (the ratio's own aggregation)
        seq_losses = seq_losses * torch.exp(
            masked_mean(torch.log(rollout_is_weights.detach() + 1e-10), response_mask, axis=-1)
        )
    pg_loss = masked_mean(seq_losses, non_empty)
    was_clipped = log_ratio != log_ratio_clamped
    return pg_loss, policy_loss_metrics(
        response_mask, -log_ratio, clipped=was_clipped & (advantages > 0), clipped_lower=was_clipped & (advantages < 0)
    )


def compute_policy_loss_cispo(
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
    r"""Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585); `cispo`.

    $\ell_t = -\mathrm{sg}[\mathrm{clip}(\rho_t, 1-\epsilon_{low}, 1+\epsilon_{high})]\,A_t\log\pi_t$
    with $\rho_t = \exp(\log\pi_t - \log\pi^{old}_t)$ (log clamped to ±20). Unlike PPO, which drops
    the gradient of a token whose ratio left the clip range, CISPO clips only the weight: every token
    keeps its REINFORCE gradient $-\mathrm{clip}(\rho_t)A_t\nabla\log\pi_t$. The ranges are the
    actor's `clip_ratio_low` / `clip_ratio_high` (the paper bounds only the upper side: a large
    `clip_ratio_low`, e.g. 1.0, leaves the lower side open). Metrics: `pg_clipfrac` = fraction of
    tokens whose ratio was clipped; `pg_clipfrac_lower` 0; `ppo_kl` as `vanilla`.
    """
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - params.low, 1 + params.high)
    return finish_policy_loss(
        -clipped_ratio.detach() * advantages * log_prob,
        response_mask,
        loss_agg_mode,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=-log_ratio,
        clipped=ratio != clipped_ratio,
    )


SAPO_LOSS_AGG_MODE = "seq-mean-token-mean"


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = SAPO_LOSS_AGG_MODE,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    *,
    params: PolicyLossParams | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Soft Adaptive Policy Optimization (Gao et al., arXiv:2511.20347); `sapo`.

    A smooth gate replaces PPO's hard clip: $\ell_t = -f(\rho_t, \tau_t)\,A_t$ with
    $f(\rho, \tau) = \frac{4}{\tau}\sigma(\tau(\rho - 1))$, $\tau_t$ = `tau_pos` for $A_t > 0$ and
    `tau_neg` otherwise. At $\rho = 1$ the gate's slope is 1 (PPO's gradient); it fades as the ratio
    moves away, faster for larger $\tau$ (so `tau_neg > tau_pos` damps negative updates sooner).
    Always aggregated `seq-mean-token-mean`, whatever `loss_agg_mode` says (as upstream; the actor
    warns when the configured mode differs). Metrics: `pg_clipfrac`, `pg_clipfrac_lower` 0;
    `ppo_kl` as `vanilla`.
    """
    del loss_agg_mode  # fixed by the method (see the docstring)
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    # built in the ratio's dtype: torch.where of two Python floats would round them to float32
    tau = torch.full_like(ratio, params.tau_neg).masked_fill(advantages > 0, params.tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return finish_policy_loss(
        -gate * advantages,
        response_mask,
        SAPO_LOSS_AGG_MODE,
        params,
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        rollout_is_weights=rollout_is_weights,
        kl_per_token=-log_ratio,
    )


def compute_policy_loss_bypass_mode(
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
    r"""Rollout correction's bypass mode (`algorithm.rollout_correction.bypass_mode=true`); `bypass_mode`.

    The trainer skipped the old-log-prob pass: `old_log_prob` *is* the rollout's, $\mu$. Per call,
    from the current $\pi$ (no gradient): importance weights and rejection as configured in
    `params.rollout_correction` (see `verl.algorithms.rollout_corr`); rejected tokens' terms
    are dropped (weight 0, still counted by the aggregation), then by `loss_type`:

    - `ppo_clip`: `vanilla`'s clipped surrogate on $\rho = \pi/\mu$ (the ratio already is the
      importance weight, so the weights are only reported);
    - `reinforce`: $\ell_t = -\mathrm{sg}(w_t)A_t\log\pi_t$ ($w$ = 1 without `rollout_is`).

    Metrics: the chosen loss's, plus `rollout_corr/*` (weights, rejection, off-policy gap of the
    current policy). `rollout_is_weights` from the batch are not used (they would weight twice).
    """
    params = policy_loss_params(config, params)
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    rc = params.rollout_correction or RolloutCorrectionConfig(bypass_mode=True)
    with torch.no_grad():
        weights, kept, corr_metrics = rollout_correction_tensors(log_prob, old_log_prob, response_mask, rc)
    # Rejected tokens get weight 0 but stay in the aggregation's denominator, so rejection drops
    # their terms without rescaling the others (the loss of a mini-batch does not depend on how it
    # is cut into micro-batches, as in the decoupled mode's rejection before the update).
    keep = (kept != 0).to(log_prob.dtype)
    if rc.loss_type == "reinforce":
        token_weights = keep if weights is None else keep * weights
        pg_losses = -advantages * log_prob * token_weights.detach()
        pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **params.agg_kwargs())
        # ppo_kl over the kept tokens only: rejected ones are the far-off-policy outliers
        metrics = policy_loss_metrics(kept, old_log_prob - log_prob)
    else:
        pg_loss, metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params, rollout_is_weights=keep
        )
    metrics.update(corr_metrics)
    return pg_loss, metrics


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""The type of a policy loss (upstream's name); the signature is spelled out under `POLICY_LOSSES`."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "cispo": compute_policy_loss_cispo,
    "sapo": compute_policy_loss_sapo,
    "bypass_mode": compute_policy_loss_bypass_mode,
    "dro": compute_policy_loss_dro,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
}
"""`actor.policy_loss.loss_mode` name -> loss. Every loss has the signature
`fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", params=None,
rollout_log_probs=None, rollout_is_weights=None) -> (scalar loss, {"pg_clipfrac",
"pg_clipfrac_lower", "ppo_kl", ...})`. Metric names without a `/` are the actor's (`actor/<name>`);
names with one (`rollout_corr/...`) are logged as they are.

`rollout_is_weights` [B, R] are rollout correction's importance weights (decoupled mode): each
token's loss is multiplied by them before aggregation. A user's loss registered without that
parameter works as long as rollout correction's weights are off."""

POLICY_LOSS_REGISTRY = POLICY_LOSSES  # upstream's name for the same table

LOSS_AGG_MODE_OVERRIDES = {"sapo": SAPO_LOSS_AGG_MODE, "geo_mean": "seq-mean-token-mean"}
"""Losses that aggregate their own way whatever `loss_agg_mode` says: the actor weighs their
micro-batches by this mode's normaliser (geo_mean averages over responses, like `seq-mean-*`)."""


def register_policy_loss(name: str) -> Callable:
    """Decorator adding a user's policy loss (same signature as `POLICY_LOSSES` entries) under `name`."""

    def decorator(fn):
        if POLICY_LOSSES.get(name, fn) is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to {POLICY_LOSSES[name]}")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The policy loss for an `actor.policy_loss.loss_mode` name (upstream's docs spell some with a
    hyphen, e.g. `clip-cov`; both spellings select the same loss)."""
    if name not in POLICY_LOSSES and name.replace("-", "_") in POLICY_LOSSES:
        name = name.replace("-", "_")
    if name not in POLICY_LOSSES:
        raise _unknown_name_error("actor.policy_loss.loss_mode", name, POLICY_LOSSES)
    return POLICY_LOSSES[name]


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upstream's older entry point, kept for users' code: the `vanilla` loss with explicit
    clip ranges, returning (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)."""
    params = PolicyLossParams(
        clip_ratio=0.2 if cliprange is None else cliprange,
        clip_ratio_low=cliprange_low,
        clip_ratio_high=cliprange_high,
        clip_ratio_c=clip_ratio_c,
    )
    loss, m = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params)
    return loss, m["pg_clipfrac"], m["ppo_kl"], m["pg_clipfrac_lower"]
