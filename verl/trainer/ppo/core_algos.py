"""The math of PPO-family RL post-training: advantage estimators, policy and value losses, KL
penalties and controllers, loss aggregation, DAPO's reward shaping and group filtering.

Design decisions:

- Pure functions of tensors and plain numbers. No config objects, no torch.distributed, no
  `.item()`: the trainer and the actor read their config and pass numbers in (`PolicyLossParams`
  is a frozen dataclass of floats, not a config node). Everything runs on CPU and GPU unchanged,
  and every function is tested on CPU against a float64 reference computed another way.
- Variants are chosen by upstream verl's config names through two explicit tables,
  `ADV_ESTIMATORS` (`algorithm.adv_estimator`) and `POLICY_LOSSES`
  (`actor.policy_loss.loss_mode`); an unknown name raises an error listing the valid ones.
  `register_adv_est` / `register_policy_loss` let users add their own entries.
- Edge cases are defined, never NaN: a group of one response, a group whose rewards are all equal,
  a response that is all padding and a batch with no valid token all give finite results; each
  estimator's docstring says which.
- Grouped estimators (GRPO and friends) group by the `uid` strings of `non_tensor_batch["uid"]`;
  the grouping itself is a small host-side dictionary pass over the uids, the arithmetic is
  vectorised (`index_add_` per group), so there is no Python loop over samples on the device.
- Public names and signatures follow upstream (`compute_gae_advantage_return`,
  `compute_grpo_outcome_advantage`, `get_adv_estimator_fn`, `get_policy_loss_fn`, `agg_loss`,
  `kl_penalty`, `compute_value_loss`, `compute_entropy_loss`, ...) so code that imports them keeps
  working. Deliberate differences from upstream are noted where they occur: losses return a
  metrics dict; `seq-mean-token-sum-norm` divides by the number of sequences as well (Dr. GRPO's
  1/G); fully padded responses are left out of the `seq-mean-*` means; `grpo_passk` gives a
  one-response group zero advantage instead of raising.

Formulas and papers for every option: docs/algorithms.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch

from verl.trainer.ppo.rollout_corr_helper import RolloutCorrectionConfig, rollout_correction_tensors
from verl.utils.torch_functional import (
    entropy_from_logits,
    entropy_from_logits_with_chunking,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATOR_REGISTRY",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LOSS_AGG_MODE_OVERRIDES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "PolicyLossParams",
    "agg_loss",
    "apply_kl_penalty_tensors",
    "compute_advantage_from_tensors",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
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
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "explained_variance",
    "filter_groups_by_metric_variance",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]

# Log-ratios are clamped before exp() so one far-off-policy token cannot overflow the loss.
_LOG_RATIO_CLAMP = 20.0


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"these tensors must have the same [batch, response_length] shape, got {shapes}")


def _unknown_name_error(kind: str, name: Any, valid: Iterable[str]) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}; valid names are: {', '.join(sorted(valid))}")


# ==============================================================================================
# Loss aggregation
# ==============================================================================================

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, loss_scale_factor: float | None = None
) -> torch.Tensor:
    r"""Reduce a per-token loss [B, R] to a scalar (`actor.loss_agg_mode`).

    With mask $m$, $n_i = \sum_t m_{i,t}$ tokens in response $i$ and $S$ the responses with
    $n_i > 0$:

    - `token-mean`: $\sum_{i,t} m_{i,t}\ell_{i,t} / \sum_{i,t} m_{i,t}$ — every token weighs the
      same (DAPO, arXiv:2503.14476).
    - `seq-mean-token-sum`: $\frac{1}{|S|}\sum_{i\in S}\sum_t m_{i,t}\ell_{i,t}$.
    - `seq-mean-token-mean`: $\frac{1}{|S|}\sum_{i\in S}\frac{1}{n_i}\sum_t m_{i,t}\ell_{i,t}$ —
      every response weighs the same (original GRPO, arXiv:2402.03300).
    - `seq-mean-token-sum-norm`: $\frac{1}{B\,L}\sum_{i,t} m_{i,t}\ell_{i,t}$ with the constant
      $L$ = `loss_scale_factor` or the padded length R — no length bias (Dr. GRPO,
      arXiv:2503.20783). Upstream verl omits the $1/B$; we keep it so the value does not grow
      with the micro-batch size.

    Fully padded responses are left out of the `seq-mean-*` means; an empty mask gives 0.
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return masked_sum(loss_mat, loss_mask) / (max(loss_mat.shape[0], 1) * norm)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = masked_mean(loss_mat, loss_mask, axis=-1)
        non_empty = (loss_mask != 0).any(dim=-1)
        return masked_mean(seq_losses, non_empty)
    raise _unknown_name_error("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)


# ==============================================================================================
# Advantage estimators (algorithm.adv_estimator)
# ==============================================================================================


class AdvantageEstimator(str, Enum):
    """The `algorithm.adv_estimator` names (upstream's values)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    GRPO_VECTORIZED = "grpo_vectorized"
    RLOO_VECTORIZED = "rloo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"


def _group_ids(index: Any, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map each sample's uid to a dense group id 0..G-1 (first-seen order)."""
    if len(index) != batch_size:
        raise ValueError(
            f"index (the per-sample uids) has {len(index)} entries but the batch has {batch_size} responses; "
            "pass non_tensor_batch['uid'] of the same batch"
        )
    if isinstance(index, torch.Tensor):
        # 0-d tensors hash by identity, so equal uids would land in different groups
        index = index.tolist()
    ids: dict[Any, int] = {}
    dense = [ids.setdefault(uid, len(ids)) for uid in index]
    return torch.as_tensor(dense, dtype=torch.long, device=device), len(ids)


def _group_mean_std(scores: torch.Tensor, gid: torch.Tensor, num_groups: int):
    """Per-sample (group size, group mean, unbiased group std); std is 0 for groups of one."""
    zeros = scores.new_zeros(num_groups)
    count = zeros.index_add(0, gid, torch.ones_like(scores))
    mean = zeros.index_add(0, gid, scores) / count
    sq_dev = zeros.index_add(0, gid, (scores - mean[gid]) ** 2)
    std = torch.where(count > 1, sq_dev / torch.clamp(count - 1, min=1), 0.0).sqrt()
    return count[gid], mean[gid], std[gid]


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    _check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
    return token_level_rewards.sum(dim=-1)


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_sample.unsqueeze(-1) * response_mask.to(per_sample.dtype)


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Generalised Advantage Estimation (Schulman et al., arXiv:1506.02438); `gae`.

    Over the valid tokens of each response (masked positions, e.g. tool output in a multi-turn
    response, are skipped: the recursion links each valid token to the next valid one):

    $\delta_t = r_t + \gamma V_{t+1} - V_t$ (with $V$ = 0 after the last valid token),
    $A_t = \delta_t + \gamma\lambda A_{t+1}$, returns $G_t = A_t + V_t$; then the advantages are
    whitened over all valid tokens of the batch (`masked_whiten`).

    Shapes: token_level_rewards, values, response_mask [B, R] -> (advantages, returns) [B, R],
    both 0 at masked positions. Config: `algorithm.gamma`, `algorithm.lam`.
    """
    _check_shapes(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        valid = mask[:, t] != 0
        next_value = torch.where(valid, values[:, t], next_value)
        last_gae = torch.where(valid, gae_t, last_gae)
        advantages[:, t] = last_gae
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask), returns


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""GRPO's group-relative outcome advantage (Shao et al., arXiv:2402.03300); `grpo`.

    Score $s_i = \sum_t r_{i,t}$; within the group of responses to the same prompt (same uid):
    $A_i = (s_i - \mathrm{mean}_g(s)) / (\mathrm{std}_g(s) + \epsilon)$ (unbiased std), or
    $A_i = s_i - \mathrm{mean}_g(s)$ with `norm_adv_by_std_in_grpo=False` (Dr. GRPO,
    arXiv:2503.20783). $A_i$ is broadcast to every valid token of response $i$.

    Edge cases: a group of one response has mean 0 and std 1 (as upstream), so its advantage is
    $s_i/(1+\epsilon)$; a group with identical scores gets advantage 0.

    Shapes: token_level_rewards, response_mask [B, R]; index [B] uids -> (advantages, returns)
    [B, R], equal. Config: `algorithm.norm_adv_by_std_in_grpo`.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    gid, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count, mean, std = _group_mean_std(scores, gid, num_groups)
    single = count == 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    adv = _broadcast(adv, response_mask)
    return adv, adv


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Pass@k advantage in GRPO form (Tang et al., arXiv:2503.19595); `grpo_passk`.

    Only the best response of each group learns: $A_{i^*} = s_{(1)} - s_{(2)}$ (best minus
    second-best score, divided by $\mathrm{std}_g(s) + \epsilon$ when `norm_adv_by_std_in_grpo`);
    every other response gets 0. Ties for the best go to the first in batch order (and give 0).

    Edge cases: a group of one response gets 0 (there is no runner-up; upstream raises instead);
    identical scores give 0.

    Shapes: as `compute_grpo_outcome_advantage`.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    batch = scores.shape[0]
    gid, num_groups = _group_ids(index, batch, scores.device)
    count, _, std = _group_mean_std(scores, gid, num_groups)
    neg_inf = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    best = neg_inf.scatter_reduce(0, gid, scores, reduce="amax")
    position = torch.arange(batch, device=scores.device)
    is_best = scores == best[gid]
    first_best = torch.full((num_groups,), batch, device=scores.device).scatter_reduce(
        0, gid, torch.where(is_best, position, batch), reduce="amin"
    )
    winner = position == first_best[gid]
    second = neg_inf.scatter_reduce(0, gid, torch.where(winner, -torch.inf, scores), reduce="amax")
    gap = torch.where(count > 1, scores - second[gid], 0.0)
    if norm_adv_by_std_in_grpo:
        gap = gap / (std + epsilon)
    adv = _broadcast(torch.where(winner, gap, 0.0), response_mask)
    return adv, adv


@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""REINFORCE leave-one-out (Ahmadian et al., arXiv:2402.14740); `rloo`.

    $A_i = s_i - \frac{1}{n-1}\sum_{j\ne i} s_j = \frac{n}{n-1}(s_i - \mathrm{mean}_g(s))$ for a
    group of $n$ responses. Edge case: a group of one keeps its raw score (as upstream).
    `epsilon` is accepted for signature compatibility and unused (there is no division by a
    data-dependent quantity).

    Shapes: as `compute_grpo_outcome_advantage`.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    gid, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count, mean, _ = _group_mean_std(scores, gid, num_groups)
    loo = (scores - mean) * count / torch.clamp(count - 1, min=1)
    adv = _broadcast(torch.where(count > 1, loo, scores), response_mask)
    return adv, adv


@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""On-policy RL with the optimal reward baseline (Hao et al., arXiv:2505.23585); `opo`.

    $A_i = s_i - b_g$ with the length-weighted baseline $b_g = \sum_j |y_j| s_j / \sum_j |y_j|$
    ($|y_j|$ = valid tokens of response $j$). Edge cases: a group of one has baseline 0 (as
    upstream); a group whose responses are all empty has baseline 0. `epsilon` is unused
    (signature compatibility).

    Shapes: as `compute_grpo_outcome_advantage`.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    gid, num_groups = _group_ids(index, scores.shape[0], scores.device)
    zeros = scores.new_zeros(num_groups)
    count = zeros.index_add(0, gid, torch.ones_like(scores))[gid]
    weighted = zeros.index_add(0, gid, lengths * scores)[gid]
    total_len = zeros.index_add(0, gid, lengths)[gid]
    has_baseline = (count > 1) & (total_len > 0)
    baseline = torch.where(has_baseline, weighted / torch.where(has_baseline, total_len, 1.0), 0.0)
    adv = _broadcast(scores - baseline, response_mask)
    return adv, adv


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""REINFORCE++ with a group-mean baseline (Hu, arXiv:2501.03262); `reinforce_plus_plus_baseline`.

    $a_i = s_i - \mathrm{mean}_g(s)$ (a group of one keeps its raw score), broadcast to every
    valid token, then whitened over all valid tokens of the batch (global normalisation):
    $A_{i,t} = (a_i - \mu)/\sqrt{\sigma^2 + 10^{-8}}$. Identical scores everywhere give 0.
    `epsilon` is unused (signature compatibility).

    Shapes: as `compute_grpo_outcome_advantage`.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    gid, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count, mean, _ = _group_mean_std(scores, gid, num_groups)
    centred = scores - torch.where(count > 1, mean, 0.0)
    adv = masked_whiten(_broadcast(centred, response_mask), response_mask)
    return adv, adv


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""REINFORCE++ (Hu, arXiv:2501.03262); `reinforce_plus_plus`.

    Discounted return to go within each response, $G_t = r_t + \gamma G_{t+1}$ (the sum restarts
    after the response ends: a masked token passes nothing back), then whitened over all valid
    tokens of the batch: $A = \mathrm{whiten}(G)$. No critic, no group.

    Shapes: token_level_rewards, response_mask [B, R] -> (advantages, returns) [B, R], 0 at
    masked positions. Config: `algorithm.gamma`.
    """
    _check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[-1])):
        running = (token_level_rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""ReMax (Li et al., arXiv:2310.10505); `remax`.

    Undiscounted return to go $G_t = \sum_{t' \ge t} m_{t'} r_{t'}$ minus the reward $b$ of the
    greedy (argmax-decoded) response to the same prompt: $A_t = G_t - b$ on valid tokens.

    Shapes: token_level_rewards, response_mask [B, R]; reward_baselines [B] -> (advantages,
    returns) [B, R].
    """
    _check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must have one greedy-response reward per sample, shape "
            f"{tuple(token_level_rewards.shape[:1])}, got {tuple(reward_baselines.shape)}"
        )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns


@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Group Policy Gradient (Chu et al., arXiv:2504.02546); `gpg`.

    $A_i = \alpha\,(s_i - \mathrm{mean}_g(s)) / F_{norm}$ with $\alpha = B / \max(1, M)$, $M$ the
    number of responses in the batch with a non-zero score (GPG's correction for groups that carry
    no signal). A group of one has mean 0 (as upstream). `epsilon` is unused (signature
    compatibility).

    Shapes: as `compute_grpo_outcome_advantage`.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    batch = scores.shape[0]
    gid, num_groups = _group_ids(index, batch, scores.device)
    count, mean, _ = _group_mean_std(scores, gid, num_groups)
    alpha = batch / torch.clamp(torch.count_nonzero(scores), min=1).to(scores.dtype)
    adv = _broadcast(alpha * (scores - torch.where(count > 1, mean, 0.0)) / f_norm, response_mask)
    return adv, adv


@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""GRPO computed with upstream's group statistics (`verl.utils.group_mean_std`); `grpo_vectorized`.

    $A_i = (s_i - \mathrm{mean}_g) / (\sigma_g + \epsilon)$ with
    $\sigma_g = \sqrt{\max(\mathrm{var}_g, \epsilon)}$ (unbiased variance floored at `epsilon`), or
    $A_i = s_i - \mathrm{mean}_g$ without std normalisation. It differs from `grpo` only where the
    variance is below `epsilon` (identical scores still give 0). A group of one has mean 0 and
    std 1, as in `grpo`. Uids may be any labels (`verl.utils.as_torch_index`).

    Shapes: as `compute_grpo_outcome_advantage`.
    """
    from verl.utils.groupwise import as_torch_index, group_mean_std

    scores = _outcome_scores(token_level_rewards, response_mask)
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} uids but the batch has {scores.shape[0]} responses")
    gid = as_torch_index(index, device=scores.device)
    mean, std, _ = group_mean_std(scores, gid, eps=epsilon, device=scores.device)
    centred = scores - mean[gid].to(scores.dtype)
    adv = centred / (std[gid].to(scores.dtype) + epsilon) if norm_adv_by_std_in_grpo else centred
    adv = _broadcast(adv, response_mask)
    return adv, adv


@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""RLOO in one vectorised pass, as upstream's `rloo_vectorized`.

    $A_i = (n\,s_i - \sum_{j\in g} s_j)/(n-1)$, the score minus the mean of the other $n-1$ scores
    of its group. Unlike `rloo`, a group of one gets advantage 0 (there is no other sample to
    compare with). `epsilon` is accepted for the common signature and unused.

    Shapes: as `compute_grpo_outcome_advantage`.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    gid, num_groups = _group_ids(index, scores.shape[0], scores.device)
    count = scores.new_zeros(num_groups).index_add(0, gid, torch.ones_like(scores))[gid]
    total = scores.new_zeros(num_groups).index_add(0, gid, scores)[gid]
    adv = torch.where(count > 1, (count * scores - total) / torch.clamp(count - 1, min=1), 0.0)
    adv = _broadcast(adv, response_mask)
    return adv, adv


def _align_valid_tokens(values: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid tokens to the front, in order: (values [B, K], mask [B, K]) with K the
    longest row's number of valid tokens; column k is every row's k-th valid token."""
    valid = response_mask != 0
    lengths = valid.sum(dim=-1)
    width = int(lengths.max()) if lengths.numel() else 0
    slot = torch.cumsum(valid.long(), dim=-1) - 1
    row = torch.arange(values.shape[0], device=values.device).unsqueeze(-1).expand_as(slot)
    packed = values.new_zeros((values.shape[0], width))
    packed[row[valid], slot[valid]] = values[valid]
    packed_mask = (torch.arange(width, device=values.device) < lengths.unsqueeze(-1)).to(values.dtype)
    return packed, packed_mask


def _optimal_token_baselines(
    returns: torch.Tensor,
    path_variance: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    handle_zero_tail: bool,
    epsilon: float,
    count_empty_rows: bool = True,
) -> torch.Tensor:
    r"""$B_{g,t} = \sum_{i\in g} m_{i,t}G_{i,t}W_{i,t} / (\sum_{i\in g} m_{i,t}W_{i,t} + \epsilon)$ for
    every row's group g and column t, 0 for groups of one (counting empty rows as members or not);
    shapes [B, T] -> [B, T]."""
    gid, num_groups = _group_ids(index, returns.shape[0], returns.device)
    zeros = returns.new_zeros((num_groups, returns.shape[1]))
    numerator = zeros.index_add(0, gid, mask * returns * path_variance)
    denominator = zeros.index_add(0, gid, mask * path_variance)
    baselines = (numerator / (denominator + epsilon))[gid]
    members = torch.ones_like(returns[:, 0]) if count_empty_rows else (mask != 0).any(dim=-1).to(returns.dtype)
    count = returns.new_zeros(num_groups).index_add(0, gid, members)[gid]
    baselines = torch.where(count.unsqueeze(-1) > 1, baselines, 0.0)
    if handle_zero_tail:
        # A group's single longest response has nothing to compare with past the second-longest one's
        # end: its baseline there would be its own return. It keeps a zero baseline on that tail.
        lengths = (mask != 0).sum(dim=-1)
        longest = torch.full((num_groups,), -1, device=returns.device).scatter_reduce(0, gid, lengths, "amax")[gid]
        is_longest = lengths == longest
        num_longest = torch.zeros(num_groups, dtype=torch.long, device=returns.device).index_add(
            0, gid, is_longest.long()
        )[gid]
        others = torch.where(is_longest, -1, lengths)
        second = torch.full((num_groups,), -1, device=returns.device).scatter_reduce(0, gid, others, "amax")[gid]
        alone = is_longest & (num_longest == 1) & (count > 1)
        tail = torch.arange(returns.shape[1], device=returns.device) >= second.unsqueeze(-1)
        baselines = torch.where(alone.unsqueeze(-1) & tail, 0.0, baselines)
    return baselines


def _path_variance(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> torch.Tensor:
    """W_t = sum_{j<=t} m_j (1 - 2 pi_j + sum_v pi_v^2) [* w_j^2]: the cumulative score-norm proxy."""
    mask = response_mask.to(old_log_probs.dtype)
    per_token = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared.to(old_log_probs.dtype)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.to(per_token.dtype).square()
    return torch.cumsum(per_token * mask, dim=-1)


@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Optimal token baseline (upstream's `optimal_token_baseline`): a per-position baseline that
    minimises the policy gradient's variance within each group of responses to one prompt.

    Return to go $G_{i,t} = \sum_{t'\ge t} m_{i,t'} r_{i,t'}$. The squared norm of a token's score
    function $\nabla\log\pi$ w.r.t. the logits is $\|s_t\|^2 = 1 - 2\pi_t + \sum_v\pi_v^2$
    ($\pi_t$ the sampled token's probability, from `old_log_probs`; $\sum_v\pi_v^2$ from the actor's
    `calculate_sum_pi_squared`), and $W_{i,t} = \sum_{j\le t} m_{i,j}\|s_{i,j}\|^2$ is how much
    gradient a response has accumulated by position t. The variance-minimising baseline at t is the
    W-weighted mean return of the group at t:
    $B_{g,t} = \sum_{i\in g} m_{i,t}G_{i,t}W_{i,t} / (\sum_{i\in g} m_{i,t}W_{i,t} + \epsilon)$, and
    $A_{i,t} = (G_{i,t} - B_{g,t})\,m_{i,t}$. With rollout-correction weights, $\|s_t\|^2$ is
    multiplied by $w_t^2$. Positions are columns (token t of every response).

    Edge cases: a group of one has baseline 0 (A = G); `handle_zero_tail` gives the group's single
    longest response a zero baseline past the second-longest one's length.

    Shapes: token_level_rewards, response_mask, old_log_probs, sum_pi_squared (and
    rollout_is_weights) [B, R]; index [B] uids -> (advantages, returns) [B, R].
    """
    _check_shapes(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
    )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    path_variance = _path_variance(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights).to(returns.dtype)
    baselines = _optimal_token_baselines(returns, path_variance, mask, index, handle_zero_tail, epsilon)
    return (returns - baselines) * mask, returns


@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The optimal token baseline for multi-turn responses (upstream's `tir_optimal_token_baseline`).

    As `compute_optimal_token_baseline_advantage`, but position t is a response's t-th *generated*
    token: tool output and other masked spans are left out before responses are compared, so the
    baseline at t averages responses at the same point of their own generation. `handle_zero_tail`
    is on by default; responses without a valid token are not counted as group members (as
    upstream). Returns (advantages, returns) [B, R], in the original columns.
    """
    _check_shapes(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
    )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    path_variance = _path_variance(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights).to(returns.dtype)
    packed_returns, packed_mask = _align_valid_tokens(returns, response_mask)
    packed_variance, _ = _align_valid_tokens(path_variance, response_mask)
    packed_baselines = _optimal_token_baselines(
        packed_returns, packed_variance, packed_mask, index, handle_zero_tail, epsilon, count_empty_rows=False
    )
    valid = response_mask != 0
    slot = torch.cumsum(valid.long(), dim=-1) - 1
    baselines = torch.zeros_like(returns)
    rows = torch.arange(returns.shape[0], device=returns.device).unsqueeze(-1).expand_as(slot)
    baselines[valid] = packed_baselines[rows[valid], slot[valid]]
    return (returns - baselines) * mask, returns


ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    AdvantageEstimator.GAE.value: compute_gae_advantage_return,
    AdvantageEstimator.GRPO.value: compute_grpo_outcome_advantage,
    AdvantageEstimator.GRPO_PASSK.value: compute_grpo_passk_outcome_advantage,
    AdvantageEstimator.RLOO.value: compute_rloo_outcome_advantage,
    AdvantageEstimator.OPO.value: compute_opo_outcome_advantage,
    AdvantageEstimator.REINFORCE_PLUS_PLUS.value: compute_reinforce_plus_plus_outcome_advantage,
    AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE.value: compute_reinforce_plus_plus_baseline_outcome_advantage,
    AdvantageEstimator.REMAX.value: compute_remax_outcome_advantage,
    AdvantageEstimator.GPG.value: compute_gpg_outcome_advantage,
    AdvantageEstimator.GRPO_VECTORIZED.value: compute_grpo_vectorized_outcome_advantage,
    AdvantageEstimator.RLOO_VECTORIZED.value: compute_rloo_vectorized_outcome_advantage,
    AdvantageEstimator.OPTIMAL_TOKEN_BASELINE.value: compute_optimal_token_baseline_advantage,
    AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE.value: compute_multi_turn_optimal_token_baseline_advantage,
}
"""`algorithm.adv_estimator` name -> estimator. Every estimator returns (advantages, returns) [B, R]."""

ADV_ESTIMATOR_REGISTRY = ADV_ESTIMATORS  # upstream's name for the same table


def _name(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable:
    """Decorator adding a user's estimator to `ADV_ESTIMATORS` under `name_or_enum`.

    The function must return (advantages, returns) [B, R]. Registering a different function
    under a taken name is an error (so two plugins cannot silently shadow each other).
    """

    def decorator(fn):
        name = _name(name_or_enum)
        if ADV_ESTIMATORS.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to {ADV_ESTIMATORS[name]}")
        ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The estimator for an `algorithm.adv_estimator` name (or `AdvantageEstimator` member)."""
    name = _name(name_or_enum)
    if name not in ADV_ESTIMATORS:
        raise _unknown_name_error("algorithm.adv_estimator", name, ADV_ESTIMATORS)
    return ADV_ESTIMATORS[name]


PF_PPO_REWEIGHT_METHODS = ("pow", "max_min", "max_random")


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    r"""PF-PPO's sampling weight of each response from its score [B] -> [B] (unnormalised).

    `pow`: $|s|^{p}$; `max_min`: 1 for the batch's best and worst scores, 0 otherwise;
    `max_random`: 0.4 for the best score, 0.1 for every other one. A floor of 1e-8 keeps every
    response drawable (and `multinomial` defined when all weights would be 0).
    """
    if reweight_method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif reweight_method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(
            f"algorithm.pf_ppo.reweight_method={reweight_method!r} is not one of {list(PF_PPO_REWEIGHT_METHODS)}"
        )
    return (weights + 1e-8).clamp(min=1e-8)


@torch.no_grad()
def compute_pf_ppo_reweight_data(
    data: Any, reweight_method: str = "pow", weight_pow: float = 2.0, generator: torch.Generator | None = None
) -> Any:
    """Policy-filtration PPO (`algorithm.use_pf_ppo`): a batch of the same size drawn with replacement
    from `data` (a DataProto holding `token_level_scores`) with probability proportional to
    `pf_ppo_weights` of each response's total score. Every tensor and non-tensor column, and a
    per-row `global_token_num` list in meta_info, follow the drawn rows."""
    scores = data.batch["token_level_scores"].sum(dim=-1)
    weights = pf_ppo_weights(scores.double(), reweight_method, weight_pow)
    rows = torch.multinomial(weights.cpu(), len(scores), replacement=True, generator=generator)
    out = data.select_idxs(rows)
    tokens = data.meta_info.get("global_token_num")
    if isinstance(tokens, list) and len(tokens) == len(scores):
        out.meta_info["global_token_num"] = [tokens[i] for i in rows.tolist()]
    return out


def compute_advantage_from_tensors(name: str | AdvantageEstimator, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the estimator `name` with the subset of `inputs` its signature takes.

    Lets a caller hand every available input at once (token_level_rewards, response_mask, values,
    index, reward_baselines, gamma, lam, epsilon, norm_adv_by_std_in_grpo, ...) whatever the
    estimator. A required input that is missing raises an error naming it.
    """
    fn = get_adv_estimator_fn(name)
    params = inspect.signature(fn).parameters
    missing = [p for p, spec in params.items() if spec.default is inspect.Parameter.empty and p not in inputs]
    if missing:
        raise ValueError(
            f"algorithm.adv_estimator={_name(name)!r} needs {missing}, which the batch does not provide "
            "(gae needs 'values' from a critic; remax needs 'reward_baselines' from a greedy rollout; "
            "optimal_token_baseline needs 'sum_pi_squared': set actor_rollout_ref.actor.calculate_sum_pi_squared=true)"
        )
    return fn(**{k: v for k, v in inputs.items() if k in params})


# ==============================================================================================
# Policy losses (actor.policy_loss.loss_mode)
# ==============================================================================================


@dataclass(frozen=True)
class PolicyLossParams:
    """The numbers a policy loss needs (pure numbers, read from `actor_rollout_ref.actor.*` by the actor).

    Defaults are upstream verl's.
    """

    clip_ratio: float = 0.2
    """PPO's clip range epsilon (`actor.clip_ratio`): the ratio is clipped to [1-eps, 1+eps]."""
    clip_ratio_low: float | None = None
    """Lower clip range (`actor.clip_ratio_low`); None means `clip_ratio`."""
    clip_ratio_high: float | None = None
    """Upper clip range (`actor.clip_ratio_high`); None means `clip_ratio`. DAPO's clip-higher
    sets it above `clip_ratio_low` (e.g. 0.28 vs 0.2)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant c > 1 (`actor.clip_ratio_c`): for negative advantages the loss is
    capped at -c*A (Ye et al., arXiv:1912.09729)."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: fraction of valid tokens whose gradient is cut (`actor.policy_loss.clip_cov_ratio`)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance band eligible for cutting (`policy_loss.clip_cov_lb`)."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of that band (`policy_loss.clip_cov_ub`)."""
    kl_cov_ratio: float = 0.0002
    """KL-Cov: fraction of valid tokens (largest covariance) that get the KL term (`policy_loss.kl_cov_ratio`)."""
    ppo_kl_coef: float = 0.1
    """KL-Cov: coefficient of |log ratio| on the selected tokens (`policy_loss.ppo_kl_coef`)."""
    tis_imp_ratio_cap: float | None = None
    """Truncated importance sampling against the rollout engine's log-probs
    (`actor.tis_imp_ratio_cap`): each token's loss is weighted by min(pi_old/pi_rollout, cap).
    None (or a value <= 0, upstream's -1) turns it off."""
    tau_pos: float = 1.0
    """SAPO: temperature of the soft gate for tokens with a positive advantage (`actor.tau_pos`);
    larger is closer to PPO's hard clip (arXiv:2511.20347)."""
    tau_neg: float = 1.05
    """SAPO: temperature for tokens with a zero or negative advantage (`actor.tau_neg`); above
    tau_pos so negative updates are damped faster."""
    loss_scale_factor: float | None = None
    """`seq-mean-token-sum-norm`'s constant length L (`actor.loss_scale_factor`); None: the padded
    response length."""
    rollout_correction: RolloutCorrectionConfig | None = None
    """Bypass mode's settings (`algorithm.rollout_correction`, handed to the actor as
    `policy_loss.rollout_correction`); None: PPO-clip on pi/pi_rollout, no weights, no rejection."""

    def __post_init__(self):
        if self.clip_ratio < 0 or (self.clip_ratio_low or 0) < 0 or (self.clip_ratio_high or 0) < 0:
            raise ValueError(
                f"actor.clip_ratio={self.clip_ratio}, clip_ratio_low={self.clip_ratio_low} and "
                f"clip_ratio_high={self.clip_ratio_high} must be >= 0 (typical: 0.2, DAPO: low 0.2, high 0.28)"
            )
        if not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1: dual-clip caps the loss of negative "
                "advantages at clip_ratio_c * |A|, which only makes sense above the unclipped ratio 1 (default 3.0)"
            )
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"actor.policy_loss.{name}={getattr(self, name)} must be a fraction in (0, 1]")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"actor.policy_loss.clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}"
            )
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(
                f"actor.tau_pos={self.tau_pos} and actor.tau_neg={self.tau_neg} must be > 0: they are the temperatures "
                "of SAPO's sigmoid gate (upstream defaults 1.0 and 1.05)"
            )
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ValueError(
                f"actor.loss_scale_factor={self.loss_scale_factor} must be > 0 (the constant length that "
                "seq-mean-token-sum-norm divides by) or null for the padded response length"
            )
        if isinstance(self.rollout_correction, Mapping):
            object.__setattr__(self, "rollout_correction", RolloutCorrectionConfig.from_config(self.rollout_correction))

    @classmethod
    def from_actor_config(cls, actor_config: Any) -> PolicyLossParams:
        """Read the numbers from an `actor_rollout_ref.actor` config (a mapping or an attribute-style
        object, e.g. a DictConfig or a dataclass); keys it lacks keep their defaults.

        Upstream's keys: `clip_ratio`, `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`,
        `tis_imp_ratio_cap`, `tau_pos`, `tau_neg`, `loss_scale_factor` and
        `policy_loss.{clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef}`, plus
        `policy_loss.rollout_correction` (set by the trainer in rollout correction's bypass mode).
        """

        def read(node: Any, key: str) -> Any:
            if node is None:
                return None
            return node.get(key) if hasattr(node, "get") else getattr(node, key, None)

        policy_loss = read(actor_config, "policy_loss")
        found = {key: read(actor_config, key) for key in _ACTOR_KEYS}
        found.update({key: read(policy_loss, key) for key in _POLICY_LOSS_KEYS})
        return cls(**{key: value for key, value in found.items() if value is not None})

    @property
    def low(self) -> float:
        """The effective lower clip range."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """The effective upper clip range."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def tis_enabled(self) -> bool:
        return self.tis_imp_ratio_cap is not None and self.tis_imp_ratio_cap > 0


_ACTOR_KEYS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tis_imp_ratio_cap",
    "tau_pos",
    "tau_neg",
    "loss_scale_factor",
)
_POLICY_LOSS_KEYS = (
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "rollout_correction",
)
_DEFAULT_PARAMS = PolicyLossParams()


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _apply_tis(
    pg_losses: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    params: PolicyLossParams,
    rollout_is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight each token's loss by min(pi_old / pi_rollout, cap) (`tis_imp_ratio_cap`) and by the
    rollout correction's importance weights (`rollout_is_weights`, computed by the trainer); no
    gradient flows through either weight."""
    if rollout_is_weights is not None:
        _check_shapes(pg_losses=pg_losses, rollout_is_weights=rollout_is_weights)
        pg_losses = pg_losses * rollout_is_weights.detach()
    if rollout_log_probs is None or not params.tis_enabled:
        return pg_losses
    log_w = torch.clamp(old_log_prob - rollout_log_probs, -_LOG_RATIO_CLAMP, math.log(params.tis_imp_ratio_cap))
    return pg_losses * torch.exp(log_w).detach()


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
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
    params = params or _DEFAULT_PARAMS
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * params.clip_ratio_c
    pg_losses = torch.where(advantages < 0, torch.minimum(clip_loss, dual_cap), clip_loss)
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, params, rollout_is_weights)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean(
            ((clip_loss > dual_cap) & (advantages < 0)).to(ratio.dtype), response_mask
        ).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode, params.loss_scale_factor), metrics


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
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
    params = params or _DEFAULT_PARAMS
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)
    pg_losses = _apply_tis(
        torch.maximum(unclipped, clipped), old_log_prob, rollout_log_probs, params, rollout_is_weights
    )
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), response_mask).detach(),
        "pg_clipfrac_lower": _zero(ratio),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode, params.loss_scale_factor), metrics


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Group Policy Gradient's plain REINFORCE loss (Chu et al., arXiv:2504.02546); `gpg`.

    $\ell_{i,t} = -A_{i,t}\log\pi_{i,t}$: no ratio, no clipping (pair with the `gpg` advantage
    estimator). `pg_clipfrac`/`pg_clipfrac_lower` are 0; `ppo_kl` is still reported.
    """
    params = params or _DEFAULT_PARAMS
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    pg_losses = _apply_tis(-advantages * log_prob, old_log_prob, rollout_log_probs, params, rollout_is_weights)
    metrics = {
        "pg_clipfrac": _zero(log_prob),
        "pg_clipfrac_lower": _zero(log_prob),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode, params.loss_scale_factor), metrics


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
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
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
    params = params or _DEFAULT_PARAMS
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
    pg_losses = torch.where(cut, 0.0, torch.maximum(unclipped, clipped))
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, params, rollout_is_weights)
    metrics = {
        "pg_clipfrac": masked_mean(cut.to(ratio.dtype), response_mask).detach(),
        "pg_clipfrac_lower": _zero(ratio),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode, params.loss_scale_factor), metrics


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""KL-Cov (Cui et al., arXiv:2505.22617); `kl_cov`.

    Unclipped surrogate $\ell = -A\rho$, plus a KL term $\beta\,|\log\rho|$ on the
    $k = \max(1, \lfloor r\cdot N_{valid}\rfloor)$ valid tokens with the largest covariance
    $(A - \bar A)(\log\pi - \overline{\log\pi})$. Config: `policy_loss.kl_cov_ratio` ($r$),
    `policy_loss.ppo_kl_coef` ($\beta$). Metrics: `ppo_kl` is the mean $|\log\rho|$ (as upstream),
    `pg_clipfrac` the fraction of valid tokens that got the KL term, `pg_clipfrac_lower` 0.
    """
    params = params or _DEFAULT_PARAMS
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    valid = response_mask != 0
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    cov = _token_covariance(advantages, log_prob, valid)
    num_valid = valid.sum().to(torch.float64)
    num_pen = torch.clamp(torch.floor(num_valid * params.kl_cov_ratio), min=1)
    penalised = valid & (_rank_descending(torch.where(valid, cov, -torch.inf)) < num_pen)
    pg_losses = -advantages * ratio + torch.where(penalised, params.ppo_kl_coef * log_ratio.abs(), 0.0)
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, params, rollout_is_weights)
    metrics = {
        "pg_clipfrac": masked_mean(penalised.to(ratio.dtype), response_mask).detach(),
        "pg_clipfrac_lower": _zero(ratio),
        "ppo_kl": masked_mean(log_ratio.abs(), response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode, params.loss_scale_factor), metrics


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
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
    params = params or _DEFAULT_PARAMS
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
    metrics = {
        "pg_clipfrac": masked_mean((was_clipped & (advantages > 0)).to(log_ratio.dtype), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean((was_clipped & (advantages < 0)).to(log_ratio.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return pg_loss, metrics


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
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
    params = params or _DEFAULT_PARAMS
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - params.low, 1 + params.high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, params, rollout_is_weights)
    metrics = {
        "pg_clipfrac": masked_mean((ratio != clipped_ratio).to(ratio.dtype), response_mask).detach(),
        "pg_clipfrac_lower": _zero(ratio),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode, params.loss_scale_factor), metrics


SAPO_LOSS_AGG_MODE = "seq-mean-token-mean"


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = SAPO_LOSS_AGG_MODE,
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
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
    params = params or _DEFAULT_PARAMS
    _check_shapes(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    # built in the ratio's dtype: torch.where of two Python floats would round them to float32
    tau = torch.full_like(ratio, params.tau_neg).masked_fill(advantages > 0, params.tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = _apply_tis(-gate * advantages, old_log_prob, rollout_log_probs, params, rollout_is_weights)
    metrics = {
        "pg_clipfrac": _zero(ratio),
        "pg_clipfrac_lower": _zero(ratio),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, SAPO_LOSS_AGG_MODE, params.loss_scale_factor), metrics


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Rollout correction's bypass mode (`algorithm.rollout_correction.bypass_mode=true`); `bypass_mode`.

    The trainer skipped the old-log-prob pass: `old_log_prob` *is* the rollout's, $\mu$. Per call,
    from the current $\pi$ (no gradient): importance weights and rejection as configured in
    `params.rollout_correction` (see `verl.trainer.ppo.rollout_corr_helper`); rejected tokens' terms
    are dropped (weight 0, still counted by the aggregation), then by `loss_type`:

    - `ppo_clip`: `vanilla`'s clipped surrogate on $\rho = \pi/\mu$ (the ratio already is the
      importance weight, so the weights are only reported);
    - `reinforce`: $\ell_t = -\mathrm{sg}(w_t)A_t\log\pi_t$ ($w$ = 1 without `rollout_is`).

    Metrics: the chosen loss's, plus `rollout_corr/*` (weights, rejection, off-policy gap of the
    current policy). `rollout_is_weights` from the batch are not used (they would weight twice).
    """
    params = params or _DEFAULT_PARAMS
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
        pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, params.loss_scale_factor)
        metrics = {
            "pg_clipfrac": _zero(log_prob),
            "pg_clipfrac_lower": _zero(log_prob),
            "ppo_kl": masked_mean(old_log_prob - log_prob, kept).detach(),
        }
    else:
        pg_loss, metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params, rollout_is_weights=keep
        )
    metrics.update(corr_metrics)
    return pg_loss, metrics


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "cispo": compute_policy_loss_cispo,
    "sapo": compute_policy_loss_sapo,
    "bypass_mode": compute_policy_loss_bypass_mode,
}
"""`actor.policy_loss.loss_mode` name -> loss. Every loss has the signature
`fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", params=None,
rollout_log_probs=None, rollout_is_weights=None) -> (scalar loss, {"pg_clipfrac",
"pg_clipfrac_lower", "ppo_kl", ...})`. Metric names without a `/` are the actor's (`actor/<name>`);
names with one (`rollout_corr/...`) are logged as they are.

`rollout_is_weights` [B, R] are rollout correction's importance weights (decoupled mode): each
token's loss is multiplied by them before aggregation. A user's loss registered without that
parameter works as long as rollout correction's weights are off."""

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


