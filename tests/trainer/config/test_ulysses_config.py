"""Ulysses sizes are checked before Ray starts: each wrong size fails naming the key and what to do.

The workers repeat these checks when they build the model (tests/workers/*ulysses*); here the
config alone must be enough. A model directory is a hand-written config.json, so the head counts
are known without building a model.
"""

from __future__ import annotations

import copy
import json

import pytest

from verl.trainer.config import ConfigError, load_ppo_config, validate_ppo_config

SP = "ulysses_sequence_parallel_size"


@pytest.fixture(scope="module")
def defaults() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(load_ppo_config(config_name="arith_demo"), resolve=True)


def model_dir(tmp_path, heads: int, kv_heads: int) -> str:
    path = tmp_path / f"m{heads}x{kv_heads}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv_heads}))
    return str(path)


def sp_config(base: dict, sp: int, *, gpus: int = 2, remove_padding: bool = True, path: str | None = None) -> dict:
    """The demo with the actor at sequence-parallel size `sp` on `gpus` workers."""
    cfg = copy.deepcopy(base)
    arr = cfg["actor_rollout_ref"]
    arr["actor"][SP] = sp
    arr["ref"][SP] = sp
    arr["model"]["use_remove_padding"] = remove_padding
    arr["actor"]["use_remove_padding"] = remove_padding
    cfg["trainer"]["n_gpus_per_node"] = gpus
    if path is not None:
        arr["model"]["path"] = path
    return cfg


