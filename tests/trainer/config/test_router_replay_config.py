"""`actor_rollout_ref.actor.router_replay` in the config: R2 validates on a megatron actor without
pipeline parallelism; R3, the FSDP actor, pp > 1, the reference's own mode and the file keys
(upstream declares them and reads neither) are refused, each naming what to set instead."""

from __future__ import annotations

import pytest

from tests.trainer.config.test_config_validation import defaults, error_of, megatron_defaults, with_  # noqa: F401
from verl.trainer.config import validate_ppo_config

KEY = "actor_rollout_ref.actor.router_replay.mode"


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
        ({"actor_rollout_ref__actor__router_replay__mode": "R3"},
         f"{KEY}=R3 replays routing recorded by the rollout engine, and none of this verl's engines returns it"),
        ({"actor_rollout_ref__actor__router_replay__mode": "R2",
          "actor_rollout_ref__actor__megatron__pipeline_model_parallel_size": 2},
         f"{KEY}=R2 with actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2: replay is implemented "
         "without pipeline parallelism"),
        ({"actor_rollout_ref__ref__router_replay__mode": "R2"},
         "actor_rollout_ref.ref.router_replay.mode=R2: the reference only scores"),
        ({"actor_rollout_ref__actor__router_replay__mode": "R1"}, f"{KEY}='R1' is not a valid choice"),
        ({"actor_rollout_ref__actor__router_replay__record_file": "/tmp/routing.pt"},
         "actor_rollout_ref.actor.router_replay.record_file=/tmp/routing.pt is not implemented"),
    ],
)  # fmt: skip
def test_router_replay_settings_this_verl_cannot_run_are_refused(megatron_defaults, changes, message):  # noqa: F811
    assert message in error_of(with_(megatron_defaults, **changes))


def test_r2_on_the_fsdp_actor_is_refused(defaults):  # noqa: F811
    message = error_of(with_(defaults, actor_rollout_ref__actor__router_replay__mode="R2"))
    assert f"{KEY}=R2 is implemented for actor_rollout_ref.actor.strategy=megatron only" in message
