"""upstream v0.9.0's actor_rollout_ref keys: defaults as upstream's, features not in this build refused as soon
as they leave their neutral value, and the removed keys still accepted."""

from __future__ import annotations

import pytest

from verl.trainer.config.errors import ConfigError
from verl.trainer.config.loader import compose, load_ppo_config

BASE = ["actor_rollout_ref.rollout.name=hf"]


def _load(overrides, name="arith_demo"):
    return load_ppo_config([*overrides], config_name=name)


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_changed_defaults(name):
    arr = compose(name).actor_rollout_ref
    assert arr.rollout.calculate_log_probs is True
    assert (arr.model.mtp.speculative_num_steps, arr.model.mtp.speculative_eagle_topk) == (3, 1)
    assert arr.rollout.seed == 42 and arr.rollout.full_determinism is False
    assert arr.model.lora.rank == 0  # the Megatron-style block is in both compositions now


def test_megatron_changed_defaults():
    arr = compose("ppo_megatron_trainer").actor_rollout_ref
    assert arr.actor.megatron.vanilla_mbridge is False and arr.ref.megatron.vanilla_mbridge is False
    assert arr.model.use_remove_padding is True


def test_role_entropy_keys_reach_the_engine_section():
    cfg = _load(["actor_rollout_ref.actor.entropy_from_logits_chunk_size=512"])
    assert cfg.actor_rollout_ref.actor.fsdp_config.entropy_from_logits_chunk_size == 512


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.actor.fsdp_config.qat.enable=true",
        "actor_rollout_ref.rollout.disaggregation.enabled=true",
        "actor_rollout_ref.rollout.nnodes=2",
        "actor_rollout_ref.rollout.multi_turn.function_tool_path=tools.py",
        "actor_rollout_ref.actor.checkpoint.strict=false",
        "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=5",
    ],
)
def test_features_not_in_this_build_are_refused(override):
    with pytest.raises((ConfigError, ValueError), match=override.split("=")[0].rsplit(".", 1)[-1]):
        _load([override])


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.actor.optim.use_precision_aware_optimizer=true",
        "actor_rollout_ref.actor.optim.muon_momentum=0.9",
        "actor_rollout_ref.actor.megatron.use_megatron_fsdp=true",
        "actor_rollout_ref.actor.megatron.dynamic_context_parallel=true",
        "actor_rollout_ref.actor.megatron.qat.enable=true",
    ],
)
def test_megatron_features_not_in_this_build_are_refused(override):
    with pytest.raises((ConfigError, ValueError), match=override.split("=")[0].rsplit(".", 1)[-1]):
        _load([override], "arith_demo_megatron")


def test_profiler_schedule_other_than_zero_is_refused():
    from verl.utils.profiler.config import TorchProfilerToolConfig

    assert TorchProfilerToolConfig(schedule={"wait": 0}).schedule["active"] == 0
    with pytest.raises(ValueError, match="schedule"):
        TorchProfilerToolConfig(schedule={"active": 2})


def test_keys_upstream_removed_still_load():
    cfg = _load(["actor_rollout_ref.rollout.multi_turn.interaction_config_path=null"], "arith_demo_megatron")
    assert cfg.actor_rollout_ref.actor.load_weight is True
    from verl.trainer.config.loader import apply_overrides

    meg = compose("ppo_megatron_trainer")
    apply_overrides(meg, ["actor_rollout_ref.model.override_config.moe_config.freeze_moe_router=false"])
    assert meg.actor_rollout_ref.model.override_config.moe_config.freeze_moe_router is False
