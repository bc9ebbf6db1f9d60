"""`main_ppo` with an agent loop written against upstream's API, registered from a config file:
real Ray, 2 FSDP2 workers, the built-in engine; the loop scores its own episodes, so the scores the
trainer reports are the loop's, not the reward function's."""

from __future__ import annotations

import pytest

from tests.trainer.main_ppo_runs import demo_script_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


def test_an_upstream_style_loop_from_a_config_file_generates_and_scores_the_training_batches(
    tmp_path, shared_ray_cluster
):
    agents = tmp_path / "agents.yaml"
    agents.write_text(
        "- name: self_scored\n  _target_: tests.experimental.agent_loop.upstream_loops.ScoresItsOwnEpisodes\n"
        "  score: 0.375\n"
    )
    cmd = demo_script_cmd(
        tmp_path,
        2,
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agents}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=self_scored",
        "data.return_raw_chat=true",  # upstream-style loops read the row's messages (raw_prompt)
    )
    run_main_ppo(cmd, tmp_path, timeout=600, cluster=shared_ray_cluster)

    train = [r["data"] for r in read_metrics(tmp_path) if "critic/score/mean" in r["data"]]
    assert len(train) == 2
    for data in train:
        # every episode scored 0.375 by the loop (the arithmetic reward function gives 0 or 1)
        assert data["critic/score/mean"] == 0.375 and data["critic/score/min"] == 0.375
        assert "agent_loop/generate_sequences" in data and data["num_turns/mean"] == 2