def error_of(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        validate_ppo_config(cfg)
    return str(e.value)


def test_actor_sp_that_divides_the_workers_with_remove_padding_validates(defaults, tmp_path):
    validate_ppo_config(sp_config(defaults, 2, path=model_dir(tmp_path, 4, 2)))


def test_actor_sp_must_divide_the_workers(defaults):
    msg = error_of(sp_config(defaults, 3, gpus=4))
    assert f"actor_rollout_ref.actor.{SP}=3 does not divide the 4 workers" in msg
    assert "use one of [1, 2, 4]" in msg


def test_actor_sp_needs_remove_padding_and_names_the_model_key(defaults):
    msg = error_of(sp_config(defaults, 2, remove_padding=False))
    assert f"actor_rollout_ref.actor.{SP}=2 needs actor_rollout_ref.model.use_remove_padding=true" in msg


def test_actor_remove_padding_switched_off_apart_from_the_model_is_named(defaults):
    cfg = sp_config(defaults, 2)
    cfg["actor_rollout_ref"]["actor"]["use_remove_padding"] = False
    assert "needs actor_rollout_ref.actor.use_remove_padding=true" in error_of(cfg)


def test_reference_sp_must_equal_the_actor_s(defaults):
    cfg = sp_config(defaults, 2)
    cfg["actor_rollout_ref"]["ref"][SP] = 1
    msg = error_of(cfg)
    assert f"actor_rollout_ref.ref.{SP}=1 differs from actor_rollout_ref.actor.{SP}=2" in msg


@pytest.mark.parametrize(
    ("heads", "kv_heads", "sp", "ok"),
    [
        (4, 2, 2, True),
        (4, 1, 2, True),  # one key/value head is repeated on both ranks
        (6, 2, 4, False),  # 6 query heads do not split 4 ways
        (4, 3, 2, False),  # 3 key/value heads neither a multiple nor a divisor of 2
    ],
)
def test_attention_heads_must_split_evenly_across_sp_ranks(defaults, tmp_path, heads, kv_heads, sp, ok):
    cfg = sp_config(defaults, sp, gpus=4, path=model_dir(tmp_path, heads, kv_heads))
    cfg["data"]["train_batch_size"] = cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 32
    if ok:
        validate_ppo_config(cfg)
        return
    msg = error_of(cfg)
    assert f"actor_rollout_ref.actor.{SP}={sp} cannot split the attention heads" in msg
    assert f"num_attention_heads={heads}, num_key_value_heads={kv_heads}" in msg


def test_the_heads_come_from_hf_config_path_when_it_replaces_the_model_config(defaults, tmp_path):
    cfg = sp_config(defaults, 4, gpus=4, path=model_dir(tmp_path, 4, 2))
    cfg["data"]["train_batch_size"] = cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 32
    validate_ppo_config(cfg)
    config_dir = model_dir(tmp_path, 6, 2)
    cfg["actor_rollout_ref"]["model"]["hf_config_path"] = config_dir
    msg = error_of(cfg)
    assert f"cannot split the attention heads of {config_dir} (num_attention_heads=6, num_key_value_heads=2)" in msg


def test_a_model_path_that_is_not_a_local_directory_leaves_the_heads_to_the_worker(defaults):
    validate_ppo_config(sp_config(defaults, 2, path="Qwen/Qwen2.5-0.5B-Instruct"))


def test_critic_sp_is_checked_when_the_critic_trains(defaults, tmp_path):
    cfg = copy.deepcopy(defaults)
    cfg["algorithm"]["adv_estimator"] = "gae"
    cfg["critic"][SP] = 2
    cfg["critic"]["model"]["use_remove_padding"] = False
    cfg["critic"]["model"]["path"] = model_dir(tmp_path, 3, 3)
    msg = error_of(cfg)
    assert f"critic.{SP}=2 needs critic.model.use_remove_padding=true" in msg
    assert f"critic.{SP}=2 cannot split the attention heads" in msg


def test_critic_sp_is_not_checked_when_no_critic_runs(defaults):
    cfg = copy.deepcopy(defaults)
    cfg["critic"][SP] = 3
    validate_ppo_config(cfg)


# Upstream's newer spelling: the engine section's key (fsdp_config / model.fsdp_config). Either spelling
# alone sets the size, and every message names the key the user set.
ACTOR_NEW = f"actor_rollout_ref.actor.fsdp_config.{SP}"


def new_key_config(base: dict, sp: int, **kwargs) -> dict:
    """`sp_config` at size 1, then the actor's size set through its fsdp_config only."""
    cfg = sp_config(base, 1, **kwargs)
    cfg["actor_rollout_ref"]["actor"]["fsdp_config"][SP] = sp
    return cfg


def test_actor_sp_from_the_engine_key_alone_validates_and_the_reference_follows(defaults, tmp_path):
    validate_ppo_config(new_key_config(defaults, 2, path=model_dir(tmp_path, 4, 2)))


def test_errors_name_the_engine_key_when_that_is_the_one_set(defaults, tmp_path):
    msg = error_of(new_key_config(defaults, 3, gpus=4, remove_padding=False, path=model_dir(tmp_path, 4, 2)))
    assert f"{ACTOR_NEW}=3 does not divide the 4 workers" in msg
    assert f"{ACTOR_NEW}=3 needs actor_rollout_ref.model.use_remove_padding=true" in msg
    assert f"{ACTOR_NEW}=3 cannot split the attention heads" in msg
    assert f"actor_rollout_ref.actor.{SP}=" not in msg


def test_two_different_sizes_for_one_role_are_refused_naming_both_keys(defaults):
    cfg = sp_config(defaults, 2, gpus=4)
    cfg["actor_rollout_ref"]["actor"]["fsdp_config"][SP] = 4
    msg = error_of(cfg)
    assert f"actor_rollout_ref.actor.{SP}=2 and {ACTOR_NEW}=4 set two different Ulysses sizes" in msg
    cfg["actor_rollout_ref"]["actor"]["fsdp_config"][SP] = 2  # the same value twice is one size
    validate_ppo_config(cfg)


def test_reference_engine_key_must_equal_the_actor_s_naming_the_keys_set(defaults):
    cfg = new_key_config(defaults, 2, gpus=4)
    cfg["actor_rollout_ref"]["ref"]["fsdp_config"][SP] = 4
    msg = error_of(cfg)
    assert f"actor_rollout_ref.ref.fsdp_config.{SP}=4 differs from {ACTOR_NEW}=2" in msg
    cfg["actor_rollout_ref"]["ref"]["fsdp_config"][SP] = 2
    validate_ppo_config(cfg)


def test_critic_engine_key_is_checked_naming_it(defaults):
    cfg = copy.deepcopy(defaults)
    cfg["algorithm"]["adv_estimator"] = "gae"
    cfg["critic"]["model"]["use_remove_padding"] = False  # upstream v0.9's default is true
    for where in ("fsdp", "model.fsdp_config"):  # v0.9's spelling and the older one
        cfg = copy.deepcopy(defaults)
        cfg["algorithm"]["adv_estimator"] = "gae"
        cfg["critic"]["model"]["use_remove_padding"] = False
        section = cfg["critic"]["fsdp"] if where == "fsdp" else cfg["critic"]["model"]["fsdp_config"]
        section[SP] = 2
        assert f"critic.{where}.{SP}=2 needs critic.model.use_remove_padding=true" in error_of(cfg)
        cfg["critic"][SP] = 4
        assert f"critic.{SP}=4 and critic.{where}.{SP}=2 set two different" in error_of(cfg)


def test_critic_engine_sizes_in_both_spellings_must_agree(defaults):
    cfg = copy.deepcopy(defaults)
    cfg["algorithm"]["adv_estimator"] = "gae"
    cfg["critic"]["fsdp"][SP] = 2
    cfg["critic"]["model"]["fsdp_config"][SP] = 4
    assert f"critic.fsdp.{SP}=2 and critic.model.fsdp_config.{SP}=4 set two different" in error_of(cfg)


def rm_config(base: dict, sp: int, remove_padding: bool, strategy: str = "fsdp") -> dict:
    cfg = copy.deepcopy(base)
    rm = cfg["reward_model"]
    rm.update(enable=True, strategy=strategy)
    rm[SP] = sp
    rm["model"]["use_remove_padding"] = remove_padding
    rm["model"]["path"] = "~/models/rm"  # upstream v0.9's default model path is null
    cfg["trainer"]["n_gpus_per_node"] = 2
    return cfg


def test_reward_model_sp_needs_remove_padding_and_divides_the_workers(defaults):
    validate_ppo_config(rm_config(defaults, 2, True))
    assert f"reward_model.{SP}=2 needs reward_model.model.use_remove_padding=true" in error_of(
        rm_config(defaults, 2, False)
    )
    assert f"reward_model.{SP}=4 does not divide the 2 workers" in error_of(rm_config(defaults, 4, True))


def test_reward_model_sp_is_fsdp_only(defaults):
    msg = error_of(rm_config(defaults, 2, True, strategy="megatron"))
    assert f"reward_model.{SP}=2 with reward_model.strategy=megatron" in msg
