"""The policy losses `cispo`, `sapo` and `bypass_mode`, the rollout-correction weights every loss
takes, and `loss_scale_factor`, against float64 per-token loop references and hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch
from ppo_reference import agg_reference, agg_weights, rows, valid_positions
from test_policy_losses import make_batch

from verl.trainer.ppo.core_algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossParams,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_cispo,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
)
from verl.trainer.ppo.rollout_corr_helper import RolloutCorrectionConfig

DAPO = PolicyLossParams(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------------------------- CISPO


def test_cispo_hand_worked_token_keeps_its_gradient_where_ppo_clips_it():
    # ratio 0.8 / 0.5 = 1.6 > 1 + 0.28: PPO's surrogate is flat there, CISPO's weight is clipped to 1.28
    old = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    new = torch.tensor([[math.log(0.8)]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    loss, metrics = compute_policy_loss_cispo(old, new, adv, mask, "token-mean", DAPO)
    loss.backward()
    assert loss.item() == pytest.approx(-1.28 * 2.0 * math.log(0.8), rel=1e-12)
    assert new.grad.item() == pytest.approx(-1.28 * 2.0, rel=1e-12)
    assert metrics["pg_clipfrac"].item() == 1.0
    new_ppo = new.detach().clone().requires_grad_(True)
    compute_policy_loss_vanilla(old, new_ppo, adv, mask, "token-mean", DAPO)[0].backward()
    assert new_ppo.grad.item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_matches_loop_reference_values_gradients_and_clipfrac(mode):
    old, new, adv, mask = make_batch(seed=3, spread=0.5)
    loss, metrics = compute_policy_loss_cispo(old, new, adv, mask, mode, DAPO)
    loss.backward()
    o, n, a, m = rows(old), rows(new), rows(adv), rows(mask)
    w = agg_weights(mask, mode)
    token_loss = [[0.0] * len(o[0]) for _ in o]
    grad = [[0.0] * len(o[0]) for _ in o]
    clipped = count = 0
    for i in range(len(o)):
        for t in range(len(o[0])):
            r = math.exp(n[i][t] - o[i][t])
            c = min(max(r, 1 - 0.2), 1 + 0.28)
            token_loss[i][t] = -c * a[i][t] * n[i][t]
            grad[i][t] = -c * a[i][t] * w[i][t]
            if m[i][t]:
                clipped, count = clipped + (c != r), count + 1
    assert loss.item() == pytest.approx(agg_reference(token_loss, mask, mode), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / count)


# ----------------------------------------------------------------------------------------------- SAPO


def test_sapo_gate_has_ppos_slope_at_ratio_one_and_fades_away_from_it():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[0.0, 1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    params = PolicyLossParams(tau_pos=2.0, tau_neg=3.0)
    loss, _ = compute_policy_loss_sapo(old, new, adv, mask, "seq-mean-token-mean", params)
    loss.backward()
    # d loss / d log pi_t = -A * 4 sigma(tau(r-1))(1 - sigma(tau(r-1))) * r, divided by the 3 tokens
    for t, (r, a, tau) in enumerate([(1.0, 1.0, 2.0), (math.e, 1.0, 2.0), (math.exp(-1), -1.0, 3.0)]):
        s = _sigmoid(tau * (r - 1))
        assert new.grad[0, t].item() == pytest.approx(-a * 4 * s * (1 - s) * r / 3, rel=1e-12)
    assert new.grad[0, 0].item() == pytest.approx(-1 / 3, rel=1e-12)  # PPO's gradient -A at ratio 1
    value = sum(
        -(4 / tau) * _sigmoid(tau * (r - 1)) * a for r, a, tau in [(1, 1, 2), (math.e, 1, 2), (math.exp(-1), -1, 3)]
    )
    assert loss.item() == pytest.approx(value / 3, rel=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_sapo_matches_loop_reference_and_always_aggregates_seq_mean_token_mean(mode):
    old, new, adv, mask = make_batch(seed=5, spread=0.8)
    params = PolicyLossParams(tau_pos=1.0, tau_neg=1.05)
    loss, metrics = compute_policy_loss_sapo(old, new, adv, mask, mode, params)
    loss.backward()
    o, n, a = rows(old), rows(new), rows(adv)
    w = agg_weights(mask, "seq-mean-token-mean")
    token_loss = [[0.0] * len(o[0]) for _ in o]
    grad = [[0.0] * len(o[0]) for _ in o]
    for i in range(len(o)):
        for t in range(len(o[0])):
            r = math.exp(n[i][t] - o[i][t])
            tau = 1.0 if a[i][t] > 0 else 1.05
            s = _sigmoid(tau * (r - 1))
            token_loss[i][t] = -(4 / tau) * s * a[i][t]
            grad[i][t] = -a[i][t] * 4 * s * (1 - s) * r * w[i][t]
    assert loss.item() == pytest.approx(agg_reference(token_loss, mask, "seq-mean-token-mean"), rel=1e-10)
    torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == 0.0


def test_sapo_temperatures_select_by_advantage_sign_and_change_the_loss():
    old, new, adv, mask = make_batch(seed=1, spread=0.8)
    base, _ = compute_policy_loss_sapo(old, new, adv, mask, params=PolicyLossParams(tau_pos=1.0, tau_neg=1.05))
    only_neg = adv.clamp(max=0.0)
    a, _ = compute_policy_loss_sapo(old, new, only_neg, mask, params=PolicyLossParams(tau_pos=1.0, tau_neg=1.05))
    b, _ = compute_policy_loss_sapo(old, new, only_neg, mask, params=PolicyLossParams(tau_pos=7.0, tau_neg=1.05))
    c, _ = compute_policy_loss_sapo(old, new, only_neg, mask, params=PolicyLossParams(tau_pos=1.0, tau_neg=4.0))
    assert a.item() == b.item()  # tau_pos does not touch negative advantages
    assert a.item() != pytest.approx(c.item())
    assert base.item() != pytest.approx(a.item())


@pytest.mark.parametrize("kwargs, match", [(dict(tau_pos=0.0), "tau_pos"), (dict(loss_scale_factor=0), "loss_scale")])
def test_invalid_sapo_and_scale_params_are_rejected_with_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossParams(**kwargs)


# ------------------------------------------------------------------------------------ bypass mode


def test_bypass_ppo_clip_equals_vanilla_against_the_rollout_and_reports_the_gap():
    rollout, new, adv, mask = make_batch(seed=2)
    loss, metrics = compute_policy_loss_bypass_mode(rollout, new, adv, mask, "token-mean", DAPO)
    ref, ref_metrics = compute_policy_loss_vanilla(rollout, new.detach(), adv, mask, "token-mean", DAPO)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert metrics["pg_clipfrac"].item() == ref_metrics["pg_clipfrac"].item()
    n, r, m = rows(new), rows(rollout), rows(mask)
    diffs = [r[i][t] - n[i][t] for i in range(len(n)) for t in valid_positions(m[i])]
    assert metrics["rollout_corr/kl"].item() == pytest.approx(sum(diffs) / len(diffs), rel=1e-10)


def test_bypass_reinforce_with_sequence_is_and_token_rejection_matches_loop_reference():
    rollout, new, adv, mask = make_batch(seed=4, spread=0.3)
    rc = RolloutCorrectionConfig(
        rollout_is="sequence",
        rollout_is_threshold=1.5,
        rollout_rs="token_k2",
        rollout_rs_threshold=0.02,
        bypass_mode=True,
        loss_type="reinforce",
    )
    params = PolicyLossParams(rollout_correction=rc)
    loss, metrics = compute_policy_loss_bypass_mode(rollout, new, adv, mask, "token-mean", params)
    loss.backward()
    n, r, a, m = rows(new), rows(rollout), rows(adv), rows(mask)
    n_tokens = sum(len(valid_positions(mm)) for mm in m)
    token_loss, grad, rejected = 0.0, [[0.0] * len(n[0]) for _ in n], 0
    for i in range(len(n)):
        pos = valid_positions(m[i])
        w = min(math.exp(sum(n[i][t] - r[i][t] for t in pos)), 1.5)
        for t in pos:
            kept = 0.5 * (n[i][t] - r[i][t]) ** 2 <= 0.02
            rejected += not kept
            token_loss += -a[i][t] * n[i][t] * w * kept / n_tokens
            grad[i][t] = -a[i][t] * w * kept / n_tokens
    assert 0 < rejected < n_tokens  # the threshold bites, but not everywhere
    assert loss.item() == pytest.approx(token_loss, rel=1e-10)
    torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(rejected / n_tokens)


def test_bypass_mode_is_read_from_the_actor_config_handed_over_by_the_trainer():
    cfg = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce"}}}
    params = PolicyLossParams.from_actor_config(cfg)
    assert params.rollout_correction == RolloutCorrectionConfig(loss_type="reinforce")


# ---------------------------------------------------------------------- rollout-correction weights


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "cispo", "sapo", "kl_cov"])
def test_every_token_level_loss_multiplies_each_tokens_term_by_its_rollout_is_weight(name):
    """Linearity check: with weights w the loss equals the sum of single-token losses times w."""
    old, new, adv, mask = make_batch(seed=7)
    fn = get_policy_loss_fn(name)
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
    weighted, _ = fn(old, new, adv, mask, "seq-mean-token-sum", rollout_is_weights=weights)
    expected = 0.0
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        one_hot = torch.zeros_like(mask)
        one_hot[i, t] = 1.0
        single, _ = fn(old, new, adv, mask, "seq-mean-token-sum", rollout_is_weights=one_hot)
        expected += weights[i, t].item() * single.item()
    assert weighted.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    unweighted, _ = fn(old, new, adv, mask, "seq-mean-token-sum")
    assert weighted.item() != pytest.approx(unweighted.item())


def test_geo_mean_scales_each_response_by_the_geometric_mean_of_its_weights():
    old, new, adv, mask = make_batch(seed=8)
    weights = torch.full_like(mask, 2.0)
    weights[0] = 0.5
    fn = POLICY_LOSSES["geo_mean"]
    keep_first = torch.zeros_like(mask)
    keep_first[0] = mask[0]
    rest = mask - keep_first
    a, _ = fn(old, new, adv, keep_first)
    b, _ = fn(old, new, adv, rest)
    n_first, n_rest = 1, int((rest.sum(-1) > 0).sum())
    total = (a * n_first + b * n_rest) / (n_first + n_rest)
    weighted, _ = fn(old, new, adv, mask, rollout_is_weights=weights)
    expected = (0.5 * a * n_first + 2.0 * b * n_rest) / (n_first + n_rest)
    assert weighted.item() == pytest.approx(expected.item(), rel=1e-8)
    assert weighted.item() != pytest.approx(total.item())


def test_loss_scale_factor_is_seq_mean_token_sum_norms_constant_length():
    old, new, adv, mask = make_batch()
    default, _ = compute_policy_loss_vanilla(old, new, adv, mask, "seq-mean-token-sum-norm", DAPO)
    scaled, _ = compute_policy_loss_vanilla(
        old, new, adv, mask, "seq-mean-token-sum-norm", PolicyLossParams(clip_ratio_high=0.28, loss_scale_factor=3)
    )
    token_mean_plain, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", DAPO)
    token_mean_scaled, _ = compute_policy_loss_vanilla(
        old, new, adv, mask, "token-mean", PolicyLossParams(clip_ratio_high=0.28, loss_scale_factor=3)
    )
    length = mask.shape[-1]
    assert scaled.item() == pytest.approx(default.item() * length / 3, rel=1e-12)
    assert token_mean_scaled.item() == token_mean_plain.item()  # only the -norm mode has a length
