"""`main_ppo --config-name=arith_demo_megatron` (the demo on ppo_megatron_trainer) end to end on CPU: PPO (GAE) with a megatron actor
and critic and the built-in engine at tensor parallel size 2 with sequence parallelism, checkpointed, then resumed at context
parallel size 2 (the checkpoint reshards; each rank runs half of every sequence, and only the first
context-parallel rank generates and returns results)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo, start_module_runs

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


def _tp2(run: Path, cluster, started: dict) -> Path:
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.sequence_parallel=true",
            "critic.megatron.tensor_model_parallel_size=2",
            "critic.megatron.sequence_parallel=true",
            "trainer.save_freq=1",
            *common_overrides(run, steps=1),
        ),
        run,
        cluster=cluster,
    )
    return run


def _resumed_at_cp2(resumed: Path, cluster, started: dict):
    first = started["tp2"].result()
    return resumed, run_main_ppo(
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
        cluster=cluster,
    )


def _reward_model(rm: Path, run: Path, cluster, started: dict) -> Path:
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "reward_model.megatron.tensor_model_parallel_size=2",  # the actor's workers: the actor's layout
            "reward_model.enable=true",
            "reward_model.strategy=megatron",
            f"reward_model.model.path={rm}",
            "reward_model.micro_batch_size_per_gpu=16",
            *common_overrides(run, steps=1),
        ),
        run,
        cluster=cluster,
    )
    return run


def _critic_at_tp1(run: Path, cluster, started: dict) -> Path:
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "critic.megatron.tensor_model_parallel_size=1",
            *common_overrides(run, steps=2),
        ),
        run,
        cluster=cluster,
    )
    return run


# Every run of the file, by name: a function of (its own directory, the shared cluster, the started
# runs' futures) -> what its test reads; the cp=2 resume waits for the tp=2 run, so it comes last.
RUNS = {"tp2": _tp2, "reward_model": _reward_model, "critic_at_tp1": _critic_at_tp1, "cp2": _resumed_at_cp2}
# (the reward model's run gets the classifier that the fixture builds, see start_module_runs)
# test -> the runs it reads (with the runs those wait for)
TEST_RUNS = {
    "test_ppo_with_megatron_actor_and_critic_at_tp2_resumes_at_cp2": ("tp2", "cp2"),
    "test_grpo_with_a_megatron_reward_model_scores_with_the_classifier": ("reward_model",),
    "test_gae_with_megatron_actor_at_tp2_and_critic_at_tp1_in_their_own_processes": ("critic_at_tp1",),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, shared_ray_cluster):
    """The runs of this module's selected tests, started at once: {name: future} (see start_module_runs).
    The reward model (a classifier with its own chat template) is built here, before the runs start."""
    from functools import partial

    from tests.workers.test_reward_model_worker import _make_reward_model

    rm = tmp_path_factory.mktemp("rm") / "rm"
    _make_reward_model(rm, other_template=True)
    runs_ = {**RUNS, "reward_model": partial(_reward_model, rm)}
    # two at a time: each holds 2-4 Megatron workers (about a GB each)
    with start_module_runs(request, runs_, TEST_RUNS, tmp_path_factory, shared_ray_cluster, 2) as started:
        yield started


def test_ppo_with_megatron_actor_and_critic_at_tp2_resumes_at_cp2(runs):
    first = runs["tp2"].result()
    (row,) = [r["data"] for r in read_metrics(first) if "actor/pg_loss" in r["data"]]
    assert row["critic/grad_norm"] > 0 and row["actor/grad_norm"] > 0
    actor_dir = Path(first / "ckpt" / "global_step_1" / "actor")
    assert (actor_dir / "dist_ckpt" / "metadata.json").is_file()
    assert (first / "ckpt" / "global_step_1" / "critic" / "dist_ckpt" / "metadata.json").is_file()

    resumed, proc = runs["cp2"].result()
    assert "resuming from" in proc.stdout + proc.stderr
    rows = [r for r in read_metrics(resumed) if "actor/pg_loss" in r["data"]]
    assert [r["step"] for r in rows] == [2]  # step 1 came from the checkpoint
    assert rows[0]["data"]["critic/grad_norm"] > 0 and rows[0]["data"]["actor/grad_norm"] > 0


def test_grpo_with_a_megatron_reward_model_scores_with_the_classifier(runs):
    """reward_model.strategy=megatron in the actor's workers (tp=2 both), with its own chat template, so
    the trainer hands it the prompt messages to re-render: the step's scores are the classifier's
    (random head: far outside the rule reward's [0, 1]), not the rule's."""
    run = runs["reward_model"].result()
    (row,) = [r["data"] for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert row["critic/score/max"] > 1.5 or row["critic/score/min"] < -0.5, row


def test_gae_with_megatron_actor_at_tp2_and_critic_at_tp1_in_their_own_processes(runs):
    """Upstream's megatron PPO scripts give the actor tp2 and leave the critic at tp1: the critic gets
    worker processes of its own on the shared pool (megatron's parallel state is one per process),
    and both models train for two steps. (It joins the session's cluster, as the other runs do.)"""
    run = runs["critic_at_tp1"].result()
    rows = [r for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["data"]["actor/grad_norm"] > 0 and r["data"]["critic/grad_norm"] > 0, r