# ==============================================================================================
# Value loss, entropy, explained variance
# ==============================================================================================


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""PPO's clipped value loss; `critic.cliprange_value`, `critic.loss_agg_mode`.

    $\hat V^{clip} = \mathrm{clip}(\hat V, V_{old} - c, V_{old} + c)$,
    $\ell = \max((\hat V - G)^2, (\hat V^{clip} - G)^2)$, loss $= \frac12\,\mathrm{agg}(\ell)$.
    Shapes: all [B, R]. Returns (scalar loss, vf_clipfrac = fraction of tokens where the clipped
    term was larger).
    """
    _check_shapes(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(vpreds.dtype), response_mask).detach()
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    r"""Mean token entropy $\mathrm{agg}(H(\mathrm{softmax}(z_{i,t})))$ of logits [B, R, V] -> scalar.

    Differentiable, computed chunk by chunk (bounded memory for large vocabularies). The actor
    subtracts `actor.entropy_coeff` times this from the policy loss (an entropy bonus).
    """
    return agg_loss(entropy_from_logits_with_chunking(logits), response_mask, loss_agg_mode)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    r"""How much of the returns' variance the critic explains (the `critic/vf_explained_var` metric).

    $1 - \mathrm{Var}[G - V] / (\mathrm{Var}[G] + 10^{-5})$ over valid tokens (unbiased variances;
    the $10^{-5}$ keeps constant returns finite, as upstream). 1 is a perfect critic, 0 one that
    predicts the mean, negative worse than that. Shapes: [B, R] -> scalar.
    """
    _check_shapes(values=values, returns=returns, response_mask=response_mask)
    return 1.0 - masked_var(returns - values, response_mask) / (masked_var(returns, response_mask) + 1e-5)


# ==============================================================================================
# KL: estimators, in-reward penalty, KL loss, controllers
# ==============================================================================================


def _kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


def _kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


def _kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def _kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    # Clamps as upstream: the log-ratio to ±20 before exp, the estimate to ±10.
    log_ratio = torch.clamp(ref_logprob - logprob, -20.0, 20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _kl_k1,
    "k1": _kl_k1,
    "abs": _kl_abs,
    "mse": _kl_k2,
    "k2": _kl_k2,
    "low_var_kl": _kl_k3,
    "k3": _kl_k3,
}
"""Per-token KL estimators (Schulman, "Approximating KL divergence", 2020); any name may end in `+`."""


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    r"""Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs [B, R] -> [B, R].

    With $x = \log\pi - \log\pi_{ref}$ (http://joschu.net/blog/kl-approx.html):
    `kl`/`k1`: $x$; `abs`: $|x|$; `mse`/`k2`: $x^2/2$; `low_var_kl`/`k3`:
    $e^{-x} + x - 1$ (unbiased, non-negative, low variance; clamped to [-10, 10]).
    A trailing `+` (e.g. `k3+`) is the straight-through variant: the value of the named estimator
    with the gradient of `k2`, $\nabla = x\nabla\log\pi$, whose expectation is the true KL
    gradient (the k1 and k3 gradients are biased). Used for `algorithm.kl_penalty` (in-reward)
    and `actor.kl_loss_type` (KL loss).
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    base = name[:-1] if name.endswith("+") else name
    if base not in KL_ESTIMATORS:
        valid = [*KL_ESTIMATORS, *(f"{k}+" for k in KL_ESTIMATORS)]
        raise _unknown_name_error("KL estimator (algorithm.kl_penalty / actor.kl_loss_type)", name, valid)
    value = KL_ESTIMATORS[base](logprob, ref_logprob)
    if base == name or KL_ESTIMATORS[base] is _kl_k2:
        return value
    grad_carrier = _kl_k2(logprob, ref_logprob)
    return grad_carrier - grad_carrier.detach() + value.detach()


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    r"""The KL loss term $\mathrm{agg}(\mathrm{KL}_{est}(\pi, \pi_{ref}))$ -> scalar (GRPO's in-loss KL).

    The actor adds `actor.kl_loss_coef` times this to the policy loss when `actor.use_kl_loss`.
    `kl_loss_type` is any `kl_penalty` name (default `low_var_kl`, as upstream).
    """
    _check_shapes(log_prob=log_prob, ref_log_prob=ref_log_prob, response_mask=response_mask)
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode)


