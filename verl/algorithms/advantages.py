"""Advantage estimators (`algorithm.adv_estimator`), PF-PPO reweighting and the estimator table.

Design decisions:

- One explicit table, `ADV_ESTIMATORS` (upstream's alias `ADV_ESTIMATOR_REGISTRY` is the same dict),
  maps each config name to its estimator; `register_adv_est` adds a user's entry to that same
  dict, so a plugin registered through `verl.trainer.ppo.core_algos` is found here too.
- Grouped estimators (GRPO and friends) group by the `uid` strings of `non_tensor_batch["uid"]`;
  the grouping is a small host-side dictionary pass over the uids, the arithmetic is vectorised
  (`index_add_` per group), so there is no Python loop over samples on the device.
- Edge cases are defined, never NaN: a group of one response, a group whose rewards are all equal,
  a response that is all padding all give finite results; each estimator's docstring says which.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from enum import Enum
from typing import Any

import numpy as np
import torch

from verl.algorithms._common import _check_shapes
from verl.utils.torch_functional import masked_whiten


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
    GDPO = "gdpo"


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
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    reward_components: list | None = None,
    reward_weights: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""GDPO, group reward-decoupled normalisation (arXiv:2601.05242); `gdpo`.

    Each reward component $k$ (a per-response score, e.g. format and accuracy) is normalised within its
    group as GRPO normalises the total score, $A_k = \mathrm{grpo}(r_k)$; the weighted sum
    $\sum_k w_k A_k$ ($w_k$ = `reward_weights`, default 1) is then whitened over the batch's valid tokens
    (`masked_whiten`: zero mean, unit unbiased variance). Normalising each component apart keeps one with a
    larger spread from drowning the others. Without components the total score is the only one.

    Shapes: token_level_rewards, response_mask [B, R]; index [B]; reward_components: K sequences of [B]
    per-response scores (`algorithm.gdpo_reward_keys` columns) -> (advantages, returns) [B, R], equal.
    """
    if reward_components:
        scores = [
            torch.as_tensor(np.asarray(c, dtype=np.float64), dtype=torch.float32, device=response_mask.device)
            for c in reward_components
        ]
        for k, s in enumerate(scores):
            if s.shape != response_mask.shape[:1]:
                raise ValueError(
                    f"reward component {k} has {tuple(s.shape)} scores for a batch of {response_mask.shape[0]} responses"
                )
        # one score per response at its first valid token: GRPO's outcome score of that row is that score
        per_token = [torch.zeros_like(response_mask, dtype=torch.float32) for _ in scores]
        for target, s in zip(per_token, scores, strict=True):
            target[:, 0] = s
    else:
        per_token = [token_level_rewards]
    weights = reward_weights if reward_weights is not None else [1.0] * len(per_token)
    if len(weights) != len(per_token):
        raise ValueError(
            f"algorithm.gdpo_reward_weights has {len(weights)} weights for {len(per_token)} reward components"
        )
    total = torch.zeros_like(response_mask, dtype=torch.float32)
    for weight, rewards in zip(weights, per_token, strict=True):
        adv, _ = compute_grpo_outcome_advantage(rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo)
        total = total + float(weight) * adv
    adv = masked_whiten(total, response_mask) * response_mask
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
    AdvantageEstimator.GDPO.value: compute_gdpo_outcome_advantage,
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
        raise ValueError(
            f"Unknown advantage estimator simply: {name} (algorithm.adv_estimator); valid names are: "
            f"{', '.join(sorted(ADV_ESTIMATORS))}"
        )
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
