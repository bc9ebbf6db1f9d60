"""loss_mode=dro (upstream v0.9.0): -(A log pi - beta/2 (log pi - log pi_old)^2), values worked by hand."""

from __future__ import annotations

import pytest
import torch

from verl.algorithms.policy_losses import PolicyLossParams, get_policy_loss_fn
from verl.workers.config import PolicyLossConfig


def test_loss_gradient_and_kl_by_hand():
    old = torch.tensor([[0.0, -1.0]])
    new = torch.tensor([[0.5, -1.0]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, metrics = get_policy_loss_fn("dro")(old, new, adv, mask, "token-mean", params=PolicyLossParams(dro_beta=0.4))
    # token 1: -(0.5 * 2 - 0.2 * 0.5^2) = -0.95; token 2: -(-1 * -1 - 0) = -1; mean -0.975
    assert loss.item() == pytest.approx(-0.975)
    loss.backward()
    # d/dlogpi: -A + beta (logpi - old), halved by the mean: (-2 + 0.2) / 2, (1 + 0) / 2
    assert new.grad[0].tolist() == pytest.approx([-0.9, 0.5])
    assert metrics["ppo_kl"].item() == pytest.approx(-0.25)


def test_reads_dro_beta_from_the_actor_config_and_needs_it_positive():
    old = new = torch.zeros(1, 2)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    config = {"policy_loss": {"loss_mode": "dro", "dro_beta": 0.5}}
    loss, _ = get_policy_loss_fn("dro")(old, new, adv, mask, "token-mean", config)
    assert loss.item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="dro_beta"):
        get_policy_loss_fn("dro")(old, new, adv, mask, "token-mean", {"policy_loss": {"dro_beta": None}})
    with pytest.raises(ValueError, match="dro_beta"):
        PolicyLossConfig(loss_mode="dro")
    assert PolicyLossConfig(loss_mode="dro", dro_beta=0.1).dro_beta == 0.1
