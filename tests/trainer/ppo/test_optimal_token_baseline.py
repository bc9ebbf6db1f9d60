"""`algorithm.adv_estimator=optimal_token_baseline` (and its multi-turn variant) against a hand-worked
example and a float64 loop reference; `sum_pi_squared_from_logits` against the softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ppo_reference import rows, valid_positions

from verl.trainer.ppo.core_algos import (
    compute_advantage_from_tensors,
    compute_grpo_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
    get_adv_estimator_fn,
)
from verl.utils.torch_functional import sum_pi_squared_from_logits

D = torch.float64


def test_hand_worked_group_of_two_weights_the_high_variance_path():
    # Row a: confident tokens (pi 0.9, sum pi^2 0.82 -> |s|^2 = 1 - 1.8 + 0.82 = 0.02), reward 1.
    # Row b: uncertain tokens (pi 0.5, sum pi^2 0.5 -> |s|^2 = 0.5), reward 0.
    # W_a = [0.02, 0.04], W_b = [0.5, 1.0]; G_a = [1, 1], G_b = [0, 0];
    # B_0 = 0.02 / 0.52 = 1/26, B_1 = 0.04 / 1.04 = 1/26.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=D)
    mask = torch.ones(2, 2, dtype=D)
    old = torch.log(torch.tensor([[0.9, 0.9], [0.5, 0.5]], dtype=D))
    spp = torch.tensor([[0.82, 0.82], [0.5, 0.5]], dtype=D)
    adv, ret = compute_optimal_token_baseline_advantage(rewards, mask, np.array(["p", "p"]), old, spp, epsilon=0.0)
    b = 1 / 26
    torch.testing.assert_close(adv, torch.tensor([[1 - b, 1 - b], [-b, -b]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=D))
    # the group mean (GRPO without std) would be 0.5: the baseline leans to the row whose gradient is larger
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["p", "p"]), norm_adv_by_std_in_grpo=False)
    assert grpo[0, 0].item() == pytest.approx(0.5)


def otb_reference(rewards, mask, old, spp, uids, weights=None, zero_tail=False, eps=1e-8, align=False):
    """The estimator by loops: per row its return to go and cumulative |s|^2 at each position (a
    column, or with `align` the k-th valid token), per group and position the W-weighted mean."""
    r, m, lp, s = rows(rewards), rows(mask), rows(old), rows(spp)
    w_is = rows(weights) if weights is not None else None
    per_row = []  # [(positions, G, W)]
    for i in range(len(r)):
        pos = valid_positions(m[i]) if align else list(range(len(r[i])))
        g_all, running = [0.0] * len(r[i]), 0.0
        for t in reversed(range(len(r[i]))):
            running += r[i][t] * m[i][t]
            g_all[t] = running
        w_all, acc = [0.0] * len(r[i]), 0.0
        for t in range(len(r[i])):
            x = (1 - 2 * math.exp(lp[i][t]) + s[i][t]) * (w_is[i][t] ** 2 if w_is else 1.0)
            acc += x * m[i][t]
            w_all[t] = acc
        per_row.append((pos, g_all, w_all))
    adv = [[0.0] * len(r[0]) for _ in r]
    groups: dict = {}
    for i, u in enumerate(uids):
        groups.setdefault(u, []).append(i)
    for members in groups.values():
        if align:
            members = [i for i in members if valid_positions(m[i])]
        lengths = {i: len(valid_positions(m[i])) for i in members}
        for i in members:
            pos, g_all, w_all = per_row[i]
            for k, t in enumerate(pos):
                if not m[i][t]:
                    continue
                if len(members) == 1:
                    b = 0.0
                else:
                    num = den = 0.0
                    for j in members:
                        pj, gj, wj = per_row[j]
                        if k < len(pj) and m[j][pj[k]]:
                            num += gj[pj[k]] * wj[pj[k]]
                            den += wj[pj[k]]
                    b = num / (den + eps)
                    if zero_tail:
                        ordered = sorted(lengths.values())
                        unique_longest = ordered[-1] > ordered[-2] and lengths[i] == ordered[-1]
                        position = k if align else t
                        if unique_longest and position >= ordered[-2]:
                            b = 0.0
                adv[i][t] = g_all[t] - b
    return torch.tensor(adv, dtype=D)


def random_batch(seed=0, multi_turn=False):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 3, 6, 0, 5, 4, 2, 6]
    uids = np.array(["a", "a", "a", "b", "b", "c", "d", "d"], dtype=object)
    mask = torch.zeros(len(lengths), 6, dtype=D)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    if multi_turn:
        mask[0, 2] = mask[2, 1] = mask[4, 3] = 0  # tool output inside responses
    rewards = torch.zeros_like(mask)
    for i, n in enumerate(lengths):
        if n:
            rewards[i, n - 1] = float(torch.rand((), generator=g, dtype=D))
    rewards[1, 0] = 0.3  # a non-final token reward
    old = -torch.rand(mask.shape, generator=g, dtype=D) * 2
    spp = torch.rand(mask.shape, generator=g, dtype=D) * 0.5 + 0.05
    weights = torch.rand(mask.shape, generator=g, dtype=D) + 0.5
    return rewards, mask, old, spp, uids, weights


@pytest.mark.parametrize("zero_tail", [False, True])
@pytest.mark.parametrize("with_weights", [False, True])
def test_optimal_token_baseline_matches_loop_reference(zero_tail, with_weights):
    rewards, mask, old, spp, uids, weights = random_batch()
    w = weights if with_weights else None
    adv, ret = compute_optimal_token_baseline_advantage(rewards, mask, uids, old, spp, w, handle_zero_tail=zero_tail)
    torch.testing.assert_close(adv, otb_reference(rewards, mask, old, spp, uids, w, zero_tail), rtol=1e-12, atol=1e-12)
    assert ret[1, 0].item() == pytest.approx(0.3 + rewards[1, 2].item())
    assert torch.all(adv[mask == 0] == 0)
    # a group of one ("c") keeps its return: baseline 0
    torch.testing.assert_close(adv[5], ret[5] * mask[5])


def test_zero_tail_only_changes_the_longest_responses_tail():
    rewards, mask, old, spp, uids, _ = random_batch(seed=1)
    plain, _ = compute_optimal_token_baseline_advantage(rewards, mask, uids, old, spp)
    tail, ret = compute_optimal_token_baseline_advantage(rewards, mask, uids, old, spp, handle_zero_tail=True)
    # group "d": rows 6 (2 tokens) and 7 (6 tokens): row 7 past column 2 has baseline 0
    torch.testing.assert_close(tail[7, 2:], ret[7, 2:])
    assert not torch.allclose(plain[7, 2:], ret[7, 2:])
    changed = (tail != plain).any(dim=-1).nonzero().flatten().tolist()
    assert changed == [4, 7]  # group "b": row 4 (5 tokens) alone beside the empty row 3


@pytest.mark.parametrize("zero_tail", [False, True])
def test_multi_turn_variant_aligns_generated_tokens_across_responses(zero_tail):
    rewards, mask, old, spp, uids, weights = random_batch(seed=2, multi_turn=True)
    adv, ret = compute_multi_turn_optimal_token_baseline_advantage(
        rewards, mask, uids, old, spp, weights, handle_zero_tail=zero_tail
    )
    expected = otb_reference(rewards, mask, old, spp, uids, weights, zero_tail, align=True)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    column_aligned, _ = compute_optimal_token_baseline_advantage(rewards, mask, uids, old, spp, weights)
    assert not torch.allclose(adv, column_aligned)  # the gaps move later tokens to other positions


def test_estimator_table_names_and_missing_input_error():
    assert get_adv_estimator_fn("optimal_token_baseline") is compute_optimal_token_baseline_advantage
    assert get_adv_estimator_fn("tir_optimal_token_baseline") is compute_multi_turn_optimal_token_baseline_advantage
    rewards, mask, *_ = random_batch()
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=true"):
        compute_advantage_from_tensors(
            "optimal_token_baseline", token_level_rewards=rewards, response_mask=mask, index=["a"] * 8
        )


def test_sum_pi_squared_from_logits_equals_the_softmax_collision_probability():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=D) * 4
    expected = torch.softmax(logits, dim=-1).square().sum(-1)
    torch.testing.assert_close(sum_pi_squared_from_logits(logits, chunk_size=2), expected, rtol=1e-12, atol=0)
    sliced = logits[:, :-1]  # a view that cannot be flattened without a copy
    torch.testing.assert_close(sum_pi_squared_from_logits(sliced), expected[:, :-1], rtol=1e-12, atol=0)
    one_hot = torch.full((1, 4), -1e4, dtype=torch.float32)
    one_hot[0, 2] = 0
    assert sum_pi_squared_from_logits(one_hot).item() == pytest.approx(1.0)
    assert sum_pi_squared_from_logits(torch.zeros(1, 4)).item() == pytest.approx(0.25)
