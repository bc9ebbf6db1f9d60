"""`python -m verl.trainer.main_ppo ... actor_rollout_ref.actor.ulysses_sequence_parallel_size=2`
end to end on CPU (real Ray, 2 worker processes forming one sp group, FSDP2, the built-in engine,
a KL loss so the reference runs at sp=2 too): two steps train and log finite losses."""

from __future__ import annotations

import math

import pytest

from tests.trainer.main_ppo_runs import demo_script_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


def test_main_ppo_with_ulysses_sp2_trains_two_steps(shared_ray_cluster, tmp_path):
    cmd = demo_script_cmd(
        tmp_path,
        2,
        "actor_rollout_ref.model.use_remove_padding=True",
        # the bundled model has 2 attention heads: sp=2 splits them
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "trainer.save_freq=-1",
    )
    run_main_ppo(cmd, tmp_path, timeout=600, cluster=shared_ray_cluster)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert math.isfinite(record["data"][key]), (record["step"], key, record["data"][key])
    assert records[-1]["data"]["actor/kl_loss"] > 0, "step 1 must have moved the actor off the reference"
