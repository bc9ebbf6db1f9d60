"""`actor_rollout_ref.model.mtp` in the config: MTP training validates on a megatron actor at tp=2,
pp=2 and cp=2 (the mimo example's own keys); speculative decoding, the FSDP actor, virtual pipeline
stages, a dist checkpoint, LoRA, a negative weight and enable_train without enable are refused, each
naming what to set instead."""

from __future__ import annotations

import pytest

from tests.trainer.config.test_config_validation import defaults, error_of, megatron_defaults, with_  # noqa: F401
from verl.trainer.config import validate_ppo_config

KEY = "actor_rollout_ref.model.mtp"
ON = {"actor_rollout_ref__model__mtp__enable": True, "actor_rollout_ref__model__mtp__enable_train": True}


def test_the_mimo_examples_mtp_keys_validate_on_a_megatron_actor(megatron_defaults):  # noqa: F811
    validate_ppo_config(
        with_(
            megatron_defaults,
            **ON,
            actor_rollout_ref__model__mtp__mtp_loss_scaling_factor=0.1,
            actor_rollout_ref__model__mtp__detach_encoder=True,
            actor_rollout_ref__actor__megatron__tensor_model_parallel_size=2,
            actor_rollout_ref__actor__megatron__use_mbridge=True,
        )
    )


@pytest.mark.parametrize(
    "layout",
    [
        {"actor_rollout_ref__actor__megatron__pipeline_model_parallel_size": 2},
        {"actor_rollout_ref__actor__megatron__context_parallel_size": 2},
    ],
)
def test_mtp_validates_at_pipeline_and_context_parallel_2(megatron_defaults, layout):  # noqa: F811
    validate_ppo_config(with_(megatron_defaults, **ON, **layout))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"actor_rollout_ref__model__mtp__enable_rollout": True},
         f"{KEY}.enable_rollout=true is not implemented in this verl (Speculative decoding with the MTP layers in "
         "vLLM/SGLang, which none of this build's rollout engines does)"),
        ({"actor_rollout_ref__model__mtp__enable": False},
         f"{KEY}.enable_train=true needs {KEY}.enable=true"),
        ({"actor_rollout_ref__actor__megatron__pipeline_model_parallel_size": 2,
          "actor_rollout_ref__actor__megatron__virtual_pipeline_model_parallel_size": 2},
         f"{KEY}.enable=true with actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2: "
         "multi-token prediction is implemented without virtual pipeline stages"),
        ({"actor_rollout_ref__model__mtp__mtp_loss_scaling_factor": -0.1},
         f"{KEY}.mtp_loss_scaling_factor=-0.1 must be >= 0"),
        ({"actor_rollout_ref__actor__megatron__use_dist_checkpointing": True,
          "actor_rollout_ref__actor__megatron__dist_checkpointing_path": "/"},
         f"{KEY}.enable=true with actor_rollout_ref.actor.megatron.use_dist_checkpointing=true"),
        ({"actor_rollout_ref__model__lora__rank": 8},
         f"{KEY}.enable=true with actor_rollout_ref.model.lora.rank > 0"),
    ],
)  # fmt: skip
def test_mtp_settings_this_verl_cannot_run_are_refused(megatron_defaults, changes, message):  # noqa: F811
    assert message in error_of(with_(megatron_defaults, **{**ON, **changes}))


def test_mtp_on_the_fsdp_actor_is_refused(defaults):  # noqa: F811
    message = error_of(with_(defaults, **ON))
    assert f"{KEY}.enable=true is implemented on the megatron actor (as upstream)" in message