@torch.no_grad()
def apply_kl_penalty_tensors(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""KL penalty in the reward (`algorithm.use_kl_in_reward`, Ziegler et al., arXiv:1909.08593).

    $r_t = \mathrm{score}_t - \beta\,\mathrm{KL}_{est,t}$ on valid tokens, with $\beta$ = the KL
    controller's current value and the estimator `algorithm.kl_penalty`. Also returns the batch's
    current KL, the mean over responses of each response's mean token KL, which the trainer feeds
    to the controller's `update` (and logs as `actor/reward_kl_penalty`).

    Shapes: all [B, R] -> (token_level_rewards [B, R], current_kl scalar tensor).
    """
    _check_shapes(
        token_level_scores=token_level_scores,
        old_log_probs=old_log_probs,
        ref_log_prob=ref_log_prob,
        response_mask=response_mask,
    )
    kld = torch.where(response_mask != 0, _kl_estimate(old_log_probs, ref_log_prob, kl_penalty), 0.0)
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean()
    return token_level_rewards, current_kl


class FixedKLController:
    """A constant KL coefficient (`algorithm.kl_ctrl.type=fixed`)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""


class AdaptiveKLController:
    r"""Adaptive KL coefficient (Ziegler et al., arXiv:1909.08593; `algorithm.kl_ctrl.type=adaptive`).

    After each batch: $e = \mathrm{clip}(\mathrm{KL}/\mathrm{KL}_{target} - 1, -0.2, 0.2)$,
    $\beta \leftarrow \beta\,(1 + e\cdot n_{steps}/\mathrm{horizon})$, so $\beta$ grows while the
    measured KL is above `target_kl` and shrinks below it.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon={horizon} must be > 0 for the adaptive KL controller")
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl={target_kl} must be > 0 for the adaptive KL controller")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient to the KL measured over `n_steps` samples (a float or 0-d tensor)."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLERS = ("fixed", "adaptive")


def get_kl_controller(
    kl_ctrl_type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `algorithm.kl_ctrl.type` from `kl_ctrl.{kl_coef,target_kl,horizon}`."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                "algorithm.kl_ctrl.type=adaptive needs kl_ctrl.target_kl and kl_ctrl.horizon "
                f"(got target_kl={target_kl}, horizon={horizon}); upstream defaults are 0.1 and 10000"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise _unknown_name_error("algorithm.kl_ctrl.type", kl_ctrl_type, KL_CONTROLLERS)


# ==============================================================================================
# DAPO helpers: overlong reward shaping, dynamic-sampling group filter
# ==============================================================================================


def compute_overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    r"""DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476), added to each response's reward.

    With $L_{max}$ = `max_response_length` and buffer $L_b$ = `overlong_buffer.len`:
    $p(L) = \min(0,\ -\frac{L - (L_{max} - L_b)}{L_b}\cdot\mathrm{penalty\_factor})$: 0 up to
    $L_{max} - L_b$ tokens, then falling linearly to -penalty_factor at $L_{max}$.
    Shapes: response_lengths [B] (valid token counts) -> [B] float penalties (<= 0).
    Config: `reward_model.overlong_buffer.{len,penalty_factor}`, `data.max_response_length`.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len={overlong_buffer_len} must be in (0, data.max_response_length="
            f"{max_response_length}]: it is the number of tokens before the limit over which the penalty ramps"
        )
    lengths = response_lengths.to(torch.promote_types(response_lengths.dtype, torch.float32))
    exceed = lengths - (max_response_length - overlong_buffer_len)
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)


