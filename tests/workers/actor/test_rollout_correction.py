"""Train/rollout mismatch: the truncated-importance-sampling correction (`actor.tis_imp_ratio_cap`)
as the actor applies it, and the per-step mismatch metrics (`training/rollout_probs_diff_*`).

References are computed another way: a hand-worked float64 example, and an actor without the
correction whose advantages are pre-multiplied by the expected weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, make_tiny_causal_lm, one_thread, reference_response_log_probs
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import PolicyLossParams, compute_policy_loss_vanilla
from verl.trainer.ppo.driver_math import rollout_mismatch_metrics as _rollout_mismatch_metrics
from verl.workers.actor import DataParallelPPOActor

TEMPERATURE = 0.7
pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def test_tis_hand_worked_float64_example():
    # one sequence, three tokens, ratio 1 (old == new), so the PPO loss per token is -A
    old = torch.log(torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.1]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    params = PolicyLossParams(clip_ratio=0.2, tis_imp_ratio_cap=3.0)
    loss, _ = compute_policy_loss_vanilla(old, old.clone(), adv, mask, "token-mean", params, rollout_log_probs=rollout)
    # weights pi_old / pi_rollout: 0.5/0.25 = 2, 0.2/0.4 = 0.5, 0.4/0.1 = 4 -> capped at 3
    # token losses -A * w: -1 * 2 = -2, -2 * 0.5 = -1, +1 * 3 = 3; token-mean = 0/3
    assert loss.item() == pytest.approx(0.0, abs=1e-15)
    mask[0, 0] = 0  # drop the first token: (-1 + 3) / 2
    loss, _ = compute_policy_loss_vanilla(old, old.clone(), adv, mask, "token-mean", params, rollout_log_probs=rollout)
    assert loss.item() == pytest.approx(1.0, rel=1e-15)


def _actor(model, **overrides):
    config = {
        "ppo_mini_batch_size": 8,
        "ppo_micro_batch_size_per_gpu": 4,
        "ppo_epochs": 1,
        "grad_clip": 1e9,
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "policy_loss": {"loss_mode": "vanilla"},
        **overrides,
    }
    return DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))


def _weights_after_update(actor, model, batch) -> list[torch.Tensor]:
    actor.update_policy(batch)
    return [p.detach().clone() for p in model.parameters()]


def test_actor_with_tis_cap_equals_an_uncorrected_actor_with_advantages_times_capped_weights():
    cap = 2.0
    td = make_ppo_batch(batch_size=8, seed=3)
    base = make_tiny_causal_lm()
    old, _ = reference_response_log_probs(base, td, TEMPERATURE)
    mask = td["response_mask"].to(torch.float64)
    sign = torch.tensor([1.0, -1.0] * 4, dtype=torch.float64)[:, None]
    advantages = sign * mask
    # per sequence the rollout engine's probabilities differ from the trainer's by a known factor:
    # pi_old / pi_rollout = 0.5, 3 (capped to 2), 1.5, 1 for rows 0..3, repeating
    factor = torch.tensor([0.5, 3.0, 1.5, 1.0] * 2, dtype=torch.float64)[:, None]
    rollout = old - torch.log(factor)
    expected_w = factor.clamp(max=cap)

    tensors = {**dict(td.items()), "old_log_probs": old, "advantages": advantages, "rollout_log_probs": rollout}
    corrected_model = copy.deepcopy(base)
    corrected = _weights_after_update(
        _actor(corrected_model, tis_imp_ratio_cap=cap),
        corrected_model,
        DataProto.from_dict(tensors=tensors, meta_info={"temperature": TEMPERATURE}),
    )
    reference_model = copy.deepcopy(base)
    plain = {**dict(td.items()), "old_log_probs": old, "advantages": advantages * expected_w}
    reference = _weights_after_update(
        _actor(reference_model),
        reference_model,
        DataProto.from_dict(tensors=plain, meta_info={"temperature": TEMPERATURE}),
    )
    moved = sum((a - b).abs().sum().item() for a, b in zip(corrected, base.parameters()))
    assert moved > 1e-3  # the update did something
    for got, want in zip(corrected, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    # off by default: rollout_log_probs in the batch change nothing without the cap
    off_model = copy.deepcopy(base)
    off = _weights_after_update(
        _actor(off_model), off_model, DataProto.from_dict(tensors=tensors, meta_info={"temperature": TEMPERATURE})
    )
    unweighted_model = copy.deepcopy(base)
    no_rollout = {k: v for k, v in tensors.items() if k != "rollout_log_probs"}
    unweighted = _weights_after_update(
        _actor(unweighted_model),
        unweighted_model,
        DataProto.from_dict(tensors=no_rollout, meta_info={"temperature": TEMPERATURE}),
    )
    for got, want in zip(off, unweighted):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mismatch_metrics_are_mean_and_max_probability_gaps_over_valid_tokens():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 0.1]]))
    rollout = torch.log(torch.tensor([[0.4, 0.2, 0.1], [0.35, 0.5, 0.99]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = DataProto.from_dict(tensors={"response_mask": mask, "rollout_log_probs": rollout})
    metrics = _rollout_mismatch_metrics(batch, old)
    gaps = [0.1, 0.0, 0.05, 0.1, 0.89]  # |p_train - p_rollout| of the five valid tokens
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(sum(gaps) / 5, abs=1e-6)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.89, abs=1e-6)
