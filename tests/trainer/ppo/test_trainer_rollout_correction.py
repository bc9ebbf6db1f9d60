"""The driver's phases that carry out `algorithm.rollout_correction` and feed the optimal token
baseline: decoupled mode's correction before the advantage, bypass mode's old log-probs, the
estimator's extra inputs, and the checks made when the trainer is built."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage
from verl.trainer.ppo.driver_math import check_estimator_inputs, compute_advantage
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.rollout_corr_helper import RolloutCorrectionConfig
from verl.trainer.ppo.rollout_source import StepState

D = torch.float64


def _batch(with_rollout: bool = True) -> DataProto:
    old = torch.log(torch.tensor([[0.3, 0.5, 0.2], [0.6, 0.4, 0.5]], dtype=D))
    rollout = torch.log(torch.tensor([[0.1, 0.5, 0.4], [0.4, 0.4, 0.5]], dtype=D))
    tensors = {
        "old_log_probs": old,
        "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D),
        "token_level_rewards": torch.tensor([[0, 0, 1.0], [0, 0.5, 0]], dtype=D),
        "sum_pi_squared": torch.full((2, 3), 0.4, dtype=D),
    }
    if with_rollout:
        tensors["rollout_log_probs"] = rollout
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(["p", "p"], dtype=object)})


def _trainer(rc: RolloutCorrectionConfig | None, adv_estimator: str = "grpo"):
    algorithm = {
        "adv_estimator": adv_estimator,
        "gamma": 1.0,
        "lam": 1.0,
        "norm_adv_by_std_in_grpo": True,
        "use_pf_ppo": False,
    }
    return SimpleNamespace(
        rollout_correction=rc, config=OmegaConf.create({"algorithm": algorithm}), actor_rollout_wg=None
    )


def test_decoupled_correction_writes_weights_and_the_rejected_mask_before_the_advantage():
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    state = StepState()
    batch = RayPPOTrainer._step_correct_rollout(_trainer(rc), _batch(), state)
    # ratios pi_old / pi_rollout: [3, 1, 0.5] and [1.5, 1, -]; the ratio-3 token is rejected
    torch.testing.assert_close(batch.batch["response_mask"], torch.tensor([[0, 1, 1], [1, 1, 0]], dtype=D))
    torch.testing.assert_close(batch.batch["rollout_is_weights"], torch.tensor([[2, 1, 0.5], [1.5, 1, 0]], dtype=D))
    assert state.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert state.metrics["rollout_corr/kl"] == pytest.approx((-math.log(3) + math.log(2) - math.log(1.5)) / 5)
    assert "rollout_correction" in state.timing


def test_metrics_only_config_logs_the_gap_and_changes_nothing():
    state = StepState()
    before = _batch()
    batch = RayPPOTrainer._step_correct_rollout(_trainer(RolloutCorrectionConfig()), _batch(), state)
    assert torch.equal(batch.batch["response_mask"], before.batch["response_mask"])
    assert "rollout_is_weights" not in batch.batch
    assert "rollout_corr/chi2_token" in state.metrics


def test_without_rollout_log_probs_or_in_bypass_mode_the_phase_does_nothing():
    for trainer, batch in (
        (_trainer(RolloutCorrectionConfig(rollout_is="token")), _batch(with_rollout=False)),
        (_trainer(RolloutCorrectionConfig.bypass_pg_is()), _batch()),
        (_trainer(None), _batch()),
    ):
        state = StepState()
        out = RayPPOTrainer._step_correct_rollout(trainer, batch, state)
        assert "rollout_is_weights" not in out.batch and state.metrics == {}


def test_bypass_mode_takes_the_rollouts_log_probs_as_old_ones_without_a_forward_pass():
    batch = _batch()
    batch.batch.pop("old_log_probs")
    trainer = _trainer(RolloutCorrectionConfig.bypass_ppo_clip())
    trainer._reuses_current_log_probs = lambda batch=None: False
    # actor_rollout_wg is None: a compute_log_prob call would fail
    out = RayPPOTrainer._step_old_log_prob(trainer, batch, StepState())
    assert torch.equal(out.batch["old_log_probs"], out.batch["rollout_log_probs"])


def test_optimal_token_baseline_gets_old_log_probs_sum_pi_squared_and_the_weights():
    rc = RolloutCorrectionConfig(rollout_is="token")
    trainer = _trainer(rc, adv_estimator="optimal_token_baseline")
    batch = RayPPOTrainer._step_correct_rollout(trainer, _batch(), StepState())
    out = compute_advantage(batch, trainer.config.algorithm, pf_ppo_seed=0)
    b = batch.batch
    expected, _ = compute_optimal_token_baseline_advantage(
        b["token_level_rewards"],
        b["response_mask"],
        np.array(["p", "p"]),
        b["old_log_probs"],
        b["sum_pi_squared"],
        b["rollout_is_weights"],
    )
    torch.testing.assert_close(out.batch["advantages"], expected)
    unweighted, _ = compute_optimal_token_baseline_advantage(
        b["token_level_rewards"], b["response_mask"], np.array(["p", "p"]), b["old_log_probs"], b["sum_pi_squared"]
    )
    assert not torch.allclose(expected, unweighted)


def test_the_trainer_refuses_optimal_token_baseline_without_sum_pi_squared():
    config = OmegaConf.create(
        {
            "algorithm": {"adv_estimator": "optimal_token_baseline"},
            "actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": False}},
        }
    )
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=true"):
        check_estimator_inputs(config)
    config.actor_rollout_ref.actor.calculate_sum_pi_squared = True
    check_estimator_inputs(config)
