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


def test_reward_model_sp_is_refused_with_the_reason(defaults):
    cfg = copy.deepcopy(defaults)
    cfg["reward_model"][SP] = 2
    msg = error_of(cfg)
    assert f"reward_model.{SP}=2 is not implemented" in msg
    assert "padded rows" in msg
