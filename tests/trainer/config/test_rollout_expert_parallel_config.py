"""`actor_rollout_ref.rollout.expert_parallel_size`: upstream's rule ep = tp x dp, the groups tiling
the workers, and what each engine refuses (docs/rollout_backends.md, "Expert parallelism")."""

from __future__ import annotations

import pytest
from test_config_validation import error_of, with_

from verl.trainer.config import load_ppo_config, validate_ppo_config

EP = "actor_rollout_ref.rollout.expert_parallel_size"


@pytest.fixture(scope="module")
def defaults() -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(load_ppo_config(config_name="arith_demo"), resolve=True)
    return with_(cfg, trainer__n_gpus_per_node=4, actor_rollout_ref__rollout__name="hf")


def rollout(base: dict, **keys) -> dict:
    return with_(base, **{f"actor_rollout_ref__rollout__{k}": v for k, v in keys.items()})


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)])
def test_expert_parallel_size_equal_to_tp_times_dp_is_accepted_with_the_built_in_engine(defaults, tp, dp):
    validate_ppo_config(rollout(defaults, expert_parallel_size=2, tensor_model_parallel_size=tp, data_parallel_size=dp))


def test_expert_parallel_size_other_than_tp_times_dp_is_refused_with_the_product(defaults):
    msg = error_of(rollout(defaults, expert_parallel_size=4, tensor_model_parallel_size=1, data_parallel_size=2))
    assert f"{EP}=4 must equal tensor_model_parallel_size x data_parallel_size = 1 x 2 = 2" in msg


def test_expert_parallel_size_not_dividing_the_workers_is_refused(defaults):
    cfg = with_(defaults, trainer__n_gpus_per_node=6)
    msg = error_of(rollout(cfg, expert_parallel_size=4, tensor_model_parallel_size=1, data_parallel_size=4))
    assert f"{EP}=4 does not divide the 6 workers" in msg


def test_non_positive_expert_or_data_parallel_size_is_refused(defaults):
    assert "rollout.expert_parallel_size=0 must be at least 1" in error_of(rollout(defaults, expert_parallel_size=0))
    assert "rollout.data_parallel_size=0 must be at least 1" in error_of(rollout(defaults, data_parallel_size=0))


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"actor_rollout_ref__rollout__name": "sglang"}, "with rollout.name=sglang is not implemented"),
        (
            {"actor_rollout_ref__rollout__name": "vllm", "actor_rollout_ref__rollout__tensor_model_parallel_size": 1,
             "actor_rollout_ref__rollout__data_parallel_size": 2},
            "with rollout.name=vllm and data_parallel_size=2 is not implemented",
        ),
        ({"actor_rollout_ref__rollout__multi_turn__enable": True}, "with rollout.name=hf and multi_turn.enable=true"),
        ({"actor_rollout_ref__actor__ulysses_sequence_parallel_size": 2}, "is not implemented with actor_rollout_ref.actor.ulysses"),
        ({"async_training__staleness_threshold": 1}, "is not implemented with async_training.staleness_threshold > 0"),
    ],
)  # fmt: skip
def test_expert_parallel_combinations_not_implemented_are_refused(defaults, changes, expected):
    cfg = with_(rollout(defaults, expert_parallel_size=2, tensor_model_parallel_size=2), **changes)
    assert expected in error_of(cfg)


def test_vllm_expert_parallelism_over_its_tensor_parallel_ranks_is_accepted(defaults):
    validate_ppo_config(rollout(defaults, name="vllm", expert_parallel_size=2, tensor_model_parallel_size=2))
