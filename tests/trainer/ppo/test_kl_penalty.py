"""KL estimators (values and straight-through gradients), the in-reward KL penalty, the KL loss and
the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch
from ppo_reference import agg_reference, rows, valid_positions

from verl.trainer.ppo.core_algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_tensors,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
)

# Per-token formulas in terms of x = log pi - log pi_ref, and their derivatives d/d(log pi).
FORMULAS = {
    "kl": (lambda x: x, lambda x: 1.0),
    "abs": (lambda x: abs(x), lambda x: math.copysign(1.0, x)),
    "mse": (lambda x: 0.5 * x * x, lambda x: x),
    "low_var_kl": (lambda x: math.exp(-x) + x - 1, lambda x: 1 - math.exp(-x)),
}
ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def log_probs(seed=0, shape=(4, 5)):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(shape, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    ref = -torch.rand(shape, generator=g, dtype=torch.float64) * 2
    return logp, ref


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_estimator_values_and_gradients_match_their_formulas(name):
    value_fn, grad_fn = FORMULAS[ALIASES.get(name, name)]
    logp, ref = log_probs()
    kl = kl_penalty(logp, ref, name)
    kl.sum().backward()
    x = [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(rows(logp), rows(ref))]
    torch.testing.assert_close(kl, torch.tensor([[value_fn(v) for v in r] for r in x], dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor([[grad_fn(v) for v in r] for r in x], dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_straight_through_variant_has_the_estimators_value_and_the_k2_gradient(name):
    value_fn, _ = FORMULAS[ALIASES.get(name, name)]
    logp, ref = log_probs(seed=1)
    ref = ref.clone().requires_grad_(True)
    kl = kl_penalty(logp, ref, name + "+")
    kl.sum().backward()
    x = [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(rows(logp), rows(ref))]
    torch.testing.assert_close(kl, torch.tensor([[value_fn(v) for v in r] for r in x], dtype=torch.float64))
    # gradient of k2 = x^2 / 2: +x w.r.t. log pi, -x w.r.t. log pi_ref
    torch.testing.assert_close(logp.grad, torch.tensor(x, dtype=torch.float64))
    torch.testing.assert_close(ref.grad, -torch.tensor(x, dtype=torch.float64))


def test_low_var_kl_is_nonnegative_and_finite_for_extreme_log_ratios():
    logp = torch.tensor([[-100.0, 0.0, -1e-3]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -100.0, 0.0]], dtype=torch.float64)
    kl = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(kl).all() and (kl >= 0).all() and (kl <= 10).all()


def test_unknown_kl_estimator_error_lists_the_valid_names_with_plus_variants():
    with pytest.raises(ValueError) as err:
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")
    assert "k3+" in str(err.value) and "low_var_kl" in str(err.value)


def test_kl_penalty_in_reward_subtracts_beta_times_kl_on_valid_tokens_and_reports_mean_sequence_kl():
    old, ref = log_probs(seed=2)
    old = old.detach()
    scores = torch.zeros_like(old)
    scores[:, -1] = 1.0
    mask = torch.ones_like(old)
    mask[1, 3:] = 0
    mask[2, :] = 0
    rewards, current_kl = apply_kl_penalty_tensors(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    o, r, s, m = rows(old), rows(ref), rows(scores), rows(mask)
    expected = [[s[i][t] - (0.1 * (o[i][t] - r[i][t]) if m[i][t] else 0.0) for t in range(5)] for i in range(4)]
    torch.testing.assert_close(rewards, torch.tensor(expected, dtype=torch.float64))
    per_seq = []
    for i in range(4):
        pos = valid_positions(m[i])
        per_seq.append(sum(o[i][t] - r[i][t] for t in pos) / len(pos) if pos else 0.0)
    assert current_kl.item() == pytest.approx(sum(per_seq) / 4)


def test_kl_loss_aggregates_the_chosen_estimator():
    logp, ref = log_probs(seed=3)
    mask = torch.ones_like(ref)
    mask[0, 2:] = 0
    loss = compute_kl_loss(logp, ref, mask, kl_loss_type="low_var_kl", loss_agg_mode="seq-mean-token-mean")
    token = [[math.exp(b - a) + a - b - 1 for a, b in zip(ra, rb)] for ra, rb in zip(rows(logp), rows(ref))]
    assert loss.item() == pytest.approx(agg_reference(token, mask, "seq-mean-token-mean"), rel=1e-12)


def test_adaptive_kl_controller_hand_worked():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.2, n_steps=10)  # error clipped to +0.2 -> x(1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=torch.tensor(0.09), n_steps=10)  # error -0.1 -> x0.99
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    ctrl.update(current_kl=0.0, n_steps=50)  # error clipped to -0.2 -> x0.9
    assert ctrl.value == pytest.approx(0.102 * 0.99 * 0.9)


def test_fixed_kl_controller_never_changes_and_factory_builds_both():
    ctrl = get_kl_controller("fixed", kl_coef=0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert isinstance(ctrl, FixedKLController) and ctrl.value == 0.05
    assert isinstance(get_kl_controller("adaptive", 0.05, target_kl=0.1, horizon=10000), AdaptiveKLController)


@pytest.mark.parametrize(
    "args, match",
    [
        (("sliding", 0.1), "adaptive"),
        (("adaptive", 0.1, 0.1, 0), "horizon"),
        (("adaptive", 0.1, None, 10), "target_kl"),
    ],
)
def test_kl_controller_config_errors_name_the_key(args, match):
    with pytest.raises(ValueError, match=match):
        get_kl_controller(*args)
