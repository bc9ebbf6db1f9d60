"""Every `algorithm.adv_estimator` against a float64 loop reference or a hand-worked example."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from ppo_reference import rows, valid_positions, whiten_reference

from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    compute_advantage_from_tensors,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
)

EPS = 1e-6

# Groups: "a" varied scores (4), "b" identical scores (3), "c" a single response, "d" two responses
# one of which is entirely padding.
UIDS = np.array(["a", "b", "a", "c", "b", "a", "d", "b", "a", "d"], dtype=object)
LENGTHS = [6, 3, 5, 4, 2, 1, 6, 4, 3, 0]
SCORES = [1.0, 0.5, 0.0, 0.7, 0.5, 2.0, -1.0, 0.5, 0.25, 0.0]


def outcome_batch():
    """Outcome rewards on the last valid token, plus small per-token shaping on row 0 (estimators sum)."""
    batch, length = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(batch, length, dtype=torch.float64)
    rewards = torch.zeros(batch, length, dtype=torch.float64)
    for i, (n, s) in enumerate(zip(LENGTHS, SCORES)):
        mask[i, :n] = 1
        if n:
            rewards[i, n - 1] = s
    rewards[0, 1] += 0.125
    rewards[0, 5] -= 0.125
    return rewards, mask


def groups_of(uids):
    out = {}
    for i, u in enumerate(uids):
        out.setdefault(u, []).append(i)
    return out


def broadcast_reference(per_sample: list[float], mask: torch.Tensor) -> torch.Tensor:
    return torch.tensor(
        [[per_sample[i] if m != 0 else 0.0 for m in row] for i, row in enumerate(rows(mask))], dtype=torch.float64
    )


def scores_reference(rewards):
    return [sum(r) for r in rows(rewards)]


# ---------------------------------------------------------------------------------------------- GAE


def test_gae_hand_worked_returns_equal_total_future_reward_when_gamma_and_lambda_are_one():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    # deltas 0.1, 0.1, 0.3 -> raw advantages 0.5, 0.4, 0.3; returns = raw advantage + value = 1.
    torch.testing.assert_close(ret, torch.ones(1, 3, dtype=torch.float64))
    raw = [0.5, 0.4, 0.3]
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    expected = torch.tensor([[(a - mean) / math.sqrt(std**2 + 1e-8) for a in raw]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def gae_reference(rewards, values, mask, gamma, lam):
    """GAE on each response's valid tokens only (masked tokens are skipped, not zeroed)."""
    r, v, m = rows(rewards), rows(values), rows(mask)
    raw = [[0.0] * len(row) for row in r]
    returns = [[0.0] * len(row) for row in r]
    for i in range(len(r)):
        pos = valid_positions(m[i])
        gae = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            next_v = v[i][pos[k + 1]] if k + 1 < len(pos) else 0.0
            gae = r[i][t] + gamma * next_v - v[i][t] + gamma * lam * gae
            raw[i][t] = gae
            returns[i][t] = gae + v[i][t]
    return whiten_reference(raw, m), returns


def test_gae_matches_loop_reference_with_interior_masked_tokens_and_empty_row():
    g = torch.Generator().manual_seed(0)
    batch, length = 5, 7
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, length, dtype=torch.float64)
    mask[0, 5:] = 0  # right padding
    mask[1, 2:4] = 0  # tool output inside a multi-turn response
    mask[2, :] = 0  # a response that is all padding
    mask[3, 1] = 0
    mask[3, 6] = 0
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    exp_adv, exp_ret = gae_reference(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64))


# --------------------------------------------------------------------------------------------- GRPO


def grpo_reference(rewards, uids, norm_by_std):
    scores = scores_reference(rewards)
    out = [0.0] * len(scores)
    for members in groups_of(uids).values():
        vals = [scores[i] for i in members]
        mean, std = (0.0, 1.0) if len(vals) == 1 else (statistics.mean(vals), statistics.stdev(vals))
        for i in members:
            out[i] = (scores[i] - mean) / (std + EPS) if norm_by_std else scores[i] - mean
    return out


