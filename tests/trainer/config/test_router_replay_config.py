"""`actor_rollout_ref.actor.router_replay` in the config: R2 validates on a megatron actor (also
over pipeline stages), R3 too with the built-in engine recording the routing
(`rollout.enable_rollout_routing_replay`), in plain generation and with agent loops; R3 without the recording or with an engine that cannot
record, the recording without R3, the FSDP actor, pp > 1 with a virtual pipeline or activation
recomputation, the reference's own mode and the file keys
(upstream declares them and reads neither) are refused, each naming what to set instead."""

from __future__ import annotations

import pytest

from tests.trainer.config.test_config_validation import defaults, error_of, megatron_defaults, with_  # noqa: F401
from verl.trainer.config import validate_ppo_config

KEY = "actor_rollout_ref.actor.router_replay.mode"
FLAG = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
R3 = {
    "actor_rollout_ref__actor__router_replay__mode": "R3",
    "actor_rollout_ref__rollout__enable_rollout_routing_replay": True,
    "actor_rollout_ref__rollout__name": "hf",
}


def test_r2_on_a_megatron_actor_with_expert_parallelism_validates(megatron_defaults):  # noqa: F811
    validate_ppo_config(
        with_(
            megatron_defaults,
            actor_rollout_ref__actor__router_replay__mode="R2",
            actor_rollout_ref__actor__megatron__expert_model_parallel_size=2,
        )
    )


@pytest.mark.parametrize(
    "changes,message",
    [
        ({**R3, "actor_rollout_ref__rollout__enable_rollout_routing_replay": False},
         f"{KEY}=R3 replays the routing the rollout engine records, which it records only with {FLAG}=true"),
        ({**R3, "actor_rollout_ref__rollout__name": "sglang"},
         f"{KEY}=R3 needs the rollout engine's routing, and only the built-in engine records it here "
         "(actor_rollout_ref.rollout.name=sglang returns none"),
        ({**R3, "actor_rollout_ref__rollout__name": "vllm"}, "set actor_rollout_ref.rollout.name=hf or"),
        ({**R3, "actor_rollout_ref__actor__megatron__pipeline_model_parallel_size": 2,
          "actor_rollout_ref__actor__megatron__virtual_pipeline_model_parallel_size": 2},
         f"{KEY}=R3 with actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2: replay over "
         "pipeline stages tracks one model chunk per stage"),
        ({"actor_rollout_ref__rollout__enable_rollout_routing_replay": True},
         f"{FLAG}=true records routing that only {KEY}=R3 replays ({KEY}=disabled: nothing is replayed)"),
        ({"actor_rollout_ref__actor__router_replay__mode": "R2", "actor_rollout_ref__rollout__enable_rollout_routing_replay": True},
         f"{FLAG}=true records routing that only {KEY}=R3 replays ({KEY}=R2: the old-log-prob pass records its own)"),
        ({"actor_rollout_ref__actor__router_replay__mode": "R2",
          "actor_rollout_ref__actor__megatron__pipeline_model_parallel_size": 2,
          "actor_rollout_ref__actor__megatron__override_transformer_config__recompute_granularity": "full"},
         f"{KEY}=R2 with pipeline_model_parallel_size=2 and actor_rollout_ref.actor.megatron.override_transformer_"
         "config.recompute_granularity=full: 1F1B recomputes"),
        ({"actor_rollout_ref__ref__router_replay__mode": "R2"},
         "actor_rollout_ref.ref.router_replay.mode=R2: the reference only scores"),
        ({"actor_rollout_ref__actor__router_replay__mode": "R1"}, f"{KEY}='R1' is not a valid choice"),
        ({"actor_rollout_ref__actor__router_replay__record_file": "/tmp/routing.pt"},
         "actor_rollout_ref.actor.router_replay.record_file=/tmp/routing.pt is not implemented"),
    ],
)  # fmt: skip
def test_router_replay_settings_this_verl_cannot_run_are_refused(megatron_defaults, changes, message):  # noqa: F811
    assert message in error_of(with_(megatron_defaults, **changes))


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_replay_over_pipeline_stages_validates(megatron_defaults, mode):  # noqa: F811
    changes = R3 if mode == "R3" else {"actor_rollout_ref__actor__router_replay__mode": mode}
    validate_ppo_config(
        with_(megatron_defaults, actor_rollout_ref__actor__megatron__pipeline_model_parallel_size=2, **changes)
    )


def test_r3_with_the_built_in_engine_recording_validates(megatron_defaults):  # noqa: F811
    validate_ppo_config(
        with_(megatron_defaults, actor_rollout_ref__actor__megatron__expert_model_parallel_size=2, **R3)
    )


def test_r3_with_agent_loops_validates(megatron_defaults):  # noqa: F811
    """Agent-loop episodes carry their last model call's routing (tests/experimental/agent_loop)."""
    validate_ppo_config(with_(megatron_defaults, actor_rollout_ref__rollout__multi_turn__enable=True, **R3))


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_replay_on_the_fsdp_actor_is_refused(defaults, mode):  # noqa: F811
    changes = R3 if mode == "R3" else {"actor_rollout_ref__actor__router_replay__mode": mode}
    message = error_of(with_(defaults, **changes))
    assert f"{KEY}={mode} is implemented for actor_rollout_ref.actor.strategy=megatron only" in message
