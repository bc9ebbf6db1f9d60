"""Upstream v0.9's new top-level keys: the `model_engine` config group, `trainer.use_v1` / `trainer.v1`,
`distillation`, `transfer_queue`, `skip` (behaviour: tests/trainer/ppo/test_skip_steps.py) and the new
`data` keys. Each is either honoured or refused when it leaves its neutral value."""

from __future__ import annotations

import pytest

from tests.trainer.config.test_upstream_parity import leaves
from verl.trainer.config import ConfigError, load_ppo_config
from verl.trainer.config.loader import compose


def test_model_engine_megatron_composes_what_ppo_megatron_trainer_does():
    via_group = leaves(compose("ppo_trainer", group_overrides=["model_engine=megatron"]))
    assert via_group == leaves(compose("ppo_megatron_trainer"))
    assert via_group["model_engine"] == "megatron"
    assert via_group["actor_rollout_ref.actor.strategy"] == "megatron" and via_group["critic.strategy"] == "megatron"
    fsdp = leaves(compose("ppo_trainer"))
    assert fsdp["model_engine"] == "dp" and fsdp["actor_rollout_ref.actor.strategy"] == "fsdp"
    assert fsdp == leaves(compose("ppo_trainer", group_overrides=["model_engine=dp"]))


def test_model_engine_on_the_command_line_selects_the_backend():
    micro = [f"{role}.ppo_micro_batch_size_per_gpu=4" for role in ("actor_rollout_ref.actor", "critic")]
    micro.append("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4")
    cfg = load_ppo_config(["model_engine=megatron", "actor_rollout_ref.rollout.name=hf", *micro])
    assert cfg.model_engine == "megatron"
    assert cfg.actor_rollout_ref.actor.strategy == "megatron" and "megatron" in cfg.actor_rollout_ref.ref


@pytest.mark.parametrize(
    "override, match",
    [
        ("model_engine=veomni", "model_engine=veomni is for upstream's VeOmni engine"),
        ("model_engine=torchtitan", "TorchTitan"),
        ("model_engine=foo", "model_engine=foo is for an engine named 'foo', which this build of verl does not have"),
        ("trainer.v1.trainer_mode=colocate_async", "trainer.v1.trainer_mode"),
        ("trainer.v1.trainer_mode=separate_async", "trainer.v1.trainer_mode"),
        ("trainer.v1.sampler.sync_refill_failed_groups=true", "sync_refill_failed_groups"),
        ("trainer.v1.sampler.custom_sampler.path=/x.py", "custom_sampler.path"),
        ("distillation.enabled=true", "distillation.enabled"),
        ("transfer_queue.enable=true", "transfer_queue.enable"),
        ("data.continuous_token.enable=true", "data.continuous_token.enable"),
        ("data.function_tool_path=/tools.py", "data.function_tool_path"),
        ("+data.mm_processor_kwargs.fps=2", "data.mm_processor_kwargs"),
        ("algorithm.filter_groups.max_inflight_gen_batches=2", "max_inflight_gen_batches"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(override, match):
    with pytest.raises(ConfigError, match=match):
        load_ppo_config([override], config_name="arith_demo")


def test_upstreams_neutral_values_and_settings_of_refused_features_are_accepted():
    cfg = load_ppo_config(
        [
            "trainer.use_v1=false",  # upstream's legacy trainer: the same step here
            "trainer.v1.trainer_mode=sync",
            "trainer.v1.separate_async.parameter_sync_step=2",  # read only by a refused mode
            "distillation.distillation_loss.loss_mode=k1",  # read only with distillation enabled
            "+distillation.teacher_models.gsm8k.model_path=/m",
            "data.continuous_token.model_family=qwen3",
            "data.audio_key=sound",
        ],
        config_name="arith_demo",
    )
    assert cfg.trainer.use_v1 is False and cfg.data.audio_key == "sound"
    assert cfg.data.gen_batch_size is None  # upstream's default: draw train_batch_size prompts at a time


def test_sapo_temperatures_under_policy_loss_are_read_as_the_actors():
    with pytest.warns(Warning, match=r"policy_loss.tau_neg=1.2 is read as actor_rollout_ref.actor.tau_neg"):
        cfg = load_ppo_config(["+actor_rollout_ref.actor.policy_loss.tau_neg=1.2"], config_name="arith_demo")
    assert cfg.actor_rollout_ref.actor.tau_neg == 1.2 and "tau_neg" not in cfg.actor_rollout_ref.actor.policy_loss
    with pytest.raises(ConfigError, match="policy_loss.tau_pos=1.5 and actor_rollout_ref.actor.tau_pos=2.0 disagree"):
        load_ppo_config(
            ["+actor_rollout_ref.actor.policy_loss.tau_pos=1.5", "actor_rollout_ref.actor.tau_pos=2.0"],
            config_name="arith_demo",
        )


def test_trtllms_expert_tensor_parallelism_is_accepted_at_one_only():
    cfg = load_ppo_config(["+actor_rollout_ref.rollout.moe_tensor_parallel_size=1"], config_name="arith_demo")
    assert cfg.actor_rollout_ref.rollout.moe_tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="moe_tensor_parallel_size=2 is for TensorRT-LLM"):
        load_ppo_config(["+actor_rollout_ref.rollout.moe_tensor_parallel_size=2"], config_name="arith_demo")