def filter_groups_by_metric_variance(metric_values: Any, uids: Any) -> tuple[np.ndarray, list]:
    """DAPO's dynamic-sampling filter (`algorithm.filter_groups`, arXiv:2503.14476).

    Keeps the groups (responses sharing a uid) whose metric (e.g. `acc` or `score`) varies, i.e.
    has non-zero standard deviation, plus groups of one response; groups whose responses all score
    the same carry no GRPO signal and are dropped.

    metric_values: [B] numbers (list, numpy array or tensor); uids: [B]. Returns (keep mask [B]
    bool numpy array, kept uids in first-seen order).
    """
    if isinstance(metric_values, torch.Tensor):
        metric_values = metric_values.detach().cpu().numpy()
    values = np.asarray(metric_values, dtype=np.float64)
    if len(values) != len(uids):
        raise ValueError(f"metric_values has {len(values)} entries but uids has {len(uids)}; pass one per response")
    groups: dict[Any, list[float]] = {}
    for uid, value in zip(uids, values):
        groups.setdefault(uid, []).append(value)
    kept = [uid for uid, vals in groups.items() if len(vals) == 1 or np.std(vals) > 0]
    kept_set = set(kept)
    keep = np.array([uid in kept_set for uid in uids], dtype=bool)
    return keep, kept
