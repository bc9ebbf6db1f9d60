"""`actor_rollout_ref.model.use_fused_kernels=True` (upstream's key) through `main_ppo`: the actor and
reference take the fused log-prob path, and the run says so (start-up log, `perf/fused_kernels`,
`speed_paths.yaml`)."""

from __future__ import annotations

import math

import pytest
import yaml

from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo


@pytest.mark.slow  # a whole main_ppo run through Ray
def test_use_fused_kernels_trains_on_the_fused_path_and_reports_it(tmp_path, shared_ray_cluster):
    cmd = main_ppo_cmd(
        "arith_demo",
        *common_overrides(tmp_path, steps=2),
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        # GRPO's repeated prompts would take the shared-prompt forward in every micro-batch: off, so all are fused
        "actor_rollout_ref.actor.share_prompt_forward=False",
        "actor_rollout_ref.actor.use_kl_loss=True",  # a reference policy, on the fused path as well
    )
    proc = run_main_ppo(cmd, tmp_path, cluster=shared_ray_cluster)
    last = read_metrics(tmp_path)[-1]["data"]
    assert last["perf/fused_kernels"] == 1.0 and last["perf/shared_prompt_forward"] == 0.0, last
    assert math.isfinite(last["actor/entropy"]) and last["actor/entropy"] > 0
    assert "speed path fused_kernels: on" in proc.stdout + proc.stderr
    recorded = yaml.safe_load((tmp_path / "run" / "speed_paths.yaml").read_text())
    assert recorded["fused_kernels"] == {"requested": True, "active": True, "reason": ""}, recorded
    assert recorded["shared_prompt_forward"]["requested"] is False, recorded
