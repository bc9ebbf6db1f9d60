"""The shared ending of the policy losses (`finish_policy_loss`), against a hand-worked example.

The losses themselves are checked through upstream's import path in tests/trainer/ppo; this file
checks only what is new: the one ending they all share (weights, aggregation, metrics).
"""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms.policy_losses import PolicyLossParams, finish_policy_loss, policy_loss_metrics

# Two responses of padded length 3: the first has 2 valid tokens, the second 1. Padding carries
# large values so that any leak into a result shows.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
PER_TOKEN = [[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]]
IS_WEIGHTS = [[0.5, 1.0, 7.0], [2.0, 7.0, 7.0]]
OLD = torch.zeros(2, 3, dtype=torch.float64)
# old - rollout = ln 2 (ratio 2, capped at 1.5), 0 (ratio 1) and -ln 2 (ratio 0.5)
ROLLOUT = torch.tensor([[-math.log(2), 0.0, 0.0], [math.log(2), 0.0, 0.0]], dtype=torch.float64)
KL = torch.tensor([[0.1, -0.3, 9.0], [0.5, 9.0, 9.0]], dtype=torch.float64)
# By hand: weighted valid losses 1 * 0.5 * 1.5 = 0.75 and 2 * 1 * 1 = 2 (row 0), 4 * 2 * 0.5 = 4 (row 1).
EXPECTED = {
    "token-mean": (0.75 + 2 + 4) / 3,
    "seq-mean-token-sum": ((0.75 + 2) + 4) / 2,
    "seq-mean-token-mean": ((0.75 + 2) / 2 + 4) / 2,
    "seq-mean-token-sum-norm": (0.75 + 2 + 4) / (2 * 3),  # B = 2 responses, L = padded length 3
}


def _finish(mode, params, **extra):
    losses = torch.tensor(PER_TOKEN, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor(IS_WEIGHTS, dtype=torch.float64, requires_grad=True)
    loss, metrics = finish_policy_loss(
        losses,
        MASK,
        mode,
        params,
        old_log_prob=OLD,
        rollout_log_probs=ROLLOUT,
        rollout_is_weights=weights,
        kl_per_token=KL,
        **extra,
    )
    return loss, metrics, losses, weights


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_finish_weights_by_rollout_is_and_capped_tis_then_aggregates(mode):
    loss, _, _, _ = _finish(mode, PolicyLossParams(tis_imp_ratio_cap=1.5))
    assert loss.item() == pytest.approx(EXPECTED[mode], rel=1e-12), (mode, loss.item())


def test_finish_uses_the_constant_length_of_seq_mean_token_sum_norm():
    loss, _, _, _ = _finish("seq-mean-token-sum-norm", PolicyLossParams(tis_imp_ratio_cap=1.5, loss_scale_factor=4.0))
    assert loss.item() == pytest.approx(6.75 / (2 * 4.0), rel=1e-12)


def test_finish_without_tis_cap_applies_only_the_rollout_is_weights():
    # tis off: weighted valid losses 0.5, 2 and 8
    loss, _, _, _ = _finish("token-mean", PolicyLossParams())
    assert loss.item() == pytest.approx((0.5 + 2 + 8) / 3, rel=1e-12)


def test_finish_gradient_reaches_the_losses_but_not_the_weights():
    loss, _, losses, weights = _finish("token-mean", PolicyLossParams(tis_imp_ratio_cap=1.5))
    loss.backward()
    expected = torch.tensor([[0.5 * 1.5, 1.0, 0.0], [2.0 * 0.5, 0.0, 0.0]], dtype=torch.float64) / 3
    torch.testing.assert_close(losses.grad, expected, rtol=1e-12, atol=0)
    assert weights.grad is None


def test_finish_reports_clip_fractions_and_ppo_kl_over_valid_tokens():
    clipped = torch.tensor([[True, False, True], [False, True, True]])
    clipped_lower = torch.tensor([[False, False, True], [True, True, True]])
    _, metrics, _, _ = _finish("token-mean", PolicyLossParams(), clipped=clipped, clipped_lower=clipped_lower)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 3, rel=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 3, rel=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx((0.1 - 0.3 + 0.5) / 3, rel=1e-12)
    assert all(m.dtype == torch.float64 and not m.requires_grad for m in metrics.values())


def test_a_loss_that_never_clips_reports_zero_clip_fractions():
    metrics = policy_loss_metrics(MASK, KL)
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(0.1, rel=1e-12)
