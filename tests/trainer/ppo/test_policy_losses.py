"""Every `actor.policy_loss.loss_mode` against a float64 per-token loop reference: values, metrics
and gradients."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from ppo_reference import agg_reference, agg_weights, rows, valid_positions

from verl.trainer.ppo.core_algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossParams,
    compute_policy_loss,
    compute_policy_loss_clip_cov,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)

DAPO = PolicyLossParams(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def make_batch(seed=0, batch=6, length=8, spread=0.6):
    """Random log-probs whose ratios land in every clipping regime, signed advantages, ragged mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(batch, length, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv[0, 0] = 0.0
    new[1, 1], adv[1, 1] = old[1, 1] + 1.5, -1.0  # ratio e^1.5 > clip_ratio_c: the dual clip binds
    new.requires_grad_(True)
    mask = torch.ones(batch, length, dtype=torch.float64)
    for i, n in enumerate([8, 5, 0, 3, 8, 6][:batch]):
        mask[i, n:] = 0
    mask[4, 2] = 0  # a masked token inside a response
    return old, new, adv, mask


def ppo_token_reference(a, r, p):
    """The clipped surrogate with dual clip, per token, written by cases; returns (loss, d loss/d log pi,
    clipped?, dual-clipped?)."""
    if a > 0:
        if r > 1 + p.high:
            return -a * (1 + p.high), 0.0, True, False
        return -a * r, -a * r, False, False
    if a < 0:
        if r < 1 - p.low:
            return -a * (1 - p.low), 0.0, True, False
        if r > p.clip_ratio_c:
            return -a * p.clip_ratio_c, 0.0, False, True
        return -a * r, -a * r, False, False
    return 0.0, 0.0, False, False


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vanilla_ppo_clip_higher_and_dual_clip_match_case_by_case_reference(mode):
    old, new, adv, mask = make_batch()
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, mode, DAPO)
    loss.backward()

    o, n, a, m = rows(old), rows(new), rows(adv), rows(mask)
    w = agg_weights(mask, mode)
    token_loss = [[0.0] * len(o[0]) for _ in o]
    grad = [[0.0] * len(o[0]) for _ in o]
    clipped = dual = kl = count = 0
    for i in range(len(o)):
        for t in range(len(o[0])):
            r = math.exp(n[i][t] - o[i][t])
            token_loss[i][t], g, c, d = ppo_token_reference(a[i][t], r, DAPO)
            grad[i][t] = g * w[i][t]
            if m[i][t]:
                clipped, dual, kl, count = clipped + c, dual + d, kl + o[i][t] - n[i][t], count + 1
    assert clipped > 0 and dual > 0, "the batch must exercise both clipping branches"
    assert loss.item() == pytest.approx(agg_reference(token_loss, mask, mode), rel=1e-12)
    torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64))
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / count)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(dual / count)
    assert metrics["ppo_kl"].item() == pytest.approx(kl / count)


def test_vanilla_with_symmetric_clip_hand_worked():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -2.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, m = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", PolicyLossParams(clip_ratio=0.2))
    # token 0: ratio 1.5 clipped to 1.2 -> -1.2; token 1: ratio 0.5 clipped to 0.8 -> 1.6; token 2: -1.1
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 1.1) / 3)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)


def test_truncated_importance_sampling_weights_each_token_by_capped_old_over_rollout_ratio():
    old, new, adv, mask = make_batch(seed=1)
    g = torch.Generator().manual_seed(7)
    rollout = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.8
    params = PolicyLossParams(clip_ratio=0.2, tis_imp_ratio_cap=1.5)
    loss, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", params, rollout_log_probs=rollout)
    o, n, a, ro = rows(old), rows(new), rows(adv), rows(rollout)
    weighted = [
        [
            ppo_token_reference(a[i][t], math.exp(n[i][t] - o[i][t]), params)[0]
            * min(math.exp(o[i][t] - ro[i][t]), 1.5)
            for t in range(len(o[0]))
        ]
        for i in range(len(o))
    ]
    assert loss.item() == pytest.approx(agg_reference(weighted, mask, "token-mean"), rel=1e-12)
    off, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", PolicyLossParams(tis_imp_ratio_cap=-1))
    plain, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean")
    assert off.item() == plain.item() != loss.item()


