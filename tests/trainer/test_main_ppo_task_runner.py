"""Upstream's `TaskRunner` surface (verl/trainer/main_ppo.py): recipes subclass it and override its
`add_*_worker` / `init_resource_pool_mgr` methods, and hand their class to `run_ppo(config,
task_runner_class=...)` already wrapped with `ray.remote`."""

from __future__ import annotations

import pytest

from verl.trainer.main_ppo import TaskRunner, run_ppo
from verl.trainer.ppo.ray_trainer import Role


def _config(tmp_path, *overrides):
    from verl.trainer.config import load_ppo_config
    from verl.utils.dataset.arith import ensure_arith_data

    train, test = ensure_arith_data(str(tmp_path))
    return load_ppo_config(
        [f"data.train_files={train}", f"data.val_files={test}", "trainer.device=cpu", *overrides],
        config_name="arith_demo",
    )


def test_add_methods_fill_upstream_s_two_mappings(tmp_path):
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    runner = TaskRunner()
    config = _config(tmp_path, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true")
    actor_cls, group_cls = runner.add_actor_rollout_worker(config)
    runner.add_critic_worker(config)
    runner.add_reward_model_worker(config)
    runner.add_ref_policy_worker(config, actor_cls)
    assert actor_cls is ActorRolloutRefWorker and group_cls.__name__ == "RayWorkerGroup"
    # the reference lives in the actor's processes; GAE trains a critic; no reward model is enabled
    assert runner.role_worker_mapping == {Role.ActorRolloutRef: ActorRolloutRefWorker, Role.Critic: CriticWorker}
    assert runner.mapping == {Role.ActorRolloutRef: "global_pool", Role.Critic: "global_pool"}
    grpo = TaskRunner()
    grpo.add_actor_rollout_worker(_config(tmp_path))
    grpo.add_critic_worker(_config(tmp_path))
    assert set(grpo.role_worker_mapping) == {Role.ActorRollout}


class _StopsAtTheActorWorker(TaskRunner):
    def add_actor_rollout_worker(self, config):
        raise LookupError("the subclass's add_actor_rollout_worker ran")


def test_run_builds_its_roles_through_the_overridable_methods(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(LookupError, match="subclass's add_actor_rollout_worker"):
        _StopsAtTheActorWorker().run(_config(tmp_path))


def test_run_ppo_takes_a_ray_remote_task_runner_class_and_writes_the_timeline(ray_session, tmp_path):
    from tests.trainer.recipe_style_trainer import FinishedTaskRunner  # importable by the Ray actor

    timeline = tmp_path / "timeline.json"
    config = _config(tmp_path, "trainer.total_training_steps=3", f"ray_kwargs.timeline_json_file={timeline}")
    result = run_ppo(config, task_runner_class=ray_session.remote(num_cpus=0)(FinishedTaskRunner))
    assert result == {"runner": "FinishedTaskRunner", "steps": 3}
    assert timeline.read_text().startswith("[")
    assert run_ppo(config, task_runner_class=FinishedTaskRunner) == result  # a plain class is wrapped here


def test_a_role_added_without_a_pool_gets_its_default_pool(ray_session, tmp_path):
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    runner = TaskRunner()
    runner.role_worker_mapping[Role.ActorRollout] = ActorRolloutRefWorker  # an override that set no pool
    manager = runner.init_resource_pool_mgr(_config(tmp_path, "trainer.n_gpus_per_node=2"))
    assert manager.mapping == {Role.ActorRollout: "global_pool"}
    assert manager.resource_pool_spec == {"global_pool": [2]}
    runner.mapping[Role.ActorRollout] = "elsewhere"
    with pytest.raises(ValueError, match="elsewhere"):
        runner.init_resource_pool_mgr(_config(tmp_path, "trainer.n_gpus_per_node=2"))
