"""Shared data-parallel training helpers: metrics fetched once, the optimizer step guard, loss weights."""

from __future__ import annotations

import math

import pytest
import torch

from verl.workers.dp_training import clip_grad_norm, metrics_to_host, micro_batch_weight, step_if_finite


def test_metrics_to_host_turns_tensors_and_numbers_into_floats_in_place():
    micro = [
        {"actor/pg_loss": torch.tensor(0.25), "actor/kl_coef": 0.001},
        {"actor/pg_loss": torch.tensor([1.5], dtype=torch.float64), "actor/pg_clipfrac": torch.tensor(0.0)},
    ]
    out = metrics_to_host([*micro, {"grad_norm": torch.tensor(3.0)}])
    assert out == [
        {"actor/pg_loss": 0.25, "actor/kl_coef": 0.001},
        {"actor/pg_loss": 1.5, "actor/pg_clipfrac": 0.0},
        {"grad_norm": 3.0},
    ]
    assert all(type(v) is float for d in out for v in d.values())


def test_clip_then_step_only_on_a_finite_norm():
    layer = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer.weight.grad = torch.tensor([[3.0, 4.0, 0.0]], dtype=torch.float64)
    norm = clip_grad_norm(layer, grad_clip=1.0)
    assert isinstance(norm, torch.Tensor) and float(norm) == 5.0
    before = layer.weight.detach().clone()
    assert step_if_finite(optimizer, float(norm))
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6): exactly that, not 0.6 and 0.8, whose 2e-7 gap
    # passed or failed float64's tolerances depending on the unseeded initial weights (the test order)
    step = torch.tensor([[3.0, 4.0, 0.0]], dtype=torch.float64) / (5.0 + 1e-6)
    torch.testing.assert_close(layer.weight.detach(), before - step)
    layer.weight.grad = torch.tensor([[math.inf, 0.0, 0.0]], dtype=torch.float64)
    before = layer.weight.detach().clone()
    assert not step_if_finite(optimizer, float(clip_grad_norm(layer, grad_clip=1.0)))
    assert layer.weight.grad is None and torch.equal(layer.weight.detach(), before)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_weight_is_its_share_of_the_normaliser_times_the_ranks(mode):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    loss = torch.tensor(2.0, dtype=torch.float32)
    share = {"token-mean": 3, "seq-mean-token-mean": 2}[mode]
    weight = micro_batch_weight(mask, mode, normaliser=12.0, dp_size=4, loss=loss)
    assert weight.dtype == torch.float32 and float(weight) == pytest.approx(share / 12.0 * 4)
    assert float(micro_batch_weight(mask, mode, normaliser=0.0, dp_size=4, loss=loss)) == 0.0