@pytest.mark.parametrize("norm_by_std", [True, False], ids=["grpo", "dr_grpo"])
def test_grpo_matches_loop_reference(norm_by_std):
    rewards, mask = outcome_batch()
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, UIDS, epsilon=EPS, norm_adv_by_std_in_grpo=norm_by_std)
    expected = broadcast_reference(grpo_reference(rewards, UIDS, norm_by_std), mask)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_grpo_hand_worked_two_right_two_wrong():
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.float64)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["q"] * 4, dtype=object), epsilon=0.0)
    # mean 0.5, unbiased std sqrt(1/3): advantages +-0.5 * sqrt(3)
    h = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([[h], [-h], [-h], [h]], dtype=torch.float64))


def test_grpo_advantage_is_zero_for_identical_rewards_and_raw_score_for_a_group_of_one():
    rewards, mask = outcome_batch()
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, UIDS)
    assert torch.all(adv[[1, 4, 7]] == 0)  # group "b": identical scores
    torch.testing.assert_close(adv[3, :4], torch.full((4,), 0.7 / (1 + EPS), dtype=torch.float64))  # group "c"


# --------------------------------------------------------------------------------------- GRPO pass@k


def passk_reference(rewards, uids, norm_by_std):
    scores = scores_reference(rewards)
    out = [0.0] * len(scores)
    for members in groups_of(uids).values():
        if len(members) < 2:
            continue
        vals = [scores[i] for i in members]
        best = members[vals.index(max(vals))]
        second = sorted(vals, reverse=True)[1]
        gap = scores[best] - second
        out[best] = gap / (statistics.stdev(vals) + EPS) if norm_by_std else gap
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_only_the_best_response_gets_best_minus_runner_up(norm_by_std):
    rewards, mask = outcome_batch()
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, UIDS, epsilon=EPS, norm_adv_by_std_in_grpo=norm_by_std)
    torch.testing.assert_close(adv, broadcast_reference(passk_reference(rewards, UIDS, norm_by_std), mask))
    assert adv[5, 0] > 0  # row 5 is the best of group "a"


# --------------------------------------------------------------------------------------------- RLOO


def test_rloo_subtracts_the_mean_of_the_other_responses():
    rewards, mask = outcome_batch()
    scores = scores_reference(rewards)
    expected = []
    for i, u in enumerate(UIDS):
        others = [scores[j] for j in range(len(UIDS)) if UIDS[j] == u and j != i]
        expected.append(scores[i] - sum(others) / len(others) if others else scores[i])
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, UIDS)
    torch.testing.assert_close(adv, broadcast_reference(expected, mask))


# ---------------------------------------------------------------------------------------------- OPO


def test_opo_subtracts_the_length_weighted_group_mean():
    rewards, mask = outcome_batch()
    scores = scores_reference(rewards)
    expected = []
    for i, u in enumerate(UIDS):
        members = [j for j in range(len(UIDS)) if UIDS[j] == u]
        baseline = 0.0
        if len(members) > 1:
            baseline = sum(LENGTHS[j] * scores[j] for j in members) / sum(LENGTHS[j] for j in members)
        expected.append(scores[i] - baseline)
    adv, _ = compute_opo_outcome_advantage(rewards, mask, UIDS)
    torch.testing.assert_close(adv, broadcast_reference(expected, mask))


def test_opo_group_of_empty_responses_is_finite():
    rewards = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.float64)
    adv, _ = compute_opo_outcome_advantage(rewards, mask, np.array(["x", "x"], dtype=object))
    assert torch.all(adv == 0)


