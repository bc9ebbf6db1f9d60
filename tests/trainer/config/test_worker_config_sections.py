"""Optimizer and FSDP engine sections (`verl.workers.config`): the YAML's `_target_` picks the engine's
class, its defaults are the YAML's, its own checks run when built, and the validator and the docs
list the keys only one subclass holds."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import ConfigError, validate_ppo_config
from verl.trainer.config.docgen import render
from verl.trainer.config.loader import compose
from verl.trainer.config.validate import schema_keys
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import (
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    McoreOptimizerConfig,
    OptimizerConfig,
)


def _without_target(config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "_target_"}


@pytest.mark.parametrize(
    "name, cls",
    [("ppo_trainer", FSDPOptimizerConfig), ("ppo_megatron_trainer", McoreOptimizerConfig)],
)
def test_each_trainer_builds_its_engines_optimizer_class_with_the_yaml_defaults(name, cls):
    cfg = compose(name)
    for section in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        built = omega_conf_to_dataclass(section)
        assert type(built) is cls
        # the YAML sets the roles' own learning rates; everything else is the class default
        assert _without_target(built) == _without_target(cls(lr=built.lr))
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim).lr == pytest.approx(1e-6)
    assert omega_conf_to_dataclass(cfg.critic.optim).lr == pytest.approx(1e-5)


def test_optimizer_defaults_are_upstreams():
    # upstream's optim/fsdp.yaml and optim/megatron.yaml, written out by hand
    fsdp = FSDPOptimizerConfig()
    assert (fsdp.lr, fsdp.weight_decay, fsdp.betas, fsdp.clip_grad) == (1e-3, 0.01, [0.9, 0.999], 1.0)
    assert (fsdp.lr_warmup_steps, fsdp.lr_warmup_steps_ratio, fsdp.total_training_steps) == (-1, 0.0, -1)
    assert (fsdp.optimizer, fsdp.optimizer_impl, fsdp.lr_scheduler_type) == ("AdamW", "torch.optim", "constant")
    assert (fsdp.min_lr_ratio, fsdp.num_cycles, fsdp.warmup_style, fsdp.override_optimizer_config) == (
        0.0,
        0.5,
        None,
        None,
    )
    mcore = McoreOptimizerConfig()
    assert (mcore.optimizer, mcore.lr_decay_style, mcore.lr_decay_steps, mcore.min_lr) == (
        "adam",
        "constant",
        None,
        0.0,
    )
    assert (mcore.lr_wsd_decay_style, mcore.override_optimizer_config) == ("exponential", {})
    assert not hasattr(mcore, "optimizer_impl") and not hasattr(fsdp, "lr_decay_style")


def test_fsdp_engine_section_builds_with_the_yaml_defaults():
    built = omega_conf_to_dataclass(compose("ppo_trainer").actor_rollout_ref.actor.fsdp_config)
    assert type(built) is FSDPEngineConfig
    assert _without_target(built) == _without_target(FSDPEngineConfig())
    assert (built.wrap_policy, built.fsdp_size, built.model_dtype, built.dtype) == (
        {"min_num_params": 0},
        -1,
        "fp32",
        "bfloat16",
    )
    critic = omega_conf_to_dataclass(compose("ppo_trainer").critic.model.fsdp_config)
    assert type(critic) is FSDPEngineConfig


def test_the_schedule_length_may_be_filled_in_later_but_the_learning_rate_may_not():
    optim = FSDPOptimizerConfig(lr=1e-6)
    optim.total_training_steps = 20  # upstream's `_mutable_fields`: the trainer knows the run length
    assert optim.total_training_steps == 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        optim.lr = 1.0


def test_the_older_warmup_style_wins_as_upstream():
    assert FSDPOptimizerConfig(warmup_style="cosine").lr_scheduler_type == "cosine"
    assert FSDPOptimizerConfig(lr_scheduler_type="cosine").lr_scheduler_type == "cosine"


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (FSDPOptimizerConfig, {"lr": 0.0}, r"optim\.lr=0\.0 must be > 0"),
        (McoreOptimizerConfig, {"lr": -1e-5}, r"optim\.lr=-1e-05 must be > 0"),
        (FSDPOptimizerConfig, {"lr_warmup_steps_ratio": 1.5}, r"optim\.lr_warmup_steps_ratio=1\.5 must be between 0"),
        (FSDPOptimizerConfig, {"lr_scheduler_type": "linear"}, r"lr_scheduler_type='linear' is not a schedule here"),
        (McoreOptimizerConfig, {"lr_decay_style": "WSD"}, r"lr_decay_style='WSD' is not a schedule here"),
    ],
)
def test_a_bad_optimizer_value_is_refused_when_built(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("name", ["arith_demo", "arith_demo_megatron"])
@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
def test_the_validator_names_the_roles_key_for_a_section_check(name, role):
    cfg = OmegaConf.to_container(compose(name), resolve=True)
    node = cfg
    for part in role.split("."):
        node = node[part]
    node["optim"]["lr_warmup_steps_ratio"] = 2.0
    with pytest.raises(ConfigError, match=rf"{role}\.optim\.lr_warmup_steps_ratio=2\.0 must be between 0 and 1"):
        validate_ppo_config(cfg)


def test_a_key_of_the_other_engines_optimizer_is_unknown_with_a_hint():
    cfg = OmegaConf.to_container(compose("arith_demo"), resolve=True)
    bad = copy.deepcopy(cfg)
    bad["actor_rollout_ref"]["actor"]["optim"]["lr_decay_style"] = "cosine"  # a Megatron key on an FSDP section
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref\.actor\.optim\.lr_decay_style'"):
        validate_ppo_config(bad)
    bad = copy.deepcopy(cfg)
    bad["actor_rollout_ref"]["actor"]["optim"]["optimizer_imp"] = "torch.optim"
    with pytest.raises(ConfigError, match=r"optimizer_imp.*optimizer_impl"):
        validate_ppo_config(bad)


def test_subclass_only_keys_are_listed_for_the_docs_and_hints():
    keys = set(schema_keys())
    assert {"actor_rollout_ref.actor.optim.optimizer_impl", "actor_rollout_ref.actor.optim.lr_decay_style"} <= keys
    assert {"critic.optim.num_cycles", "critic.optim.min_lr"} <= keys
    page = render()  # marked with the composition that holds them, as other optional keys are
    assert "| `optimizer_impl` | str | `torch.optim` | yes | *fsdp* " in page
    assert "| `lr_decay_style` | str | `constant` | yes | *megatron* " in page
    assert "| `optimizer` | str | `AdamW` | yes | Optimizer class" in page  # both engines' classes have it
    assert issubclass(FSDPOptimizerConfig, OptimizerConfig) and issubclass(McoreOptimizerConfig, OptimizerConfig)
