"""The reward sections and the rollout's `server` section as typed configs (upstream's names).

Defaults are checked against upstream's values written out here (and against the composed YAML, which
must build into the same objects); behaviour through the code that reads them: the SandboxFusion
scorer `load_reward_manager` builds, DAPO's overlong buffer, the validator's messages.
"""

from __future__ import annotations

import functools

import pytest

from tests.config_helpers import section
from verl.trainer.config import (
    ConfigError,
    CustomRewardFunctionConfig,
    ModuleConfig,
    RewardManagerConfig,
    load_ppo_config,
)
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import RewardModelConfig, RolloutConfig, SandboxFusionConfig, ServerConfig


def test_defaults_are_upstreams_values():
    assert (SandboxFusionConfig().url, SandboxFusionConfig().max_concurrent, SandboxFusionConfig().memory_limit_mb) == (
        None,
        64,
        1024,
    )
    server = ServerConfig()
    assert (server.timeout, server.max_attempts, server.retry_delay, server.max_connections) == (60.0, 3, 2.0, 1000)
    assert server.max_start_wait_time == 300.0
    assert RolloutConfig().server == server
    reward_model = RewardModelConfig()
    assert (reward_model.enable, reward_model.enable_resource_pool, reward_model.n_gpus_per_node) == (False, False, 0)
    assert reward_model.nnodes == 0 and reward_model.sandbox_fusion == SandboxFusionConfig()
    manager = RewardManagerConfig()
    assert (manager.source, manager.name, manager.module.path) == ("register", "naive", None)
    assert CustomRewardFunctionConfig().name == "compute_score" and CustomRewardFunctionConfig().on_error == "raise"


@pytest.mark.parametrize(
    ("key", "cls"),
    [
        ("reward_model.sandbox_fusion", SandboxFusionConfig),
        ("reward_manager", RewardManagerConfig),
        ("custom_reward_function", CustomRewardFunctionConfig),
        ("reward_model.overlong_buffer", None),
    ],
)
def test_the_yaml_sections_build_into_the_class_defaults(key, cls):
    if cls is None:
        from verl.workers.config.reward_model import OverlongBufferConfig as cls
    assert omega_conf_to_dataclass(section(key), cls) == cls()


def test_the_whole_reward_model_section_builds_with_its_yaml_values():
    built = omega_conf_to_dataclass(section("reward_model"), RewardModelConfig)
    # the FSDP composition's values (dp_reward_loop.yaml), several of which differ from the class defaults
    assert built.strategy == "fsdp" and built.n_gpus_per_node == 8 and built.forward_max_token_len_per_gpu == 32768
    assert built.rollout.tensor_model_parallel_size == 2 and built.rollout.name == "???"  # unset: read by nothing
    assert built.model.fsdp_config.wrap_policy == {"min_num_params": 0}


def test_the_megatron_composition_builds_the_reward_model_with_its_megatron_section():
    cfg = load_ppo_config(
        ["actor_rollout_ref.rollout.name=hf"], config_name="ppo_megatron_trainer", validate=False
    ).reward_model
    built = omega_conf_to_dataclass(cfg, RewardModelConfig)
    assert built.strategy == "megatron" and built.megatron.tensor_model_parallel_size == 1 and built.nccl_timeout == 600


def test_a_sandbox_limit_below_one_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"reward_model.sandbox_fusion.max_concurrent=0 must be a positive integer"):
        SandboxFusionConfig(max_concurrent=0)
    with pytest.raises(ConfigError, match="reward_model.sandbox_fusion.memory_limit_mb=0"):
        load_ppo_config(["reward_model.sandbox_fusion.memory_limit_mb=0"], config_name="arith_demo")


def test_a_misspelled_server_key_is_refused_with_the_closest_one():
    with pytest.raises(ConfigError, match="timeout"):
        load_ppo_config(["+actor_rollout_ref.rollout.server.timout=5"], config_name="arith_demo")


def test_the_sandbox_section_reaches_the_built_in_scorer():
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.reward_score import default_compute_score

    cfg = load_ppo_config(
        [
            "reward_model.sandbox_fusion.url=http://127.0.0.1:1/run_code",
            "reward_model.sandbox_fusion.max_concurrent=3",
            "reward_model.sandbox_fusion.memory_limit_mb=256",
        ],
        config_name="arith_demo",
    )
    scorer = load_reward_manager(cfg, tokenizer=None, num_examine=0).compute_score
    assert isinstance(scorer, functools.partial) and scorer.func is default_compute_score
    assert scorer.keywords["sandbox_fusion_url"] == "http://127.0.0.1:1/run_code"
    assert scorer.keywords["concurrent_semaphore"].value == 3 and scorer.keywords["memory_limit_mb"] == 256


def test_the_overlong_buffer_section_reaches_dapo():
    from verl.trainer.ppo.reward import load_reward_manager

    cfg = load_ppo_config(
        [
            "reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=16",
            "reward_model.overlong_buffer.penalty_factor=0.5",
            "data.max_response_length=64",
        ],
        config_name="arith_demo",
    )
    manager = load_reward_manager(cfg, tokenizer=None, num_examine=0)
    assert (manager.overlong.enable, manager.overlong.len, manager.overlong.penalty_factor) == (True, 16, 0.5)
    assert manager.max_resp_len == 64


def test_module_config_is_the_importlib_section():
    built = omega_conf_to_dataclass({"source": "importlib", "module": {"path": "m.py"}}, RewardManagerConfig)
    assert built.module == ModuleConfig(path="m.py", name="custom_reward_manager")
