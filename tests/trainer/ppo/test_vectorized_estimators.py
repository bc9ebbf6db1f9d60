"""`grpo_vectorized` / `rloo_vectorized` against float64 loop references, and upstream's registry name."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from verl.trainer.ppo.core_algos import (
    ADV_ESTIMATOR_REGISTRY,
    ADV_ESTIMATORS,
    AdvantageEstimator,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
)

# groups: "a" four varied scores, "b" three identical ones, "c" a single response, "d" a pair
UIDS = np.array(["a", "b", "a", "c", "b", "a", "d", "b", "a", "d"], dtype=object)
SCORES = [1.0, 0.5, 0.0, 0.7, 0.5, 2.0, -1.0, 0.5, 0.25, 3.0]
LENGTHS = [6, 3, 5, 4, 2, 1, 6, 4, 3, 2]


def _batch():
    mask = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.float64)
    rewards = torch.zeros_like(mask)
    for i, (n, s) in enumerate(zip(LENGTHS, SCORES)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def _members(i):
    return [SCORES[j] for j in range(len(UIDS)) if UIDS[j] == UIDS[i]]


def _expected(per_sample, mask):
    return torch.tensor(per_sample, dtype=torch.float64).unsqueeze(-1) * mask


@pytest.mark.parametrize("normalize", [True, False])
def test_grpo_vectorized_matches_a_loop_reference(normalize):
    rewards, mask = _batch()
    eps = 1e-6
    expected = []
    for i in range(len(SCORES)):
        group = _members(i)
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.mean(group), max(statistics.variance(group), eps) ** 0.5
        expected.append((SCORES[i] - mean) / (std + eps) if normalize else SCORES[i] - mean)
    adv, ret = compute_grpo_vectorized_outcome_advantage(
        rewards, mask, UIDS, epsilon=eps, norm_adv_by_std_in_grpo=normalize
    )
    torch.testing.assert_close(adv, _expected(expected, mask), rtol=1e-6, atol=1e-6)
    assert torch.equal(adv, ret)
    assert torch.all(adv[[1, 4, 7]] == 0)  # identical scores


def test_grpo_vectorized_agrees_with_grpo_when_groups_vary():
    rewards, mask = _batch()
    varied = torch.tensor([0, 2, 3, 5, 6, 8, 9])  # groups a, c, d
    a, _ = compute_grpo_vectorized_outcome_advantage(rewards[varied], mask[varied], UIDS[varied.numpy()])
    b, _ = compute_grpo_outcome_advantage(rewards[varied], mask[varied], UIDS[varied.numpy()])
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_rloo_vectorized_matches_leave_one_out_and_zeroes_singletons():
    rewards, mask = _batch()
    expected = []
    for i in range(len(SCORES)):
        group = _members(i)
        others = list(group)
        others.remove(SCORES[i])
        expected.append(SCORES[i] - statistics.mean(others) if others else 0.0)
    adv, ret = compute_rloo_vectorized_outcome_advantage(rewards, mask, UIDS)
    torch.testing.assert_close(adv, _expected(expected, mask), rtol=1e-12, atol=1e-12)
    assert torch.all(adv[3] == 0) and torch.equal(adv, ret)


def test_registry_names():
    assert ADV_ESTIMATOR_REGISTRY is ADV_ESTIMATORS
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO_VECTORIZED) is compute_grpo_vectorized_outcome_advantage
    assert get_adv_estimator_fn("rloo_vectorized") is compute_rloo_vectorized_outcome_advantage
    with pytest.raises(ValueError, match="uids but the batch has"):
        compute_grpo_vectorized_outcome_advantage(*_batch(), UIDS[:3])
