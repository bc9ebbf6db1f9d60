"""Megatron expert parallelism in the config: the expert layout must fit the ranks, and a model with
another expert layout than the actor's runs in worker processes of its own (megatron's expert
groups are process-global, like its tensor and pipeline groups)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.trainer.config.test_config_validation import error_of, megatron_defaults, with_  # noqa: F401
from verl.trainer.config import validate_ppo_config


def test_expert_layouts_that_fit_the_ranks_validate(megatron_defaults):  # noqa: F811
    # the demo runs on 2 ranks: ep=2 (etp defaults to tp=1), with the distributed optimizer
    validate_ppo_config(with_(megatron_defaults, actor_rollout_ref__actor__megatron__expert_model_parallel_size=2))
    # each expert split over more ranks than the dense layers (tp=1, etp=2; issue #27, once refused)
    validate_ppo_config(with_(megatron_defaults, actor_rollout_ref__actor__megatron__expert_tensor_parallel_size=2))


@pytest.mark.parametrize(
    "ep,etp,message",
    [
        (4, None, "expert_tensor_parallel_size=1 x expert_model_parallel_size=4 x pipeline_model_parallel_size=1 = 4 "
         "does not divide the 2 ranks"),
        (2, 2, "expert_tensor_parallel_size=2 x expert_model_parallel_size=2 x pipeline_model_parallel_size=1 = 4 "
         "does not divide the 2 ranks"),
        (0, None, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=0 must be a positive integer"),
    ],
)  # fmt: skip
def test_an_expert_layout_that_does_not_fit_is_refused(megatron_defaults, ep, etp, message):  # noqa: F811
    cfg = with_(
        megatron_defaults,
        actor_rollout_ref__actor__megatron__expert_model_parallel_size=ep,
        actor_rollout_ref__actor__megatron__expert_tensor_parallel_size=etp,
    )
    assert message in error_of(cfg)


def test_a_critic_with_another_expert_layout_gets_its_own_processes(megatron_defaults):  # noqa: F811
    from verl.trainer.ppo.process_sets import megatron_process_sets

    cfg = with_(
        megatron_defaults,
        algorithm__adv_estimator="gae",
        actor_rollout_ref__actor__megatron__expert_model_parallel_size=2,
        critic__megatron__expert_model_parallel_size=1,
    )
    validate_ppo_config(cfg)
    roles = {"actor_rollout": "A", "critic": "C", "ref": "R"}
    assert megatron_process_sets(OmegaConf.create(cfg), roles) == [{"actor_rollout": "A", "ref": "R"}, {"critic": "C"}]
    same = with_(cfg, critic__megatron__expert_model_parallel_size=2)
    validate_ppo_config(same)
    assert megatron_process_sets(OmegaConf.create(same), roles) == [roles]
