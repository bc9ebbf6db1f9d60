"""`main_ppo --config-name=arith_demo_megatron` (the demo on ppo_megatron_trainer) end to end on CPU: PPO (GAE) with a megatron actor
and critic and the built-in engine at tensor parallel size 2 with sequence parallelism, checkpointed, then resumed at context
parallel size 2 (the checkpoint reshards; each rank runs half of every sequence, and only the first
context-parallel rank generates and returns results)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


def test_ppo_with_megatron_actor_and_critic_at_tp2_resumes_at_cp2(tmp_path, shared_ray_cluster):
    first = tmp_path / "tp2"
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.sequence_parallel=true",
            "critic.megatron.tensor_model_parallel_size=2",
            "critic.megatron.sequence_parallel=true",
            "trainer.save_freq=1",
            *common_overrides(first, steps=1),
        ),
        first,
        cluster=shared_ray_cluster,
    )
    (row,) = [r["data"] for r in read_metrics(first) if "actor/pg_loss" in r["data"]]
    assert row["critic/grad_norm"] > 0 and row["actor/grad_norm"] > 0
    actor_dir = Path(first / "ckpt" / "global_step_1" / "actor")
    assert (actor_dir / "dist_ckpt" / "metadata.json").is_file()
    assert (first / "ckpt" / "global_step_1" / "critic" / "dist_ckpt" / "metadata.json").is_file()

    resumed = tmp_path / "cp2"
    proc = run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "algorithm.adv_estimator=gae",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={first / 'ckpt' / 'global_step_1'}",
            "actor_rollout_ref.actor.megatron.context_parallel_size=2",
            "critic.megatron.context_parallel_size=2",
            *common_overrides(resumed, steps=2),
        ),
        resumed,
        cluster=shared_ray_cluster,
    )
    assert "resuming from" in proc.stdout + proc.stderr
    rows = [r for r in read_metrics(resumed) if "actor/pg_loss" in r["data"]]
    assert [r["step"] for r in rows] == [2]  # step 1 came from the checkpoint
    assert rows[0]["data"]["critic/grad_norm"] > 0 and rows[0]["data"]["actor/grad_norm"] > 0


def test_grpo_with_a_megatron_reward_model_scores_with_the_classifier(tmp_path, shared_ray_cluster):
    """reward_model.strategy=megatron in the actor's workers (tp=2 both), with its own chat template, so
    the trainer hands it the prompt messages to re-render: the step's scores are the classifier's
    (random head: far outside the rule reward's [0, 1]), not the rule's."""
    from tests.workers.test_reward_model_worker import _make_reward_model

    rm = tmp_path / "rm"
    _make_reward_model(rm, other_template=True)
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "reward_model.megatron.tensor_model_parallel_size=2",  # the actor's workers: the actor's layout
            "reward_model.enable=true",
            "reward_model.strategy=megatron",
            f"reward_model.model.path={rm}",
            "reward_model.micro_batch_size_per_gpu=16",
            *common_overrides(tmp_path, steps=1),
        ),
        tmp_path,
        cluster=shared_ray_cluster,
    )
    (row,) = [r["data"] for r in read_metrics(tmp_path) if "actor/pg_loss" in r["data"]]
    assert row["critic/score/max"] > 1.5 or row["critic/score/min"] < -0.5, row


def test_gae_with_megatron_actor_at_tp2_and_critic_at_tp1_in_their_own_processes(tmp_path):
    """Upstream's megatron PPO scripts give the actor tp2 and leave the critic at tp1: the critic gets
    worker processes of its own on the shared pool (megatron's parallel state is one per process),
    and both models train for two steps."""
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "critic.megatron.tensor_model_parallel_size=1",
            *common_overrides(tmp_path, steps=2),
        ),
        tmp_path,
    )
    rows = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r["data"]]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["data"]["actor/grad_norm"] > 0 and r["data"]["critic/grad_norm"] > 0, r