# ---------------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_baseline_whitens_group_centred_scores_over_tokens():
    rewards, mask = outcome_batch()
    scores = scores_reference(rewards)
    centred = []
    for i, u in enumerate(UIDS):
        members = [scores[j] for j in range(len(UIDS)) if UIDS[j] == u]
        centred.append(scores[i] - (statistics.mean(members) if len(members) > 1 else 0.0))
    expected = whiten_reference(rows(broadcast_reference(centred, mask)), rows(mask))
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, UIDS)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_reinforce_plus_plus_discounts_returns_within_each_response_then_whitens():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[2, :] = 0
    mask[3, 1:] = 0
    gamma = 0.95
    returns = [[0.0] * 6 for _ in range(4)]
    for i, (r, m) in enumerate(zip(rows(rewards), rows(mask))):
        for t in valid_positions(m):
            returns[i][t] = sum(gamma ** (k - t) * r[k] for k in valid_positions(m) if k >= t)
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=gamma)
    torch.testing.assert_close(ret, torch.tensor(returns, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor(whiten_reference(returns, rows(mask)), dtype=torch.float64))


# -------------------------------------------------------------------------------------------- ReMax


def test_remax_subtracts_the_greedy_baseline_from_the_return_to_go():
    rewards, mask = outcome_batch()
    baselines = torch.linspace(-0.5, 0.5, len(LENGTHS), dtype=torch.float64)
    adv, ret = compute_remax_outcome_advantage(rewards, baselines, mask)
    exp_ret, exp_adv = [], []
    for i, (r, m) in enumerate(zip(rows(rewards), rows(mask))):
        pos = valid_positions(m)
        to_go = [sum(r[k] for k in pos if k >= t) if m[t] else 0.0 for t in range(len(r))]
        exp_ret.append(to_go)
        exp_adv.append([to_go[t] - baselines[i].item() if m[t] else 0.0 for t in range(len(r))])
    torch.testing.assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------- GPG


def test_gpg_scales_group_centred_scores_by_batch_over_nonzero_count():
    rewards, mask = outcome_batch()
    scores = scores_reference(rewards)
    alpha = len(scores) / sum(1 for s in scores if s != 0)
    expected = []
    for i, u in enumerate(UIDS):
        members = [scores[j] for j in range(len(UIDS)) if UIDS[j] == u]
        expected.append(alpha * (scores[i] - (statistics.mean(members) if len(members) > 1 else 0.0)) / 2.0)
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, UIDS, f_norm=2.0)
    torch.testing.assert_close(adv, broadcast_reference(expected, mask))


# ------------------------------------------------------------------------------- table and edge cases


def test_table_covers_every_advantage_estimator_enum_value():
    assert set(ADV_ESTIMATORS) == {e.value for e in AdvantageEstimator}
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO) is compute_grpo_outcome_advantage
    assert get_adv_estimator_fn("gae") is compute_gae_advantage_return


def test_unknown_estimator_name_error_lists_the_valid_names():
    with pytest.raises(ValueError, match="grpo") as err:
        get_adv_estimator_fn("grpoo")
    assert all(name in str(err.value) for name in ADV_ESTIMATORS)


def test_missing_index_is_reported_by_name():
    rewards, mask = outcome_batch()
    with pytest.raises(ValueError, match="index"):
        compute_advantage_from_tensors("grpo", token_level_rewards=rewards, response_mask=mask)


def test_index_of_the_wrong_length_is_an_error():
    rewards, mask = outcome_batch()
    with pytest.raises(ValueError, match="uid"):
        compute_grpo_outcome_advantage(rewards, mask, UIDS[:3])


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_estimator_is_finite_and_zero_on_padding_for_singletons_ties_and_empty_rows(name):
    rewards, mask = outcome_batch()
    inputs = dict(
        token_level_rewards=rewards.float(),
        response_mask=mask.float(),
        values=torch.zeros_like(rewards, dtype=torch.float32),
        index=UIDS,
        reward_baselines=torch.zeros(len(LENGTHS)),
        old_log_probs=torch.full_like(rewards, -1.0, dtype=torch.float32),
        sum_pi_squared=torch.full_like(rewards, 0.3, dtype=torch.float32),
        gamma=1.0,
        lam=1.0,
    )
    adv, ret = compute_advantage_from_tensors(name, **inputs)
    assert adv.shape == ret.shape == rewards.shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.all(adv[mask == 0] == 0)
    assert torch.all(adv[9] == 0)  # the all-padding response


def test_estimators_do_not_track_gradients():
    rewards, mask = outcome_batch()
    rewards.requires_grad_(True)
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, UIDS)
    assert not adv.requires_grad


def test_uids_given_as_a_tensor_or_a_list_group_like_the_numpy_array():
    rewards, mask = outcome_batch()
    expected, _ = compute_grpo_outcome_advantage(rewards, mask, UIDS)
    as_ints = torch.tensor([ord(u) for u in UIDS])
    torch.testing.assert_close(compute_grpo_outcome_advantage(rewards, mask, as_ints)[0], expected)
    torch.testing.assert_close(compute_grpo_outcome_advantage(rewards, mask, list(UIDS))[0], expected)
