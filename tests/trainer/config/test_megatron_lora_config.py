"""`actor_rollout_ref.model.lora.*` (LoRA on the Megatron actor) validates before Ray starts: rank > 0
turns it on, a bad value names the key and the valid choices, and what is not implemented (another
adapter type, a pretrained adapter, the key on the other backend) is refused with what to do
instead; the Megatron critic's `critic.model.lora.*` follows the same rules under its own key."""

from __future__ import annotations

import copy

import pytest

from tests.trainer.config.test_config_validation import error_of, with_
from verl.trainer.config import load_ppo_config, validate_ppo_config


@pytest.fixture(scope="module")
def megatron_defaults() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(load_ppo_config(config_name="arith_demo_megatron"), resolve=True)


@pytest.fixture(scope="module")
def fsdp_defaults() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(load_ppo_config(config_name="arith_demo"), resolve=True)


def lora(base, **keys) -> dict:
    return with_(base, **{f"actor_rollout_ref__model__lora__{k}": v for k, v in keys.items()})


def test_a_positive_rank_with_upstream_keys_validates(megatron_defaults):
    cfg = lora(megatron_defaults, rank=8, alpha=16, lora_A_init_method="kaiming", dropout=0.05)
    validate_ppo_config(cfg)


def test_an_unknown_target_module_lists_the_valid_ones(megatron_defaults):
    msg = error_of(lora(megatron_defaults, rank=8, target_modules=["linear_qkv", "q_proj"]))
    assert "unknown module 'q_proj'" in msg
    assert "['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2']" in msg


@pytest.mark.parametrize(
    "keys,expected",
    [
        ({"type": "dora"}, "lora.type='dora' is not implemented"),
        ({"alpha": 0}, "lora.alpha=0 must be positive"),
        ({"dropout": 1.5}, "lora.dropout=1.5 must be in [0, 1)"),
        ({"dropout_position": "middle"}, "choose one of ['pre', 'post']"),
        ({"lora_B_init_method": "ones"}, "lora.lora_B_init_method='ones': choose one of"),
        ({"target_modules": []}, "target_modules is empty"),
        (
            {"adapter_path": "/ckpt/adapter"},
            "actor_rollout_ref.model.lora.adapter_path=/ckpt/adapter is not implemented",
        ),
        ({"dtype": "int8"}, "lora.dtype='int8'"),
        ({"a2a_experimental": True}, "lora.a2a_experimental=true (megatron-bridge's all-to-all"),
    ],
)
def test_bad_lora_values_are_refused_with_the_key(megatron_defaults, keys, expected):
    assert expected in error_of(lora(megatron_defaults, rank=8, **keys))


def test_bad_values_do_not_matter_while_lora_is_off(megatron_defaults):
    validate_ppo_config(lora(megatron_defaults, rank=0, type="dora", target_modules=["q_proj"]))


def test_a_negative_rank_is_refused(megatron_defaults):
    assert "model.lora.rank=-1 must be 0" in error_of(lora(megatron_defaults, rank=-1))


def test_lora_with_expert_parallelism_validates(megatron_defaults):
    """Adapters on the MoE expert layers are implemented (tests/models/mcore/test_mcore_lora_moe.py): the
    default targets with expert parallelism pass validation."""
    cfg = lora(megatron_defaults, rank=8)
    cfg["actor_rollout_ref"]["actor"]["megatron"]["expert_model_parallel_size"] = 2
    validate_ppo_config(cfg)


def test_each_backend_s_lora_key_on_the_other_backend_is_refused(megatron_defaults, fsdp_defaults):
    cfg = copy.deepcopy(fsdp_defaults)  # ppo_trainer has no model.lora section: a user's config adds one
    cfg["actor_rollout_ref"]["model"]["lora"] = {**megatron_defaults["actor_rollout_ref"]["model"]["lora"], "rank": 8}
    msg = error_of(cfg)
    assert "model.lora.rank=8 is the megatron backend's LoRA" in msg
    assert "actor_rollout_ref.model.lora_rank" in msg
    msg = error_of(with_(megatron_defaults, actor_rollout_ref__model__lora_rank=8))
    assert "actor_rollout_ref.model.lora_rank=8 (LoRA adapters) is the FSDP backend's LoRA" in msg


def _gae(base) -> dict:
    return with_(base, algorithm__adv_estimator="gae", critic__enable=True)


def test_a_megatron_critic_s_lora_validates_and_names_its_own_key(megatron_defaults):
    cfg = _gae(megatron_defaults)
    cfg["critic"]["model"]["lora"].update(rank=8, alpha=16, target_modules=["linear_qkv", "linear_fc2"])
    validate_ppo_config(cfg)
    cfg["critic"]["model"]["lora"]["type"] = "dora"
    assert "critic.model.lora.type='dora' is not implemented" in error_of(cfg)
    cfg["critic"]["model"]["lora"].update(type="lora", rank=-2)
    assert "critic.model.lora.rank=-2 must be 0" in error_of(cfg)
    cfg["critic"]["model"]["lora"].update(rank=8, adapter_path="/ckpt/adapter")
    assert "critic.model.lora.adapter_path=/ckpt/adapter is not implemented" in error_of(cfg)


def test_each_backend_s_critic_lora_key_on_the_other_backend_is_refused(megatron_defaults, fsdp_defaults):
    cfg = _gae(fsdp_defaults)
    cfg["critic"]["model"]["lora"] = {**megatron_defaults["critic"]["model"]["lora"], "rank": 8}
    msg = error_of(cfg)
    assert "critic.model.lora.rank=8 is the megatron critic's LoRA, but critic.strategy=fsdp" in msg
    assert "set critic.model.lora_rank" in msg
    msg = error_of(with_(_gae(megatron_defaults), critic__model__lora_rank=8))
    assert "critic.model.lora_rank=8 is the FSDP critic's LoRA (peft), but critic.strategy=megatron" in msg
    assert "set critic.model.lora.rank" in msg
