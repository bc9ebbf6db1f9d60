"""`verl.trainer.ppo.core_algos` and `verl.trainer.ppo.rollout_corr_helper` are upstream's import
paths over `verl.algorithms`: the same objects, and one registry whichever path registers."""

from __future__ import annotations

import subprocess
import sys
from enum import Enum

import pytest
import torch

import verl.trainer.ppo.core_algos as core_algos
import verl.trainer.ppo.rollout_corr_helper as rollout_corr_helper
from verl.algorithms import advantages, policy_losses, rollout_corr


def test_core_algos_re_exports_the_same_objects_it_lists():
    for name in core_algos.__all__:
        assert hasattr(core_algos, name), name
    assert core_algos.ADV_ESTIMATORS is advantages.ADV_ESTIMATORS is core_algos.ADV_ESTIMATOR_REGISTRY
    assert core_algos.POLICY_LOSSES is policy_losses.POLICY_LOSSES is core_algos.POLICY_LOSS_REGISTRY
    assert rollout_corr_helper.RolloutCorrectionConfig is rollout_corr.RolloutCorrectionConfig
    # plus upstream's earlier name for the bypass mode, which verl-recipe's rep_exp and specRL import
    assert set(rollout_corr_helper.__all__) == set(rollout_corr.__all__) | {"apply_rollout_correction"}


def test_registering_through_the_old_path_reaches_the_workers_registry():
    @core_algos.register_policy_loss("test_only_negated_vanilla")
    def negated(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", **_):
        return -log_prob.sum(), {}

    @core_algos.register_adv_est("test_only_zero")
    def zero(token_level_rewards, response_mask, **_):
        return torch.zeros_like(token_level_rewards), torch.zeros_like(token_level_rewards)

    try:
        assert policy_losses.get_policy_loss_fn("test_only_negated_vanilla") is negated
        assert advantages.get_adv_estimator_fn("test_only_zero") is zero
    finally:
        del policy_losses.POLICY_LOSSES["test_only_negated_vanilla"]
        del advantages.ADV_ESTIMATORS["test_only_zero"]


def test_assigning_a_table_through_the_old_path_replaces_the_one_every_look_up_reads(monkeypatch):
    original = advantages.ADV_ESTIMATORS
    replacement = {"double": lambda x: 2 * x}
    monkeypatch.setattr(core_algos, "ADV_ESTIMATOR_REGISTRY", replacement)
    assert advantages.ADV_ESTIMATORS is replacement is advantages.ADV_ESTIMATOR_REGISTRY
    assert core_algos.ADV_ESTIMATORS is replacement
    assert advantages.get_adv_estimator_fn("double")(4) == 8
    with pytest.raises(ValueError, match=r"^Unknown advantage estimator simply: grpo .*valid names are: double$"):
        core_algos.get_adv_estimator_fn("grpo")  # the built-ins went with the old table

    class Names(Enum):
        HALF = "half"

    @core_algos.register_adv_est(Names.HALF)
    def half(x):
        return x / 2

    assert replacement == {"double": replacement["double"], "half": half}
    assert "half" not in original
    core_algos.register_adv_est("half")(half)  # the same function again is not a conflict
    with pytest.raises(ValueError, match="'half' is already registered"):
        core_algos.register_adv_est("half")(lambda x: x)

    losses = {"only": policy_losses.compute_policy_loss_vanilla}
    monkeypatch.setattr(core_algos, "POLICY_LOSSES", losses)
    assert policy_losses.POLICY_LOSS_REGISTRY is losses is core_algos.POLICY_LOSS_REGISTRY
    assert policy_losses.get_policy_loss_fn("only") is policy_losses.compute_policy_loss_vanilla

    monkeypatch.undo()
    assert advantages.ADV_ESTIMATORS is original is core_algos.ADV_ESTIMATOR_REGISTRY
    assert advantages.get_adv_estimator_fn("grpo") is advantages.compute_grpo_outcome_advantage


def test_the_algorithms_layer_imports_without_the_trainer_or_workers():
    code = (
        "import sys, verl.algorithms.advantages, verl.algorithms.policy_losses, verl.algorithms.kl, "
        "verl.algorithms.value_losses, verl.algorithms.dapo; "
        "print(sorted(m for m in sys.modules if m.startswith(('verl.trainer', 'verl.workers'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
