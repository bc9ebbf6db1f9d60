"""Upstream's `EngineConfig`, `FSDPCriticModelCfg` and `TrainingWorkerConfig` (verl.workers.config):
the engine sections share one base, an upstream critic config naming its model class builds, and the
bundle one training engine is built from refuses what it cannot honour."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import validate_ppo_config
from verl.trainer.config.loader import compose
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import (
    CriticModelConfig,
    EngineConfig,
    FSDPCriticModelCfg,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    McoreEngineConfig,
    TrainingWorkerConfig,
    VeOmniEngineConfig,
)


def test_engine_config_defaults_are_upstreams():
    # upstream's EngineConfig, for the keys both engines here hold, written out by hand
    base = EngineConfig()
    assert (base.param_offload, base.optimizer_offload, base.forward_only) == (False, False, False)
    assert (base.dtype, base.seed) == ("bfloat16", 42)


@pytest.mark.parametrize(
    "name, section, cls",
    [("ppo_trainer", "fsdp_config", FSDPEngineConfig), ("ppo_megatron_trainer", "megatron", McoreEngineConfig)],
)
def test_each_engine_section_is_an_engine_config_with_the_yamls_shared_keys(name, section, cls):
    cfg = compose(name)
    raw = cfg.actor_rollout_ref.actor[section]
    built = omega_conf_to_dataclass(raw)
    assert type(built) is cls and isinstance(built, EngineConfig)
    for key in ("param_offload", "optimizer_offload", "dtype", "seed"):
        assert getattr(built, key) == raw[key], key


def test_an_upstream_critic_model_target_builds_the_fsdp_critic_model_class():
    cfg = compose("arith_demo")
    cfg.algorithm.adv_estimator = "gae"
    # upstream's critic/dp_critic.yaml names the value model's class
    OmegaConf.update(cfg, "critic.model._target_", "verl.workers.config.FSDPCriticModelCfg", force_add=True)
    validate_ppo_config(cfg)
    critic = omega_conf_to_dataclass(cfg.critic)
    assert type(critic.model) is FSDPCriticModelCfg
    assert isinstance(critic.model, CriticModelConfig)
    assert critic.model.path == cfg.critic.model.path
    assert type(critic.model.fsdp_config) is FSDPEngineConfig


def test_fsdp_critic_model_defaults_are_upstreams():
    model = FSDPCriticModelCfg()
    # upstream v0.9 composes the critic's model from model/hf_model.yaml: remove padding on
    assert (model.use_shm, model.enable_activation_offload, model.use_remove_padding) == (False, False, True)
    assert (model.enable_gradient_checkpointing, model.lora_rank, model.lora_alpha) == (True, 0, 16)
    assert model.target_modules == "all-linear"


def test_training_worker_config_has_upstreams_fields():
    names = [f.name for f in dataclasses.fields(TrainingWorkerConfig) if f.name != "_target_"]
    assert names == [
        "model_type",
        "model_config",
        "engine_config",
        "optimizer_config",
        "checkpoint_config",
        "profiler_config",
        "auto_select_engine_optim_fn",
    ]


def test_training_worker_config_bundles_a_roles_sections():
    cfg = compose("ppo_trainer")
    actor = cfg.actor_rollout_ref.actor
    built = TrainingWorkerConfig(
        model_type="language_model",
        model_config=omega_conf_to_dataclass(cfg.actor_rollout_ref.model),
        engine_config=omega_conf_to_dataclass(actor.fsdp_config),
        optimizer_config=omega_conf_to_dataclass(actor.optim),
    )
    assert type(built.model_config) is HFModelConfig
    assert type(built.optimizer_config) is FSDPOptimizerConfig
    assert built.optimizer_config.lr == pytest.approx(1e-6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.model_type = "value_model"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"model_type": "reward_model"}, ValueError, "model_type='reward_model'.*language_model, value_model"),
        ({"engine_config": {"param_offload": True}}, TypeError, "engine_config is a dict.*omega_conf_to_dataclass"),
    ],
)
def test_training_worker_config_refuses_what_it_cannot_honour(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainingWorkerConfig(**kwargs)


def test_policy_loss_holds_bypass_settings_only_for_the_bypass_loss():
    from verl.workers.config import PolicyLossConfig

    settings = {"bypass_mode": True, "rollout_is": "token"}
    assert PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=settings).rollout_correction == settings
    assert PolicyLossConfig().rollout_correction is None
    with pytest.raises(ValueError, match="loss_mode='vanilla'.*algorithm.rollout_correction.bypass_mode=true"):
        PolicyLossConfig(rollout_correction=settings)


# upstream's EngineConfig batch keys and their dataclass defaults, written out by hand
_UPSTREAM_BATCH_DEFAULTS = {
    "use_dynamic_bsz": True,
    "max_token_len_per_gpu": None,
    "micro_batch_size_per_gpu": None,
    "infer_max_token_len_per_gpu": None,
    "infer_micro_batch_size_per_gpu": None,
    "use_fused_kernels": False,
    "use_remove_padding": True,
    "grad_offload": False,
}


@pytest.mark.parametrize("cls", [EngineConfig, FSDPEngineConfig, McoreEngineConfig, VeOmniEngineConfig])
def test_every_engine_section_has_upstreams_base_batch_keys_declared_once(cls):
    built = cls()
    for key, default in _UPSTREAM_BATCH_DEFAULTS.items():
        assert getattr(built, key) == default, key
    # declared on the base only: VeOmni's copies moved down, FSDP adds no second declaration of a batch key
    own = set(vars(cls).get("__annotations__", {})) if cls is not EngineConfig else set()
    assert not own & (set(_UPSTREAM_BATCH_DEFAULTS) - {"grad_offload", "use_remove_padding"})


def test_the_batch_keys_are_mutable_as_upstreams_and_the_rest_stays_frozen():
    engine = FSDPEngineConfig()
    engine.micro_batch_size_per_gpu = 4
    engine.use_dynamic_bsz = False
    assert (engine.micro_batch_size_per_gpu, engine.use_dynamic_bsz) == (4, False)
    with pytest.raises(Exception, match="fsdp_size"):
        engine.fsdp_size = 2


def test_the_ulysses_size_and_megatron_sequence_parallel_are_mutable_as_upstreams():
    fsdp = FSDPEngineConfig()
    fsdp.ulysses_sequence_parallel_size = 2
    assert fsdp.ulysses_sequence_parallel_size == 2
    mcore = McoreEngineConfig(tensor_model_parallel_size=2)
    mcore.sequence_parallel = False
    assert mcore.sequence_parallel is False
    with pytest.raises(AttributeError, match="tensor_model_parallel_size is frozen"):
        mcore.tensor_model_parallel_size = 4


@pytest.mark.parametrize("tp, asked, held", [(1, True, False), (1, False, False), (2, True, True), (2, False, False)])
def test_megatron_sequence_parallel_is_off_without_tensor_parallelism(tp, asked, held):
    assert McoreEngineConfig(tensor_model_parallel_size=tp, sequence_parallel=asked).sequence_parallel is held


@pytest.mark.parametrize(
    "name, key",
    [
        ("arith_demo", "actor_rollout_ref.actor.fsdp_config.use_dynamic_bsz"),
        ("arith_demo", "actor_rollout_ref.actor.fsdp_config.micro_batch_size_per_gpu"),
        ("arith_demo_megatron", "actor_rollout_ref.actor.megatron.max_token_len_per_gpu"),
    ],
)
def test_an_engine_batch_key_under_a_ppo_role_is_refused_naming_the_roles_key(name, key):
    cfg = compose(name)
    OmegaConf.update(cfg, key, 7 if "len" in key or "size" in key else True, force_add=True)
    with pytest.raises(ValueError, match=rf"{key}=.*the role's own keys hold it .*use_dynamic_bsz"):
        validate_ppo_config(cfg)


def test_fsdp_grad_offload_is_refused_pointing_at_offload_policy():
    cfg = compose("arith_demo")
    OmegaConf.update(cfg, "actor_rollout_ref.actor.fsdp_config.grad_offload", True, force_add=True)
    with pytest.raises(ValueError, match=r"fsdp_config.grad_offload=true is not implemented.*offload_policy"):
        validate_ppo_config(cfg)
