"""Upstream's `verl.workers.config.{VeOmniEngineConfig, VeOmniOptimizerConfig, build_optimizer}`: the
VeOmni sections build with upstream's defaults while the engine itself is refused by name, and
`build_optimizer` gives the optimizer a hand-built torch one is (same groups, hyper-parameters, step)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import (
    EngineConfig,
    FSDPOptimizerConfig,
    McoreOptimizerConfig,
    OptimizerConfig,
    VeOmniEngineConfig,
    VeOmniOptimizerConfig,
    build_optimizer,
)

# upstream's engine/veomni.yaml and optim/veomni.yaml values that differ from the dataclass defaults
VEOMNI_ENGINE_YAML = {
    "_target_": "verl.workers.config.VeOmniEngineConfig",
    "data_parallel_mode": "fsdp2",
    "mixed_precision": True,
    "enable_full_shard": True,
    "forward_prefetch": True,
    "use_torch_compile": False,
}
VEOMNI_OPTIM_YAML = {
    "_target_": "verl.workers.config.VeOmniOptimizerConfig",
    "lr_scheduler_type": "cosine",
    "override_optimizer_config": {},
}


def test_veomni_engine_config_has_upstreams_defaults_and_builds_from_its_yaml():
    default = VeOmniEngineConfig()
    assert isinstance(default, EngineConfig)
    assert (default.strategy, default.data_parallel_mode, default.init_device, default.ckpt_manager) == (
        "veomni",
        "fsdp",
        "meta",
        "dcp",
    )
    assert (default.attn_implementation, default.moe_implementation, default.basic_modules) == (
        "flash_attention_2",
        "fused",
        [],
    )
    assert (default.use_torch_compile, default.mixed_precision, default.seed, default.param_offload) == (
        True,
        False,
        42,
        False,
    )
    built = omega_conf_to_dataclass(VEOMNI_ENGINE_YAML)
    assert type(built) is VeOmniEngineConfig
    assert (built.data_parallel_mode, built.mixed_precision, built.enable_full_shard, built.use_torch_compile) == (
        "fsdp2",
        True,
        True,
        False,
    )
    with pytest.raises(ValueError, match="strategy='fsdp'"):
        VeOmniEngineConfig(strategy="fsdp")


def test_veomni_optimizer_config_has_upstreams_defaults_and_builds_from_its_yaml():
    default = VeOmniOptimizerConfig()
    assert isinstance(default, OptimizerConfig)
    assert (default.optimizer, default.lr, default.lr_min, default.lr_start, default.lr_decay_ratio) == (
        "adamw",
        1e-3,
        0.0,
        0.0,
        1.0,
    )
    assert (default.lr_scheduler_type, default.override_optimizer_config, default.betas) == (
        "constant",
        None,
        [0.9, 0.999],
    )
    built = omega_conf_to_dataclass(VEOMNI_OPTIM_YAML)
    assert type(built) is VeOmniOptimizerConfig and built.lr_scheduler_type == "cosine"
    with pytest.raises(ValueError, match="lr_scheduler_type='linear'"):
        VeOmniOptimizerConfig(lr_scheduler_type="linear")


def test_veomni_engine_config_carries_upstreams_base_batch_keys_and_only_those_are_mutable():
    default = VeOmniEngineConfig()
    # upstream's EngineConfig defaults, written out
    assert (default.use_dynamic_bsz, default.max_token_len_per_gpu, default.micro_batch_size_per_gpu) == (
        True,
        None,
        None,
    )
    assert (default.infer_max_token_len_per_gpu, default.infer_micro_batch_size_per_gpu) == (None, None)
    assert (default.use_fused_kernels, default.use_remove_padding, default.grad_offload, default.full_determinism) == (
        False,
        True,
        False,
        False,
    )
    # the SFT engine trainer fills the batch keys in after building the section, as upstream's does
    default.micro_batch_size_per_gpu = 4
    default.max_token_len_per_gpu = 8192
    default.use_dynamic_bsz = False
    assert (default.micro_batch_size_per_gpu, default.max_token_len_per_gpu, default.use_dynamic_bsz) == (
        4,
        8192,
        False,
    )
    with pytest.raises(dataclasses.FrozenInstanceError, match="VeOmniEngineConfig.ulysses_parallel_size is frozen"):
        default.ulysses_parallel_size = 2


# upstream's engine/veomni.yaml and optim/veomni.yaml, every key, written out by hand
UPSTREAM_ENGINE_YAML = {
    "_target_": "verl.workers.config.VeOmniEngineConfig",
    "param_offload": False,
    "optimizer_offload": False,
    "data_parallel_mode": "fsdp2",
    "data_parallel_size": 1,
    "data_parallel_replicate_size": 1,
    "data_parallel_shard_size": 1,
    "tensor_parallel_size": 1,
    "expert_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "context_parallel_size": 1,
    "ulysses_parallel_size": 1,
    "mixed_precision": True,
    "seed": 42,
    "full_determinism": False,
    "init_device": "meta",
    "enable_full_shard": True,
    "ckpt_manager": "dcp",
    "forward_prefetch": True,
    "strategy": "veomni",
    "use_torch_compile": False,
    "forward_only": False,
    "enable_fsdp_offload": False,
    "enable_reentrant": False,
    "attn_implementation": "flash_attention_2",
    "moe_implementation": "fused",
    "force_use_huggingface": False,
    "activation_gpu_limit": 0.0,
}
UPSTREAM_OPTIM_YAML = {
    "_target_": "verl.workers.config.VeOmniOptimizerConfig",
    "optimizer": "adamw",
    "lr": 1e-3,
    "lr_min": 0.0,
    "lr_start": 0.0,
    "lr_warmup_steps_ratio": 0.0,
    "lr_decay_ratio": 1.0,
    "total_training_steps": -1,
    "weight_decay": 0.01,
    "lr_warmup_steps": -1,
    "betas": [0.9, 0.999],
    "clip_grad": 1.0,
    "lr_scheduler_type": "cosine",
    "override_optimizer_config": {},
}


def test_upstreams_veomni_yaml_files_compose_with_plain_hydra_and_build_their_sections(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from verl.trainer.config import CONFIG_DIR

    assert OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "engine" / "veomni.yaml")) == UPSTREAM_ENGINE_YAML
    assert OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "optim" / "veomni.yaml")) == UPSTREAM_OPTIM_YAML
    # upstream's SFT engine trainer layout: engine and optim groups, switched to veomni on the command line
    (tmp_path / "sft_engine.yaml").write_text(
        "defaults:\n  - engine@engine: fsdp\n  - optim@optim: fsdp\n  - _self_\n"
        f"hydra:\n  searchpath:\n    - file://{CONFIG_DIR}\n"
    )
    overrides = ["engine=veomni", "optim=veomni", "engine.ulysses_parallel_size=2", "optim.lr=1e-5"]
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="sft_engine", overrides=overrides)
    assert OmegaConf.to_container(cfg.engine) == {**UPSTREAM_ENGINE_YAML, "ulysses_parallel_size": 2}
    assert OmegaConf.to_container(cfg.optim) == {**UPSTREAM_OPTIM_YAML, "lr": 1e-5}
    engine, optim = omega_conf_to_dataclass(cfg.engine), omega_conf_to_dataclass(cfg.optim)
    assert type(engine) is VeOmniEngineConfig and type(optim) is VeOmniOptimizerConfig
    assert (engine.ulysses_parallel_size, engine.data_parallel_mode, engine.enable_full_shard) == (2, "fsdp2", True)
    assert (engine.use_dynamic_bsz, engine.micro_batch_size_per_gpu) == (True, None)  # base keys: dataclass defaults
    assert (optim.lr, optim.lr_scheduler_type, optim.betas) == (1e-5, "cosine", [0.9, 0.999])


def test_selecting_the_veomni_engine_is_refused_in_one_line():
    from verl.trainer.config import ConfigError, load_ppo_config
    from verl.workers.engine import EngineRegistry

    with pytest.raises(ValueError, match=r"^strategy 'veomni' selects upstream's VeOmni engine, which is not in this"):
        EngineRegistry.get_engine_cls("language_model", "veomni")
    for key in ("actor_rollout_ref.actor.strategy", "critic.strategy", "reward_model.strategy"):
        with pytest.raises(ConfigError) as raised:
            load_ppo_config([f"{key}=veomni"], config_name="arith_demo")
        message = str(raised.value)
        assert f"{key}=veomni is for upstream's VeOmni engine" in message and "\n" not in message


def _model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _one_step(model: torch.nn.Linear, optimizer: torch.optim.Optimizer) -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 5
    model(x).square().sum().backward()
    optimizer.step()


HYPER = ("lr", "betas", "weight_decay", "eps", "amsgrad", "maximize")


def test_adamw_equals_a_hand_built_one_in_groups_hyper_parameters_and_step():
    config = FSDPOptimizerConfig(lr=0.05, weight_decay=0.1, betas=[0.8, 0.95])
    ours_model, ref_model = _model(), _model()
    ours = build_optimizer(ours_model.parameters(), config)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.05, weight_decay=0.1, betas=(0.8, 0.95))
    assert type(ours) is torch.optim.AdamW
    assert [{k: g[k] for k in HYPER} for g in ours.param_groups] == [{k: g[k] for k in HYPER} for g in ref.param_groups]
    before = ours_model.weight.detach().double().clone()
    _one_step(ours_model, ours)
    _one_step(ref_model, ref)
    torch.testing.assert_close(ours_model.weight, ref_model.weight, rtol=0, atol=1e-6)
    # float64 by hand: AdamW's first step moves each weight by lr * (wd * w + g / (|g| + eps))
    grad = ours_model.weight.grad.double()
    expected = before - 0.05 * (0.1 * before + grad / (grad.abs() + 1e-8))
    torch.testing.assert_close(ours_model.weight.detach().double(), expected, rtol=0, atol=1e-6)


def test_param_groups_keep_their_own_settings_and_overrides_reach_the_optimizer():
    model = _model()
    groups = [{"params": [model.weight], "lr": 0.5}, {"params": [model.bias]}]
    config = FSDPOptimizerConfig(
        lr=0.01, weight_decay=0.0, optimizer="SGD", override_optimizer_config={"momentum": 0.9, "nesterov": True}
    )
    ours = build_optimizer(groups, config)
    ref = torch.optim.SGD(
        [{"params": [model.weight], "lr": 0.5}, {"params": [model.bias]}],
        lr=0.01,
        weight_decay=0.0,
        momentum=0.9,
        nesterov=True,
    )
    assert type(ours) is torch.optim.SGD
    keys = ("lr", "momentum", "nesterov", "weight_decay", "dampening")
    assert [{k: g[k] for k in keys} for g in ours.param_groups] == [{k: g[k] for k in keys} for g in ref.param_groups]
    assert "betas" not in ours.param_groups[0]  # not an Adam-family name: no betas passed


def test_a_megatron_section_names_adam_and_a_missing_package_is_named():
    assert type(build_optimizer(_model().parameters(), McoreOptimizerConfig(lr=0.1))) is torch.optim.AdamW
    with pytest.raises(ImportError, match="no_such_optimizer_pkg"):
        build_optimizer(_model().parameters(), FSDPOptimizerConfig(optimizer_impl="no_such_optimizer_pkg.optim"))
    with pytest.raises(ValueError, match="'AdamQ' is not an optimizer class of 'torch.optim'"):
        build_optimizer(_model().parameters(), FSDPOptimizerConfig(optimizer="AdamQ"))
