"""Upstream's `compute_rewards` and `kl_penalty_forward`, against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.ppo.core_algos import compute_rewards, kl_penalty, kl_penalty_forward


def test_compute_rewards_subtracts_kl_ratio_times_the_log_ratio_everywhere():
    scores = torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -1.0]], dtype=torch.float64)
    # log ratios 0.5, -1, 0, -2; beta 0.1
    expected = torch.tensor([[-0.05, 1.1], [2.0, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(compute_rewards(scores, old, ref, 0.1), expected, rtol=1e-12, atol=1e-15)


def test_kl_penalty_forward_keeps_the_estimators_own_gradient_where_plus_swaps_it():
    ref = torch.tensor([0.0], dtype=torch.float64)
    logp = torch.tensor([math.log(2.0)], dtype=torch.float64, requires_grad=True)
    forward = kl_penalty_forward(logp, ref, "k3+")
    # k3 with x = log pi - log pi_ref = ln 2: e^{-x} + x - 1 = 0.5 + ln 2 - 1; d/dx = 1 - e^{-x} = 0.5
    assert forward.item() == pytest.approx(math.log(2.0) - 0.5, rel=1e-12)
    (grad_forward,) = torch.autograd.grad(forward.sum(), logp)
    (grad_plus,) = torch.autograd.grad(kl_penalty(logp, ref, "k3+").sum(), logp)
    assert grad_forward.item() == pytest.approx(0.5, rel=1e-12)
    assert grad_plus.item() == pytest.approx(math.log(2.0), rel=1e-12)  # k2's gradient: x


def test_kl_penalty_forward_rejects_unknown_names_listing_the_valid_ones():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty_forward(torch.zeros(1), torch.zeros(1), "k4")