def test_gspo_uses_the_sequence_geometric_mean_ratio_for_every_token():
    old, new, adv, mask = make_batch(seed=2, spread=0.1)
    params = PolicyLossParams(clip_ratio_low=0.03, clip_ratio_high=0.04)
    mode = "seq-mean-token-mean"
    loss, metrics = compute_policy_loss_gspo(old, new, adv, mask, mode, params)
    loss.backward()
    o, n, a, m = rows(old), rows(new), rows(adv), rows(mask)
    w = agg_weights(mask, mode)
    token_loss = [[0.0] * len(o[0]) for _ in o]
    grad = [[0.0] * len(o[0]) for _ in o]
    clipped = count = 0
    for i in range(len(o)):
        pos = valid_positions(m[i])
        s = math.exp(sum(n[i][t] - o[i][t] for t in pos) / len(pos)) if pos else 1.0
        for t in range(len(o[0])):
            ai = a[i][t]
            is_clipped = (ai > 0 and s > 1 + params.high) or (ai < 0 and s < 1 - params.low)
            bound = 1 + params.high if ai > 0 else 1 - params.low
            token_loss[i][t] = -ai * (bound if is_clipped else s)
            grad[i][t] = 0.0 if is_clipped else -ai * s * w[i][t]  # straight-through: s * grad log pi
            if m[i][t]:
                clipped, count = clipped + is_clipped, count + 1
    assert 0 < clipped < count
    assert loss.item() == pytest.approx(agg_reference(token_loss, mask, mode), rel=1e-12)
    torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64))
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / count)


def test_gpg_loss_is_minus_advantage_times_log_prob():
    old, new, adv, mask = make_batch(seed=3)
    loss, _ = compute_policy_loss_gpg(old, new, adv, mask, "seq-mean-token-sum")
    loss.backward()
    token_loss = [[-a * lp for a, lp in zip(ra, rn)] for ra, rn in zip(rows(adv), rows(new))]
    assert loss.item() == pytest.approx(agg_reference(token_loss, mask, "seq-mean-token-sum"), rel=1e-12)
    w = agg_weights(mask, "seq-mean-token-sum")
    expected_grad = [[-a * wt for a, wt in zip(ra, rw)] for ra, rw in zip(rows(adv), w)]
    torch.testing.assert_close(new.grad, torch.tensor(expected_grad, dtype=torch.float64))


def covariance_reference(adv, new, mask):
    a, n, m = rows(adv), rows(new), rows(mask)
    cells = [(i, t) for i in range(len(a)) for t in valid_positions(m[i])]
    mean_a = sum(a[i][t] for i, t in cells) / len(cells)
    mean_n = sum(n[i][t] for i, t in cells) / len(cells)
    return {(i, t): (a[i][t] - mean_a) * (n[i][t] - mean_n) for i, t in cells}


