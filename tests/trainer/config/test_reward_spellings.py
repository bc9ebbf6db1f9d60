"""Upstream v0.9's `reward.*` keys and their older spellings load to one effective reward config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl.experimental.reward_loop import migrate_legacy_reward_impl
from verl.trainer.config.errors import ConfigError
from verl.trainer.config.loader import compose, compose_config, load_ppo_config
from verl.trainer.config.reward_migration import resolve_reward_spellings
from verl.trainer.ppo.reward import _reward_manager_class, get_custom_reward_fn

FN = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n"


def _load(overrides):
    return load_ppo_config(overrides, config_name="arith_demo")


def _effective(cfg) -> dict:
    keep = ("num_workers", "custom_reward_function", "reward_manager", "reward_model", "sandbox_fusion")
    out = {
        k: OmegaConf.to_container(cfg.reward[k]) if OmegaConf.is_config(cfg.reward[k]) else cfg.reward[k] for k in keep
    }
    out["reward_kwargs"] = OmegaConf.to_container(cfg.reward.get("reward_kwargs") or OmegaConf.create({}))
    return out


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_composed_configs_hold_v09_defaults_and_null_legacy_keys(name):
    cfg = compose(name)
    assert cfg.reward.num_workers == 8 and cfg.reward.reward_model.n_gpus_per_node == 8
    assert cfg.reward.reward_manager.name == "naive" and cfg.reward.custom_reward_function.name == "compute_score"
    assert cfg.reward_model.enable is None and cfg.reward_model.reward_manager is None
    assert cfg.custom_reward_function.name is None and cfg.sandbox_fusion.max_concurrent is None


def test_both_spellings_load_to_the_same_reward_config(tmp_path):
    fn = tmp_path / "rw.py"
    fn.write_text(FN)
    old = _load(
        [
            "reward_model.reward_manager=dapo",
            f"custom_reward_function.path={fn}",
            "reward_model.num_workers=3",
            "+reward_model.reward_kwargs.max_resp_len=64",
            "reward_model.sandbox_fusion.url=http://localhost:8080/run_code",
        ]
    )
    new = _load(
        [
            "reward.reward_manager.name=dapo",
            f"reward.custom_reward_function.path={fn}",
            "reward.num_workers=3",
            "+reward.reward_kwargs.max_resp_len=64",
            "reward.sandbox_fusion.url=http://localhost:8080/run_code",
        ]
    )
    assert _effective(old) == _effective(new)
    assert _effective(new)["reward_kwargs"] == {"max_resp_len": 64}
    for cfg in (old, new):  # the readers of the older spelling see the same values
        assert cfg.reward_model.reward_manager == "dapo" and cfg.reward_manager.name == "dapo"
        assert cfg.reward_model.num_workers == 3 and cfg.reward_model.reward_kwargs == {"max_resp_len": 64}
        assert cfg.reward_model.sandbox_fusion.url == "http://localhost:8080/run_code"
        assert _reward_manager_class(cfg)[0] == "dapo"
        assert get_custom_reward_fn(cfg)("d", "s", "g") == 0.25


def test_defaults_give_naive_and_no_function():
    cfg = _load([])
    assert cfg.reward_model.reward_manager == "naive" and cfg.reward_manager.source == "register"
    assert cfg.custom_reward_function.name == "compute_score" and get_custom_reward_fn(cfg) is None
    assert cfg.reward_model.enable is False and cfg.reward_model.sandbox_fusion.max_concurrent == 64


def test_two_spellings_with_different_values_are_refused():
    with pytest.raises(ConfigError, match="reward.reward_manager.name='prime', reward_model.reward_manager='dapo'"):
        _load(["reward_model.reward_manager=dapo", "reward.reward_manager.name=prime"])
    with pytest.raises(ConfigError, match="reward.num_workers"):
        _load(["reward_model.num_workers=2", "reward.num_workers=4"])
    # the same value twice is one setting
    assert _load(["reward_model.num_workers=2", "reward.num_workers=2"]).reward.num_workers == 2


def test_reward_kwargs_of_both_spellings_merge_key_by_key():
    cfg = _load(
        [
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
            "+reward.reward_kwargs.max_resp_len=null",  # null: unset, as in verl-recipe's nemo_gym config
            "+reward_model.reward_kwargs.max_resp_len=64",
        ]
    )
    expected = {"overlong_buffer_cfg": {"enable": True}, "max_resp_len": 64}
    assert OmegaConf.to_container(cfg.reward.reward_kwargs) == expected
    assert OmegaConf.to_container(cfg.reward_model.reward_kwargs) == expected
    with pytest.raises(ConfigError, match=r"reward.reward_kwargs.max_resp_len=64 .* and 32"):
        _load(["+reward.reward_kwargs.max_resp_len=32", "+reward_model.reward_kwargs.max_resp_len=64"])


def test_resolution_is_idempotent_on_a_plain_dict():
    cfg = OmegaConf.to_container(compose_config(["reward_model.enable=true"]))
    once = resolve_reward_spellings(cfg)
    assert once["reward"]["reward_model"]["enable"] is True and once["reward_model"]["n_gpus_per_node"] == 8
    import copy

    assert resolve_reward_spellings(copy.deepcopy(once)) == once


def test_upstream_migration_copies_legacy_keys_and_drops_the_legacy_sections():
    cfg = compose_config(["reward_model.reward_manager=dapo", "reward_model.enable=true", "sandbox_fusion.url=u"])
    cfg.reward.num_workers = 4
    cfg.reward_model.num_workers = 2  # the older key wins, as upstream
    out = migrate_legacy_reward_impl(cfg)
    assert out is cfg
    assert cfg.reward.num_workers == 2 and cfg.reward.reward_manager.name == "dapo"
    assert cfg.reward.reward_model.enable is True and cfg.reward.sandbox_fusion.url == "u"
    assert cfg.reward.sandbox_fusion.max_concurrent == 64  # a null older key leaves reward's value
    assert "reward_model" not in cfg and "custom_reward_function" not in cfg and "sandbox_fusion" not in cfg
