"""`reward_model.enable_resource_pool`: the reward model's workers in a pool of their own (upstream's
`reward_pool`), not colocated with the actor."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo
from verl.trainer.main_ppo import build_resource_pools
from verl.trainer.ppo.ray_trainer import Role


def _config(enable_pool: bool):
    return OmegaConf.create(
        {
            "trainer": {"n_gpus_per_node": 4, "nnodes": 2},
            "reward_model": {"enable": True, "enable_resource_pool": enable_pool, "n_gpus_per_node": 3, "nnodes": 1},
        }
    )


def test_reward_pool_holds_the_reward_model_only_when_enabled():
    mapping = {Role.ActorRollout: object, Role.Critic: object, Role.RewardModel: object}
    spec, roles = build_resource_pools(_config(True), mapping)
    assert spec == {"global_pool": [4, 4], "reward_pool": [3]}
    assert roles == {Role.ActorRollout: "global_pool", Role.Critic: "global_pool", Role.RewardModel: "reward_pool"}
    spec, roles = build_resource_pools(_config(False), mapping)
    assert spec == {"global_pool": [4, 4]} and set(roles.values()) == {"global_pool"}


@pytest.mark.slow
def test_grpo_scores_with_a_reward_model_in_its_own_pool(tmp_path, shared_ray_cluster):
    """Actor on 1 worker, the classifier on 1 of its own: the step's scores are the classifier's
    (random head: far outside the rule reward's [0, 1])."""
    from tests.workers.test_reward_model_worker import _make_reward_model

    rm = tmp_path / "rm"
    _make_reward_model(rm)
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo",
            "trainer.n_gpus_per_node=1",  # 2 CPUs: one actor worker, one reward-model worker
            "reward_model.enable=true",
            "reward_model.enable_resource_pool=true",
            "reward_model.n_gpus_per_node=1",
            "reward_model.nnodes=1",
            f"reward_model.model.path={rm}",
            "reward_model.micro_batch_size_per_gpu=16",
            *common_overrides(tmp_path, steps=1),
        ),
        tmp_path,
        cluster=shared_ray_cluster,
    )
    (row,) = [r["data"] for r in read_metrics(tmp_path) if "actor/pg_loss" in r["data"]]
    assert row["critic/score/max"] > 1.5 or row["critic/score/min"] < -0.5, row
