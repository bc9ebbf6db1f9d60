"""The critic section of upstream v0.9: its FSDP engine under `critic.fsdp` with the older
`critic.model.fsdp_config` still read, the policy model's keys on `critic.model`, and the new keys'
statuses."""

from __future__ import annotations

import warnings

import pytest

from verl.trainer.config import ConfigError, ConfigWarning, load_ppo_config
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import CriticConfig, FSDPEngineConfig, McoreCheckpointConfig
from verl.workers.config.critic import merge_legacy_fsdp_config

GAE = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4"]


def critic(overrides, name="arith_demo"):
    """(typed critic section, warning messages) of the demo config with `overrides`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_ppo_config(GAE + overrides, config_name=name)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    return omega_conf_to_dataclass(cfg.critic, CriticConfig), messages


def test_v09_spelling_sets_the_engine_without_a_warning():
    section, messages = critic(["critic.fsdp.param_offload=true", "critic.fsdp.fsdp_size=1"])
    assert section.fsdp.param_offload is True and section.fsdp.fsdp_size == 1
    assert section.model.fsdp_config is section.fsdp  # both spellings read one section
    assert not [m for m in messages if "fsdp_config" in m]


def test_older_spelling_is_merged_into_fsdp_with_a_warning():
    section, messages = critic(["critic.model.fsdp_config.param_offload=true"])
    assert section.fsdp.param_offload is True
    assert any(
        m.startswith("critic.model.fsdp_config.param_offload is upstream's spelling before v0.9") for m in messages
    )


def test_the_loaded_config_holds_the_effective_value_under_both_spellings():
    cfg = load_ppo_config([*GAE, "critic.model.fsdp_config.param_offload=true"], config_name="arith_demo")
    assert cfg.critic.fsdp.param_offload is True and cfg.critic.model.fsdp_config.param_offload is True
    cfg = load_ppo_config([*GAE, "critic.fsdp.optimizer_offload=true"], config_name="arith_demo")
    assert cfg.critic.model.fsdp_config.optimizer_offload is True  # the saved config.yaml says what runs


def test_both_spellings_agreeing_is_accepted():
    section, _ = critic(["critic.model.fsdp_config.optimizer_offload=true", "critic.fsdp.optimizer_offload=true"])
    assert section.fsdp.optimizer_offload is True


def test_both_spellings_disagreeing_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"critic.model.fsdp_config.fsdp_size=2 and critic.fsdp.fsdp_size=4"):
        critic(["critic.model.fsdp_config.fsdp_size=2", "critic.fsdp.fsdp_size=4"])


def test_merge_rule_by_hand():
    default = FSDPEngineConfig()
    # legacy set, new at its default: taken
    assert merge_legacy_fsdp_config({"param_offload": True}, {"param_offload": False}, default) == {
        "param_offload": True
    }
    # legacy at its default: the new value stands, nothing taken
    assert merge_legacy_fsdp_config({"param_offload": False}, {"param_offload": True}, default) == {}
    # a whole sub-section counts as one key
    legacy = {"wrap_policy": {"min_num_params": 10}}
    assert merge_legacy_fsdp_config(legacy, {"wrap_policy": {"min_num_params": 0}}, default) == legacy
    with pytest.raises(
        ValueError, match=r"fsdp_config.wrap_policy=\{'min_num_params': 10\} and critic.fsdp.wrap_policy"
    ):
        merge_legacy_fsdp_config(legacy, {"wrap_policy": {"min_num_params": 5}}, default)


def test_critic_model_defaults_are_v09s():
    section, _ = critic([])
    model = section.model
    assert model.use_remove_padding is True and model.hf_config_path is None and model.exclude_modules is None
    assert (model.mtp.speculative_num_steps, model.mtp.speculative_eagle_topk) == (3, 1)
    assert model.lora.rank == 0 and model.lora.merge is False


def test_tokenizer_and_trust_remote_code_no_longer_follow_the_policy():
    """v0.9 dropped the interpolations: the critic's tokenizer is its own model's unless set."""
    cfg = load_ppo_config(
        ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.trust_remote_code=true"], validate=False
    )
    assert cfg.critic.model.tokenizer_path is None and cfg.critic.model.trust_remote_code is False


def test_loss_scale_factor_follows_the_actors():
    cfg = load_ppo_config(
        ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.loss_scale_factor=512"], validate=False
    )
    assert cfg.critic.loss_scale_factor == 512


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("critic.model.mtp.enable=true", "critic.model.mtp.enable=true is not implemented"),
        (
            "critic.model.lora_adapter_path=/tmp/adapter",
            "critic.model.lora_adapter_path=/tmp/adapter is not implemented",
        ),
    ],
)
def test_unsupported_critic_model_keys_are_refused(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        critic([override])


def test_megatron_critic_checkpoint_is_the_megatron_subclass():
    cfg = load_ppo_config(["actor_rollout_ref.rollout.name=vllm"], config_name="ppo_megatron_trainer", validate=False)
    section = omega_conf_to_dataclass(cfg.critic, CriticConfig)
    assert type(section.checkpoint) is McoreCheckpointConfig and section.checkpoint.mbridge_config == {}
    assert section.load_weight is True  # removed upstream in v0.9, still read here