def test_clip_cov_cuts_a_random_subset_of_high_covariance_tokens():
    old, new, adv, mask = make_batch(seed=4, batch=6, length=8)
    params = PolicyLossParams(clip_ratio=0.2, clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0)
    torch.manual_seed(0)
    loss, metrics = compute_policy_loss_clip_cov(old, new, adv, mask, "token-mean", params)
    loss.backward()

    cov = covariance_reference(adv, new, mask)
    o, n, a = rows(old), rows(new), rows(adv)
    no_dual = dataclasses.replace(params, clip_ratio_c=1e12)  # clip_cov has no dual clip
    candidates = []
    for (i, t), c in cov.items():
        r = math.exp(n[i][t] - o[i][t])
        ppo_clipped = ppo_token_reference(a[i][t], r, no_dual)[2]
        if params.clip_cov_lb < c < params.clip_cov_ub and not ppo_clipped:
            candidates.append((i, t))
    num_cut = max(int(params.clip_cov_ratio * len(cov)), 1)
    assert len(candidates) > num_cut, "the batch must have more candidates than cuts so the choice is random"
    # A cut token's loss is zeroed, so its gradient is exactly zero (candidates have A != 0, unclipped).
    cut = [(i, t) for i, t in candidates if new.grad[i, t] == 0]
    assert len(cut) == num_cut
    token_loss = [
        [
            0.0 if (i, t) in cut else ppo_token_reference(a[i][t], math.exp(n[i][t] - o[i][t]), no_dual)[0]
            for t in range(8)
        ]
        for i in range(6)
    ]
    assert loss.item() == pytest.approx(agg_reference(token_loss, mask, "token-mean"), rel=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(num_cut / len(cov))


def test_clip_cov_cuts_every_candidate_when_there_are_fewer_than_the_quota():
    old, new, adv, mask = make_batch(seed=5)
    params = PolicyLossParams(clip_cov_ratio=1.0, clip_cov_lb=0.3, clip_cov_ub=0.6)
    loss, metrics = compute_policy_loss_clip_cov(old, new, adv, mask, "token-mean", params)
    o, n, a = rows(old), rows(new), rows(adv)
    no_dual = dataclasses.replace(params, clip_ratio_c=1e12)
    cov = covariance_reference(adv, new, mask)
    cut = {
        (i, t)
        for (i, t), c in cov.items()
        if 0.3 < c < 0.6 and not ppo_token_reference(a[i][t], math.exp(n[i][t] - o[i][t]), no_dual)[2]
    }
    assert cut
    token_loss = [
        [
            0.0 if (i, t) in cut else ppo_token_reference(a[i][t], math.exp(n[i][t] - o[i][t]), no_dual)[0]
            for t in range(8)
        ]
        for i in range(6)
    ]
    assert loss.item() == pytest.approx(agg_reference(token_loss, mask, "token-mean"), rel=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(len(cut) / len(cov))


def test_kl_cov_adds_abs_log_ratio_penalty_to_the_top_covariance_tokens():
    old, new, adv, mask = make_batch(seed=6)
    params = PolicyLossParams(kl_cov_ratio=0.2, ppo_kl_coef=0.5)
    loss, metrics = compute_policy_loss_kl_cov(old, new, adv, mask, "seq-mean-token-mean", params)
    cov = covariance_reference(adv, new, mask)
    k = max(1, int(len(cov) * params.kl_cov_ratio))
    top = set(sorted(cov, key=cov.get, reverse=True)[:k])
    o, n, a = rows(old), rows(new), rows(adv)
    token_loss = [
        [
            -a[i][t] * math.exp(n[i][t] - o[i][t]) + (0.5 * abs(n[i][t] - o[i][t]) if (i, t) in top else 0.0)
            for t in range(8)
        ]
        for i in range(6)
    ]
    assert loss.item() == pytest.approx(agg_reference(token_loss, mask, "seq-mean-token-mean"), rel=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(sum(abs(n[i][t] - o[i][t]) for i, t in cov) / len(cov))
    assert metrics["pg_clipfrac"].item() == pytest.approx(k / len(cov))


def test_geo_mean_hand_worked_single_response():
    # log-ratios 0.5 (clipped to 0.4 on the A>0 side) and -0.1: geometric-mean ratio exp((0.4 - 0.1) / 2).
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[0.5, -0.1, 7.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, 2.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    params = PolicyLossParams(clip_ratio_low=0.4, clip_ratio_high=0.4)
    loss, m = compute_policy_loss_geo_mean(old, new, adv, mask, params=params)
    assert loss.item() == pytest.approx(-2.0 * math.exp(0.15))
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    assert m["pg_clipfrac_lower"].item() == 0.0


def test_geo_mean_matches_loop_reference():
    old, new, adv, mask = make_batch(seed=7, spread=0.3)
    params = PolicyLossParams(clip_ratio_low=0.1, clip_ratio_high=0.15)
    loss, metrics = compute_policy_loss_geo_mean(old, new, adv, mask, params=params)
    o, n, a, m = rows(old), rows(new), rows(adv), rows(mask)
    per_seq, upper, lower, count = [], 0, 0, 0
    for i in range(len(o)):
        pos = valid_positions(m[i])
        if not pos:
            continue
        total = 0.0
        for t in pos:
            x = n[i][t] - o[i][t]
            x_clip = min(max(x, -params.low), params.high)
            # the clip binds only on the side the advantage pushes the ratio
            total += min(x, x_clip) if a[i][t] > 0 else max(x, x_clip) if a[i][t] < 0 else 0.0
            upper += x != x_clip and a[i][t] > 0
            lower += x != x_clip and a[i][t] < 0
            count += 1
        mean_adv = sum(a[i][t] for t in pos) / len(pos)
        per_seq.append(-mean_adv * math.exp(total / len(pos)))
    assert loss.item() == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(upper / count)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(lower / count)


def test_geo_mean_refuses_truncated_importance_sampling():
    old, new, adv, mask = make_batch()
    with pytest.raises(ValueError, match="tis_imp_ratio_cap"):
        compute_policy_loss_geo_mean(
            old, new, adv, mask, params=PolicyLossParams(tis_imp_ratio_cap=2.0), rollout_log_probs=old
        )


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_returns_scalar_and_the_three_metrics_and_is_finite_on_an_all_padding_batch(name):
    old, new, adv, mask = make_batch()
    loss_fn = get_policy_loss_fn(name)
    # dro has no default strength (upstream's dro_beta is null and refused for it)
    params = PolicyLossParams(dro_beta=0.1) if name == "dro" else None

    def fn(*args):
        return loss_fn(*args, params=params) if params is not None else loss_fn(*args)

    loss, metrics = fn(old, new, adv, mask)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} <= set(metrics)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    empty = torch.zeros_like(mask)
    loss, metrics = fn(old, new, adv, empty)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(new.grad == 0)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_unknown_loss_mode_error_lists_the_valid_names():
    with pytest.raises(ValueError) as err:
        get_policy_loss_fn("ppo")
    assert all(name in str(err.value) for name in POLICY_LOSSES)


def test_register_policy_loss_adds_to_the_table_and_refuses_to_shadow():
    @register_policy_loss("test_only_double_vanilla")
    def double(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", params=None, **_):
        loss, m = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params)
        return 2 * loss, m

    try:
        assert get_policy_loss_fn("test_only_double_vanilla") is double
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("vanilla")(double)
    finally:
        POLICY_LOSSES.pop("test_only_double_vanilla")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(clip_ratio=-0.1), "clip_ratio"),
        (dict(clip_cov_ratio=0.0), "clip_cov_ratio"),
        (dict(clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb"),
    ],
)
def test_invalid_policy_loss_params_are_rejected_with_the_config_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossParams(**kwargs)


def test_legacy_compute_policy_loss_returns_upstream_four_tuple():
    old, new, adv, mask = make_batch()
    loss, clipfrac, kl, lower = compute_policy_loss(old, new, adv, mask, cliprange=0.2, cliprange_high=0.28)
    ref_loss, m = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", DAPO)
    assert loss.item() == ref_loss.item()
    assert (clipfrac, kl, lower) == (m["pg_clipfrac"], m["ppo_kl"], m["pg_clipfrac_lower"])


def test_params_from_an_actor_config_read_upstream_keys_and_keep_defaults_for_the_rest():
    import types

    cfg = {
        "clip_ratio": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 10.0,
        "tis_imp_ratio_cap": -1,
        "policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0},
    }
    params = PolicyLossParams.from_actor_config(cfg)
    assert (params.low, params.high, params.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert (params.kl_cov_ratio, params.ppo_kl_coef, params.clip_cov_ub) == (0.002, 1.0, 5.0)
    assert not params.tis_enabled
    attr_style = types.SimpleNamespace(clip_ratio=0.1, policy_loss=types.SimpleNamespace(clip_cov_lb=2.0))
    params = PolicyLossParams.from_actor_config(attr_style)
    assert (params.low, params.high, params.clip_cov_lb) == (0.1, 0.1, 2.0)
