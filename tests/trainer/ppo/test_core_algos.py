"""Loss aggregation, value loss, entropy loss and explained variance against float64 loop references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from ppo_reference import agg_reference, rows, valid_positions

from verl.trainer.ppo.core_algos import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_value_loss,
    explained_variance,
)


def ragged(seed=0, batch=5, length=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, length, dtype=torch.float64)
    for i, n in enumerate([6, 2, 0, 4, 5][:batch]):
        mask[i, n:] = 0
    mask[3, 1] = 0
    return x, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_loop_reference_and_skips_empty_responses(mode):
    loss_mat, mask = ragged()
    loss_mat[mask == 0] = float("nan")  # padding must be ignored exactly, even when it holds NaN
    assert agg_loss(loss_mat, mask, mode).item() == pytest.approx(agg_reference(loss_mat, mask, mode), rel=1e-12)


def test_agg_loss_hand_worked():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=5).item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_of_an_all_padding_batch_is_zero_with_zero_gradient(mode):
    loss_mat = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(3, 4), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(loss_mat.grad == 0)


def test_unknown_agg_mode_error_lists_the_valid_modes():
    with pytest.raises(ValueError) as err:
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-sum")
    assert all(mode in str(err.value) for mode in LOSS_AGG_MODES)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_is_half_the_worse_of_clipped_and_unclipped_squared_error(mode):
    values, mask = ragged(seed=1)
    g = torch.Generator().manual_seed(2)
    vpreds = values + torch.randn(values.shape, generator=g, dtype=torch.float64) * 0.5
    returns = values + torch.randn(values.shape, generator=g, dtype=torch.float64)
    c = 0.2
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=c, loss_agg_mode=mode)
    v, p, r, m = rows(values), rows(vpreds), rows(returns), rows(mask)
    token_loss, clipped, count = [], 0, 0
    for i in range(len(v)):
        row = []
        for t in range(len(v[0])):
            p_clip = min(max(p[i][t], v[i][t] - c), v[i][t] + c)
            a, b = (p[i][t] - r[i][t]) ** 2, (p_clip - r[i][t]) ** 2
            row.append(max(a, b))
            if m[i][t]:
                clipped, count = clipped + (b > a), count + 1
        token_loss.append(row)
    assert 0 < clipped < count
    assert loss.item() == pytest.approx(0.5 * agg_reference(token_loss, mask, mode), rel=1e-12)
    assert clipfrac.item() == pytest.approx(clipped / count)


def test_entropy_loss_is_the_aggregated_token_entropy():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 6, 11, generator=g, dtype=torch.float64)
    _, mask = ragged()
    entropies = []
    for row in logits.tolist():
        per_token = []
        for z in row:
            top = max(z)
            total = sum(math.exp(v - top) for v in z)
            per_token.append(-sum(math.exp(v - top) / total * (v - top - math.log(total)) for v in z))
        entropies.append(per_token)
    for mode in LOSS_AGG_MODES:
        got = compute_entropy_loss(logits, mask, mode).item()
        assert got == pytest.approx(agg_reference(entropies, mask, mode), rel=1e-12)


def test_explained_variance_matches_unbiased_variances_over_valid_tokens():
    returns, mask = ragged(seed=4)
    values = returns * 0.5 + 0.1
    r, v, m = rows(returns), rows(values), rows(mask)
    cells = [(i, t) for i in range(len(r)) for t in valid_positions(m[i])]
    residual = statistics.variance([r[i][t] - v[i][t] for i, t in cells])
    expected = 1 - residual / (statistics.variance([r[i][t] for i, t in cells]) + 1e-5)
    assert explained_variance(values, returns, mask).item() == pytest.approx(expected, rel=1e-12)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
