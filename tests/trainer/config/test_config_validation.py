"""Start-up validation: every class of user error fails with a message saying what, why and how to fix.

Most tests edit a plain-dict copy of the resolved bundled demo config (`arith_demo`: upstream's
defaults plus the demo's, a config that runs; fast); the loader tests cover the same errors
arriving through command-line overrides, and test_upstream_defaults.py the rules under upstream's
own defaults.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest

from verl.trainer.config import ConfigError, ConfigWarning, load_ppo_config, validate_ppo_config
from verl.trainer.config.schema import GROUP_ADV_ESTIMATORS


@pytest.fixture(scope="module")
def defaults() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(load_ppo_config(config_name="arith_demo"), resolve=True)


@pytest.fixture(scope="module")
def megatron_defaults() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(load_ppo_config(config_name="arith_demo_megatron"), resolve=True)


def with_(base: dict, **changes) -> dict:
    """A copy of `base` with dotted keys (written with __ for dots) set."""
    cfg = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def error_of(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        validate_ppo_config(cfg)
    return str(e.value)


def test_defaults_validate_without_warnings(defaults):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_ppo_config(defaults)


# ------------------------------------------------------------------------------ structure, types


def test_unknown_key_names_full_key_and_closest_valid_key(defaults):
    cfg = with_(defaults, trainer__projct_name="x")
    msg = error_of(cfg)
    assert "unknown config key 'trainer.projct_name'" in msg
    assert "Did you mean trainer.project_name?" in msg


def test_unknown_key_deep_in_the_tree_suggests_the_nested_key(defaults):
    cfg = with_(defaults, actor_rollout_ref__rollout__val_kwargs__temprature=0.5)
    assert "Did you mean actor_rollout_ref.rollout.val_kwargs.temperature?" in error_of(cfg)


def test_unknown_section_suggests_the_section(defaults):
    cfg = with_(defaults, algoritm={"adv_estimator": "grpo"})
    assert "Did you mean algorithm?" in error_of(cfg)


def test_unknown_key_with_nothing_close_gets_no_wild_guess(defaults):
    msg = error_of(with_(defaults, trainer__zzzqqq=1))
    assert "trainer.zzzqqq" in msg and "Did you mean" not in msg


def test_open_sections_accept_extra_keys(defaults):
    validate_ppo_config(with_(defaults, ray_kwargs__ray_init__runtime_env={"env_vars": {"A": "1"}}))


def test_hydra_target_keys_from_upstream_yaml_are_accepted(defaults):
    cfg = with_(defaults, algorithm___target_="verl.trainer.config.AlgoConfig")
    validate_ppo_config(cfg)


def test_string_where_int_expected_names_key_type_and_value(defaults):
    msg = error_of(with_(defaults, data__train_batch_size="32x"))
    assert "data.train_batch_size='32x'" in msg and "int is expected" in msg and "whole number" in msg


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("trainer__n_gpus_per_node", 2.0, "int"),  # a float is not a count
        ("actor_rollout_ref__actor__use_kl_loss", 1, "bool"),  # 1 is not a boolean
        ("data__train_batch_size", True, "int"),  # bool is not an int
        ("actor_rollout_ref__actor__optim__lr", "1e-4", "float"),  # quoted number stays a string
        ("trainer__logger", 3, "list[str] | str"),
        ("data__train_files", ["a.parquet", 3], "str | list[str]"),
    ],
)
def test_wrong_types_are_rejected(defaults, key, value, expected):
    msg = error_of(with_(defaults, **{key: value}))
    assert f"{key.replace('__', '.')}={value!r}" in msg and f"{expected} is expected" in msg


def test_int_is_accepted_where_float_is_expected(defaults):
    validate_ppo_config(with_(defaults, actor_rollout_ref__actor__optim__lr=1))


def test_section_set_to_a_scalar_is_rejected(defaults):
    assert "actor_rollout_ref.actor.optim is a section" in error_of(
        with_(defaults, actor_rollout_ref__actor__optim=0.1)
    )


def test_missing_value_marker_must_be_set(defaults):
    assert "must be set" in error_of(with_(defaults, actor_rollout_ref__rollout__name="???"))


@pytest.mark.parametrize(
    "key, bad, valid",
    [
        ("algorithm__adv_estimator", "grpoo", "grpo"),
        ("actor_rollout_ref__actor__loss_agg_mode", "token_mean", "token-mean"),
        ("actor_rollout_ref__rollout__name", "vllmm", "vllm"),
        ("algorithm__kl_penalty", "low-var-kl", "low_var_kl"),
        ("actor_rollout_ref__actor__kl_loss_type", "k4", "low_var_kl"),
        ("trainer__resume_mode", "resume", "resume_path"),
        ("trainer__device", "tpu", "cuda"),
        ("reward_model__reward_manager", "naïve", "naive"),
    ],
)
def test_invalid_choices_list_the_valid_values(defaults, key, bad, valid):
    msg = error_of(with_(defaults, **{key: bad}))
    assert f"{key.replace('__', '.')}={bad!r} is not a valid choice" in msg
    assert "Valid values:" in msg and valid in msg.split("Valid values:")[1]


def test_each_logger_name_is_checked(defaults):
    msg = error_of(with_(defaults, trainer__logger=["console", "wandbb"]))
    assert "trainer.logger='wandbb'" in msg and "Did you mean wandb?" in msg
    assert "clearml, console, file, mlflow, swanlab, tensorboard, tracking, wandb" in msg


@pytest.mark.parametrize(("backend", "what"), [("trackio", "pillow<13"), ("vemlp_wandb", "volcengine_ml_platform")])
def test_upstream_loggers_not_in_this_build_are_refused_with_the_reason(defaults, backend, what):
    msg = error_of(with_(defaults, trainer__logger=["console", backend]))
    assert f"trainer.logger={backend} is for " in msg and what in msg and "does not support" in msg, msg


def test_straight_through_kl_estimators_are_valid(defaults):
    validate_ppo_config(with_(defaults, algorithm__kl_penalty="low_var_kl+"))


def test_unimplemented_feature_is_refused_not_ignored(defaults):
    msg = error_of(with_(defaults, transfer_queue__enable=True))
    assert "transfer_queue.enable=true is not implemented" in msg
    assert "keep transfer_queue.enable=false" in msg


def test_critic_lora_is_accepted_on_fsdp_and_refused_with_a_megatron_critic(defaults):
    validate_ppo_config(with_(defaults, algorithm__adv_estimator="gae", critic__model__lora_rank=16))
    msg = error_of(
        with_(defaults, algorithm__adv_estimator="gae", critic__model__lora_rank=16, critic__strategy="megatron")
    )
    assert "critic.model.lora_rank=16 is the FSDP critic's LoRA (peft), but critic.strategy=megatron" in msg
    msg = error_of(
        with_(defaults, algorithm__adv_estimator="gae", critic__model__lora_rank=8, critic__model__lora_alpha=0)
    )
    assert "critic.model.lora_alpha=0 must be positive" in msg


def test_actor_lora_is_accepted(defaults):
    validate_ppo_config(
        with_(defaults, actor_rollout_ref__model__lora_rank=8, actor_rollout_ref__model__target_modules=["q_proj"])
    )


def test_lora_with_a_non_positive_alpha_or_a_negative_rank_is_refused(defaults):
    msg = error_of(with_(defaults, actor_rollout_ref__model__lora_rank=8, actor_rollout_ref__model__lora_alpha=0))
    assert "actor_rollout_ref.model.lora_alpha=0 must be positive" in msg
    msg = error_of(with_(defaults, actor_rollout_ref__model__lora_rank=-1))
    assert "actor_rollout_ref.model.lora_rank=-1 must be 0" in msg


@pytest.fixture(scope="module")
def lora_adapter(tmp_path_factory) -> str:
    """A peft LoRA adapter (r=2, alpha=6, q_proj/v_proj) of the demo's model, saved by peft itself."""
    from peft import LoraConfig, get_peft_model

    from verl.models import bundled_model_path
    from verl.utils.model import load_causal_lm

    path = tmp_path_factory.mktemp("adapter") / "lora_adapter"
    config = LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"])
    get_peft_model(load_causal_lm(bundled_model_path()), config).save_pretrained(str(path))
    return str(path)


def test_a_lora_adapter_path_is_accepted_without_a_lora_rank(defaults, lora_adapter):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_ppo_config(with_(defaults, actor_rollout_ref__model__lora_adapter_path=lora_adapter))


def test_a_lora_adapter_path_that_is_not_an_adapter_directory_is_refused_before_ray(defaults, tmp_path):
    key = "actor_rollout_ref.model.lora_adapter_path"
    msg = error_of(with_(defaults, actor_rollout_ref__model__lora_adapter_path=str(tmp_path / "missing")))
    assert f"{key}={tmp_path / 'missing'}: {tmp_path / 'missing'} does not exist or is not a directory" in msg
    assert "point it at a peft LoRA adapter directory (adapter_config.json + adapter_model.safetensors" in msg
    msg = error_of(with_(defaults, actor_rollout_ref__model__lora_adapter_path=str(tmp_path)))  # an empty directory
    assert f"{tmp_path} lacks adapter_config.json and adapter_model.safetensors" in msg


def test_a_lora_layout_set_beside_an_adapter_warns_that_the_adapter_s_wins(defaults, lora_adapter):
    cfg = with_(
        defaults,
        actor_rollout_ref__model__lora_adapter_path=lora_adapter,
        actor_rollout_ref__model__lora_rank=8,
        actor_rollout_ref__model__target_modules=["q_proj", "k_proj"],
    )
    with pytest.warns(ConfigWarning) as record:
        validate_ppo_config(cfg)
    messages = [str(w.message) for w in record]
    assert any("lora_rank=8, lora_alpha=16 differ from the adapter's r=2, lora_alpha=6" in m for m in messages)
    assert any("target_modules=['q_proj', 'k_proj'] differ from the adapter's" in m for m in messages)


def test_a_lora_adapter_path_on_a_megatron_actor_is_refused(megatron_defaults, lora_adapter):
    msg = error_of(with_(megatron_defaults, actor_rollout_ref__model__lora_adapter_path=lora_adapter))
    assert f"actor_rollout_ref.model.lora_adapter_path={lora_adapter} (LoRA adapters) is the FSDP backend's LoRA" in msg
    assert "actor_rollout_ref.model.lora.rank" in msg


def test_unimplemented_feature_at_its_neutral_value_is_fine(defaults):
    validate_ppo_config(with_(defaults, actor_rollout_ref__rollout__multi_turn__interaction_config_path=None))


def test_deprecated_key_warns_and_names_replacement(defaults):
    cfg = with_(
        defaults,
        actor_rollout_ref__actor__ppo_micro_batch_size=128,
        actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=None,
    )
    with pytest.warns(ConfigWarning, match="ppo_micro_batch_size is deprecated; use ppo_micro_batch_size_per_gpu"):
        validate_ppo_config(cfg)


def test_all_problems_are_reported_at_once(defaults):
    cfg = with_(defaults, data__shufle=True, algorithm__adv_estimator="ppo", trainer__nnodes="1")
    with pytest.raises(ConfigError) as e:
        validate_ppo_config(cfg)
    assert len(e.value.errors) == 3
    assert str(e.value).startswith("invalid config (3 problems):")


def test_a_bad_value_copied_by_interpolation_is_reported_once():
    with pytest.raises(ConfigError) as e:
        load_ppo_config(["data.max_prompt_length=abc"], config_name="arith_demo")
    assert len(e.value.errors) == 1  # not again for rollout.prompt_length, which follows it
    assert "data.max_prompt_length='abc'" in e.value.errors[0]


# ----------------------------------------------------------------------------- batch arithmetic


def test_batch_not_divisible_by_workers_suggests_a_batch_size(defaults):
    msg = error_of(with_(defaults, trainer__n_gpus_per_node=3))
    assert "32 x 8 = 256 sequences per step is not divisible by the 3 workers" in msg
    assert "data.train_batch_size=33" in msg  # 33 x 8 = 264 = 3 x 88: the next size that works
    assert "trainer.n_gpus_per_node" in msg


def test_mini_batch_larger_than_batch(defaults):
    msg = error_of(with_(defaults, actor_rollout_ref__actor__ppo_mini_batch_size=64))
    assert "ppo_mini_batch_size=64 is larger than data.train_batch_size=32" in msg
    assert "at most 32" in msg


def test_batch_not_divisible_by_mini_batch_suggests_a_divisor(defaults):
    cfg = with_(
        defaults,
        actor_rollout_ref__actor__ppo_mini_batch_size=12,
        actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=8,
    )
    msg = error_of(cfg)
    assert "data.train_batch_size=32 is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=12" in msg
    assert "such as 8" in msg


def test_mini_batch_sequences_not_divisible_by_data_parallel_ranks(defaults):
    # 4 ranks, n=2: the step's 64 sequences split, but a 1-prompt mini-batch (2 sequences) cannot.
    cfg = with_(
        defaults,
        trainer__n_gpus_per_node=4,
        actor_rollout_ref__rollout__n=2,
        critic__rollout_n=2,
        actor_rollout_ref__actor__ppo_mini_batch_size=1,
    )
    msg = error_of(cfg)
    assert "1 x 2 = 2 sequences is not divisible by the 4 data-parallel ranks" in msg
    assert "ppo_mini_batch_size=2" in msg


def test_micro_batch_larger_than_per_rank_mini_batch_is_one_micro_batch(defaults):
    # a bound, not an exact size: 256 sequences per forward allow the rank's whole 128 in one
    validate_ppo_config(with_(defaults, actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=256))
    # the default (128) with a smaller batch (16 x 8 / 2 = 64 per rank) is fine too
    validate_ppo_config(with_(defaults, data__train_batch_size=16, actor_rollout_ref__actor__ppo_mini_batch_size=16))


def test_micro_batch_must_divide_per_rank_mini_batch(defaults):
    msg = error_of(with_(defaults, actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=48))
    assert "does not divide the 128 sequences" in msg and "such as 32" in msg


def test_both_micro_batch_spellings_conflict(defaults):
    msg = error_of(with_(defaults, actor_rollout_ref__actor__ppo_micro_batch_size=32))
    assert "are both set" in msg and "keep only actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in msg


def test_micro_batch_required_unless_dynamic_batching(defaults):
    cfg = with_(defaults, actor_rollout_ref__rollout__log_prob_micro_batch_size_per_gpu=None)
    assert "old-log-prob pass needs a micro-batch size" in error_of(cfg)
    validate_ppo_config(with_(cfg, actor_rollout_ref__rollout__log_prob_use_dynamic_bsz=True))


def test_reference_micro_batch_only_checked_when_a_kl_term_needs_the_reference(defaults):
    cfg = with_(defaults, actor_rollout_ref__ref__log_prob_micro_batch_size_per_gpu=None)
    validate_ppo_config(cfg)
    assert "reference policy needs a micro-batch size" in error_of(
        with_(cfg, actor_rollout_ref__actor__use_kl_loss=True)
    )


def test_critic_batches_only_checked_when_the_critic_trains(defaults):
    cfg = with_(defaults, critic__ppo_micro_batch_size_per_gpu=3)
    validate_ppo_config(cfg)  # grpo: no critic
    assert "critic.ppo_micro_batch_size_per_gpu=3 does not divide the 128 sequences" in error_of(
        with_(cfg, algorithm__adv_estimator="gae")
    )


def test_rollout_tensor_parallel_must_divide_workers(defaults):
    msg = error_of(with_(defaults, actor_rollout_ref__rollout__tensor_model_parallel_size=4))
    assert "tensor_model_parallel_size=4 does not divide the 2 workers" in msg


def test_bigger_cluster_arithmetic_passes(defaults):
    cfg = with_(
        defaults,
        trainer__nnodes=2,
        trainer__n_gpus_per_node=8,
        data__train_batch_size=1024,
        actor_rollout_ref__actor__ppo_mini_batch_size=256,
        actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=16,  # 256 x 8 / 16 = 128 per rank
        actor_rollout_ref__rollout__tensor_model_parallel_size=2,
    )
    validate_ppo_config(cfg)


def test_reward_model_needs_a_path_and_micro_batch(defaults):
    msg = error_of(with_(defaults, reward_model__enable=True, reward_model__model__path=None))
    assert "reward_model.model.path is null" in msg
    # upstream v0.9's default model path is null (v0.7's was a placeholder directory): these cases name one
    rm = {"reward_model__enable": True, "reward_model__model__path": "~/models/rm"}
    # upstream's reward loop (use_reward_loop, its default) batches the reward model's requests itself
    validate_ppo_config(with_(defaults, **rm))
    msg = error_of(with_(defaults, **rm, reward_model__use_reward_loop=False))
    assert "reward model needs a micro-batch size" in msg


# ---------------------------------------------------------------------------- algorithm rules


@pytest.mark.parametrize("estimator", GROUP_ADV_ESTIMATORS)
def test_group_estimators_with_one_sample_per_prompt_warn(defaults, estimator):
    """Upstream runs them (its launch scripts do): a group of one has no baseline, the advantage is the
    raw score. Here it is a warning naming the fix, not an error."""
    cfg = with_(
        defaults,
        algorithm__adv_estimator=estimator,
        actor_rollout_ref__rollout__n=1,
        actor_rollout_ref__actor__rollout_n=1,
        actor_rollout_ref__ref__rollout_n=1,
        critic__rollout_n=1,
        actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=16,
        # GDPO needs the names of its reward components
        **({"algorithm__gdpo_reward_keys": ["acc"]} if estimator == "gdpo" else {}),
    )
    with pytest.warns(ConfigWarning, match=f"adv_estimator={estimator} .* no group baseline") as record:
        validate_ppo_config(cfg)
    assert any("rollout.n to 2 or more" in str(w.message) for w in record)


def test_single_sample_estimators_accept_n_equal_one(defaults):
    cfg = with_(
        defaults,
        algorithm__adv_estimator="remax",
        actor_rollout_ref__rollout__n=1,
        actor_rollout_ref__actor__rollout_n=1,
        actor_rollout_ref__ref__rollout_n=1,
        critic__rollout_n=1,
        actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=16,
    )
    validate_ppo_config(cfg)


def test_gae_without_critic_is_an_error(defaults):
    assert "gae needs a value function" in error_of(
        with_(defaults, algorithm__adv_estimator="gae", critic__enable=False)
    )


def test_kl_in_loss_and_reward_together_warns(defaults):
    cfg = with_(defaults, actor_rollout_ref__actor__use_kl_loss=True, algorithm__use_kl_in_reward=True)
    with pytest.warns(ConfigWarning, match="penalised twice"):
        validate_ppo_config(cfg)


def test_greedy_rollouts_with_group_estimator_warn(defaults):
    with pytest.warns(ConfigWarning, match="zero advantage"):
        validate_ppo_config(with_(defaults, actor_rollout_ref__rollout__do_sample=False))


def test_sampling_needs_a_positive_temperature(defaults):
    assert "cannot sample" in error_of(with_(defaults, actor_rollout_ref__rollout__temperature=0.0))
    msg = error_of(with_(defaults, actor_rollout_ref__rollout__val_kwargs__do_sample=True))
    assert "val_kwargs.do_sample=true with temperature=0" in msg


def test_critic_rollout_n_must_follow_rollout_n(defaults):
    assert "critic.rollout_n=4 differs" in error_of(with_(defaults, critic__rollout_n=4))


def test_filter_groups_needs_a_metric(defaults):
    assert "filter_groups.metric" in error_of(with_(defaults, algorithm__filter_groups__enable=True))
    validate_ppo_config(with_(defaults, algorithm__filter_groups__enable=True, algorithm__filter_groups__metric="acc"))


# ------------------------------------------------------------------------------ trainer rules


def test_zero_frequencies_are_rejected(defaults):
    assert "trainer.test_freq=0 is not a step interval" in error_of(with_(defaults, trainer__test_freq=0))


def test_resume_path_mode_needs_a_path(defaults):
    assert "needs trainer.resume_from_path" in error_of(with_(defaults, trainer__resume_mode="resume_path"))


def test_missing_custom_reward_file_is_reported(defaults, tmp_path):
    msg = error_of(with_(defaults, custom_reward_function__path=str(tmp_path / "reward.py")))
    assert "custom_reward_function.path" in msg and "does not exist" in msg
    (tmp_path / "reward.py").write_text("def compute_score(*a): return 0.0\n")
    validate_ppo_config(with_(defaults, custom_reward_function__path=str(tmp_path / "reward.py")))


def test_logger_whose_package_is_missing_says_what_to_install(defaults, monkeypatch):
    from verl.utils import tracking

    monkeypatch.setitem(tracking._BACKEND_PACKAGES, "wandb", ("verl_no_such_package_xyz", "pip install wandb"))
    msg = error_of(with_(defaults, trainer__logger=["console", "wandb"]))
    assert "'wandb'" in msg and "pip install wandb" in msg


def test_mlflow_is_an_optional_extra_whose_absence_names_the_install_command(defaults, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    msg = error_of(with_(defaults, trainer__logger=["console", "mlflow"]))
    assert "trainer.logger includes 'mlflow'" in msg and "run `pip install mlflow`" in msg, msg
    validate_ppo_config(with_(defaults, trainer__logger=["console", "file"]))  # needed only when chosen


def test_model_length_budget(defaults):
    msg = error_of(with_(defaults, actor_rollout_ref__rollout__max_model_len=16))
    assert "max_model_len=16 is shorter than prompt_length + response_length = 40" in msg


def test_truncated_importance_sampling_needs_rollout_log_probs(defaults):
    # rollout.calculate_log_probs is on by default (upstream v0.9.0): switched off here to see the refusal
    msg = error_of(
        with_(
            defaults,
            actor_rollout_ref__actor__tis_imp_ratio_cap=2.0,
            actor_rollout_ref__rollout__calculate_log_probs=False,
        )
    )
    assert "tis_imp_ratio_cap=2.0" in msg and "actor_rollout_ref.rollout.calculate_log_probs=true" in msg
    validate_ppo_config(
        with_(
            defaults,
            actor_rollout_ref__actor__tis_imp_ratio_cap=2.0,
            actor_rollout_ref__rollout__calculate_log_probs=True,
        )
    )


def test_syncing_weights_less_often_than_the_staleness_bound_allows_is_refused(defaults):
    ok = with_(defaults, async_training__staleness_threshold=1, async_training__trigger_parameter_sync_step=2)
    validate_ppo_config(ok)  # the pool lags at most 1 version: within the bound of 1
    msg = error_of(with_(ok, async_training__trigger_parameter_sync_step=3))
    assert "async_training.trigger_parameter_sync_step=3 with staleness_threshold=1" in msg
    assert "generated 2 versions early, beyond the 1 batches generation may run ahead" in msg
    assert "set staleness_threshold >= 2 or trigger_parameter_sync_step <= 2" in msg
    assert "must be >= 1" in error_of(with_(ok, async_training__trigger_parameter_sync_step=0))
    # a fraction of a batch ahead does not let the pool lag a whole version more
    msg = error_of(with_(ok, async_training__staleness_threshold=1.5, async_training__trigger_parameter_sync_step=3))
    assert "set staleness_threshold >= 2 or trigger_parameter_sync_step <= 2" in msg


def test_fractional_staleness_thresholds_are_accepted_and_negative_ones_refused(defaults):
    validate_ppo_config(with_(defaults, async_training__staleness_threshold=0.5))
    validate_ppo_config(with_(defaults, async_training__staleness_threshold=1.25))
    assert "must be >= 0" in error_of(with_(defaults, async_training__staleness_threshold=-0.5))


def test_sync_schedule_and_partial_rollouts_need_generation_running_ahead(defaults):
    msg = error_of(with_(defaults, async_training__trigger_parameter_sync_step=2))
    assert "async_training.trigger_parameter_sync_step=2 only applies" in msg
    assert "async_training.staleness_threshold > 0" in msg
    assert "async_training.partial_rollout=True only applies" in error_of(
        with_(defaults, async_training__partial_rollout=True)
    )


def test_partial_rollouts_need_an_engine_that_can_pause(defaults):
    ahead = with_(defaults, async_training__staleness_threshold=1, async_training__partial_rollout=True)
    validate_ppo_config(ahead)
    validate_ppo_config(with_(ahead, actor_rollout_ref__rollout__name="vllm"))
    msg = error_of(with_(ahead, actor_rollout_ref__rollout__name="sglang"))
    assert "not for actor_rollout_ref.rollout.name=sglang" in msg and "async_training.partial_rollout=false" in msg
    validate_ppo_config(
        with_(ahead, actor_rollout_ref__rollout__name="vllm", actor_rollout_ref__rollout__multi_turn__enable=True)
    )
    assert "must be >= 1" in error_of(with_(ahead, async_training__partial_rollout_check_steps=0))


def _megatron_reward_model(defaults, megatron_defaults, **overrides):
    """The reward model on megatron; in an FSDP config, with the megatron composition's reward_model section."""
    if "megatron" not in defaults["reward_model"]:
        defaults = with_(defaults, reward_model=copy.deepcopy(megatron_defaults["reward_model"]))
    return with_(
        defaults,
        reward_model__enable=True,
        reward_model__strategy="megatron",
        reward_model__model__path="/some/rm",
        reward_model__micro_batch_size_per_gpu=4,
        **overrides,
    )


def test_megatron_models_of_different_layouts_get_their_own_processes(defaults, megatron_defaults):
    """A megatron critic or reward model whose layout differs from the actor's is accepted: the
    trainer spawns it in worker processes of its own (megatron's parallel state is one per process),
    and a model of the actor's layout stays in the actor's processes."""
    from omegaconf import OmegaConf

    from verl.trainer.ppo.process_sets import megatron_layout, megatron_process_sets

    cfg = with_(
        megatron_defaults,
        algorithm__adv_estimator="gae",
        actor_rollout_ref__actor__megatron__tensor_model_parallel_size=2,
        critic__megatron__tensor_model_parallel_size=1,
    )
    validate_ppo_config(cfg)
    conf = OmegaConf.create(cfg)
    assert megatron_layout(conf.actor_rollout_ref.actor.megatron) == (2, 1, None, 1, 1, 2)  # etp null: tp
    assert megatron_layout(conf.critic.megatron) == (1, 1, None, 1, 1, 1)
    roles = {"actor_rollout": "A", "critic": "C", "ref": "R"}
    assert megatron_process_sets(conf, roles) == [{"actor_rollout": "A", "ref": "R"}, {"critic": "C"}]
    same = with_(cfg, critic__megatron__tensor_model_parallel_size=2)
    validate_ppo_config(same)
    conf = OmegaConf.create(same)
    assert megatron_process_sets(conf, roles) == [roles]
    # a virtual pipeline size of 1 is no virtual pipeline: the same layout as null
    vpp1 = with_(same, critic__megatron__virtual_pipeline_model_parallel_size=1)
    conf = OmegaConf.create(vpp1)
    assert megatron_process_sets(conf, roles) == [roles]


def test_megatron_dist_checkpoint_start_needs_an_existing_path(megatron_defaults, tmp_path):
    """megatron.use_dist_checkpointing: the checkpoint directory must be named and exist, and a reward
    model (whose score head only its HF checkpoint has) cannot use it."""
    cfg = with_(megatron_defaults, actor_rollout_ref__actor__megatron__use_dist_checkpointing=True)
    assert "needs actor_rollout_ref.actor.megatron.dist_checkpointing_path" in error_of(cfg)
    missing = with_(cfg, actor_rollout_ref__actor__megatron__dist_checkpointing_path=str(tmp_path / "nope"))
    assert "dist_checkpointing_path=" in error_of(missing) and "does not exist" in error_of(missing)
    validate_ppo_config(with_(cfg, actor_rollout_ref__actor__megatron__dist_checkpointing_path=str(tmp_path)))
    rm = _megatron_reward_model(
        megatron_defaults,
        megatron_defaults,
        reward_model__megatron__use_dist_checkpointing=True,
        reward_model__megatron__dist_checkpointing_path=str(tmp_path),
    )
    assert "reward_model.megatron.use_dist_checkpointing=true" in error_of(rm)


def test_megatron_batch_must_split_into_micro_batches_of_every_data_parallel_group(megatron_defaults):
    """Upstream's rule: with fixed micro-batches, train_batch_size x n is a multiple of the megatron
    data-parallel size (ranks / tp x pp x cp) x ppo_micro_batch_size_per_gpu."""
    cfg = with_(
        megatron_defaults,
        trainer__n_gpus_per_node=8,
        actor_rollout_ref__actor__megatron__tensor_model_parallel_size=2,  # 4 data-parallel groups
        actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=4,  # multiples of 16 sequences
        data__train_batch_size=24,
        actor_rollout_ref__actor__ppo_mini_batch_size=24,
        actor_rollout_ref__rollout__n=1,
        actor_rollout_ref__actor__rollout_n=1,
        actor_rollout_ref__ref__rollout_n=1,
        critic__rollout_n=1,
        algorithm__adv_estimator="remax",
    )
    assert "24 sequences per step do not split into whole micro-batches of the 4 megatron" in error_of(cfg)
    validate_ppo_config(with_(cfg, data__train_batch_size=32, actor_rollout_ref__actor__ppo_mini_batch_size=32))


def test_rollout_tracing_without_agent_loops_says_nothing_would_be_traced(defaults):
    msg = error_of(with_(defaults, actor_rollout_ref__rollout__trace__backend="mlflow"))
    assert "trace.backend=mlflow traces agent-loop episodes only" in msg
    assert "set actor_rollout_ref.rollout.multi_turn.enable=true or trace.backend=null" in msg
    traced = with_(
        defaults,
        actor_rollout_ref__rollout__trace__backend="mlflow",
        actor_rollout_ref__rollout__multi_turn__enable=True,
        actor_rollout_ref__rollout__trace__max_samples_per_step_per_worker=2,
    )
    validate_ppo_config(traced)  # mlflow is installed in the test environment
    assert "max_samples_per_step_per_worker=-1 must be >= 0" in error_of(
        with_(traced, actor_rollout_ref__rollout__trace__max_samples_per_step_per_worker=-1)
    )
    assert "trace.backend='wandb' is not a valid choice" in error_of(
        with_(traced, actor_rollout_ref__rollout__trace__backend="wandb")
    )


def test_a_trace_backend_that_is_not_installed_names_the_package_to_install(defaults, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "weave" else find_spec(name, *a))
    msg = error_of(
        with_(
            defaults,
            actor_rollout_ref__rollout__trace__backend="weave",
            actor_rollout_ref__rollout__multi_turn__enable=True,
        )
    )
    assert "trace.backend=weave needs the weave package, which is not installed; run `pip install weave`" in msg


def test_over_sampling_needs_agent_loops_and_a_rate_below_one(defaults):
    assert "over_sample_rate=0.1 cuts the slowest agent-loop episodes" in error_of(
        with_(defaults, actor_rollout_ref__rollout__over_sample_rate=0.1)
    )
    validate_ppo_config(
        with_(
            defaults,
            actor_rollout_ref__rollout__over_sample_rate=0.1,
            actor_rollout_ref__rollout__multi_turn__enable=True,
        )
    )
    assert "over_sample_rate=1.0 must be in [0, 1)" in error_of(
        with_(
            defaults,
            actor_rollout_ref__rollout__over_sample_rate=1.0,
            actor_rollout_ref__rollout__multi_turn__enable=True,
        )
    )


def test_agent_loop_config_path_is_read_at_start_up_and_names_the_default_loop(defaults, tmp_path):
    agents = tmp_path / "agents.yaml"
    agents.write_text("- name: math_expression\n  _target_: some_recipe.MathLoop\n")  # not imported at start-up
    ok = with_(
        defaults,
        actor_rollout_ref__rollout__agent__agent_loop_config_path=str(agents),
        actor_rollout_ref__rollout__agent__default_agent_loop="math_expression",
    )
    validate_ppo_config(ok)
    with pytest.raises(ConfigError, match=r"agent_loop_config_path='/nonexistent/agents.yaml': no such file"):
        validate_ppo_config(
            with_(defaults, actor_rollout_ref__rollout__agent__agent_loop_config_path="/nonexistent/agents.yaml")
        )
    with pytest.raises(ConfigError, match=r"default_agent_loop='math_expression' is not an agent loop: choose one of"):
        validate_ppo_config(with_(defaults, actor_rollout_ref__rollout__agent__default_agent_loop="math_expression"))
    # an import path is taken as given (imported when the worker builds the loop)
    validate_ppo_config(with_(defaults, actor_rollout_ref__rollout__agent__default_agent_loop="my_pkg.agents.MyLoop"))


def test_async_save_is_accepted_with_fsdp_and_refused_with_megatron(defaults, megatron_defaults):
    validate_ppo_config(with_(defaults, actor_rollout_ref__actor__checkpoint__async_save=True))
    msg = error_of(with_(megatron_defaults, actor_rollout_ref__actor__checkpoint__async_save=True))
    assert msg == (
        "invalid config: actor_rollout_ref.actor.checkpoint.async_save=true: background checkpoint writes are implemented for "
        "strategy=fsdp only, and actor_rollout_ref.actor.strategy=megatron; set "
        "actor_rollout_ref.actor.checkpoint.async_save=false"
    )


def test_default_hdfs_dir_needs_the_hdfs_command_for_hdfs_paths(defaults, tmp_path, monkeypatch):
    validate_ppo_config(with_(defaults, trainer__default_hdfs_dir=str(tmp_path)))
    validate_ppo_config(with_(defaults, trainer__default_hdfs_dir=f"file://{tmp_path}"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no `hdfs` here
    msg = error_of(with_(defaults, trainer__default_hdfs_dir="hdfs://nn/ckpt"))
    assert msg.startswith(
        "invalid config: trainer.default_hdfs_dir=hdfs://nn/ckpt: copying checkpoints to HDFS runs `hdfs dfs -put`"
    )
    assert "\n" not in msg
    assert "only hdfs://, file:// and local" in error_of(with_(defaults, trainer__default_hdfs_dir="s3://b/ckpt"))


def test_logprobs_mode_is_accepted_for_hf_and_vllm_and_refused_for_sglang(defaults):
    for name in ("hf", "vllm"):
        validate_ppo_config(
            with_(
                defaults, actor_rollout_ref__rollout__name=name, actor_rollout_ref__rollout__logprobs_mode="raw_logits"
            )
        )
    msg = error_of(
        with_(
            defaults, actor_rollout_ref__rollout__name="sglang", actor_rollout_ref__rollout__logprobs_mode="raw_logits"
        )
    )
    assert "logprobs_mode=raw_logits with rollout.name=sglang" in msg and "rollout.name=hf or vllm" in msg
    assert "not a valid choice" in error_of(with_(defaults, actor_rollout_ref__rollout__logprobs_mode="logits"))
    logits = with_(
        defaults,
        actor_rollout_ref__rollout__calculate_log_probs=True,
        actor_rollout_ref__rollout__logprobs_mode="raw_logits",
    )
    with pytest.warns(ConfigWarning, match="rollout_log_probs hold those values"):
        validate_ppo_config(logits)


def test_megatron_load_weight_false_is_accepted_when_actor_and_reference_agree(megatron_defaults):
    cfg = with_(
        megatron_defaults,
        actor_rollout_ref__actor__use_kl_loss=True,
        actor_rollout_ref__actor__load_weight=False,
        actor_rollout_ref__ref__load_weight=False,
    )
    validate_ppo_config(cfg)
    msg = error_of(with_(cfg, actor_rollout_ref__ref__load_weight=True))
    assert "actor_rollout_ref.ref.load_weight=True differs from actor_rollout_ref.actor.load_weight=False" in msg


def test_load_weight_false_outside_the_megatron_engines_is_refused(defaults):
    cfg = with_(defaults, actor_rollout_ref__actor__use_kl_loss=True)
    cfg["actor_rollout_ref"]["ref"]["load_weight"] = False
    assert "actor_rollout_ref.ref.load_weight=False is read by the megatron backend only" in error_of(cfg)
    cfg = with_(defaults, reward_model__enable=True, reward_model__load_weight=False)
    cfg["reward_model"]["model"]["path"] = cfg["actor_rollout_ref"]["model"]["path"]
    assert "reward_model.load_weight=False is read with reward_model.strategy=megatron only" in error_of(cfg)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"moe_config": {"freeze_moe_router": True}}, None),
        ({"num_layers": 3}, "override_mcore_model_config has num_layers: the only option it holds is moe_config"),
        ({"moe_config": {"freeze_router": True}}, "has moe_config.freeze_router"),
        ({"moe_config": {"freeze_moe_router": "yes"}}, "freeze_moe_router='yes' must be true or false"),
    ],
)
def test_override_mcore_model_config_holds_upstreams_one_option(override, match):
    from verl.workers.config import McoreEngineConfig

    if match is None:
        assert McoreEngineConfig(override_mcore_model_config=override).override_mcore_model_config == override
    else:
        with pytest.raises(ValueError, match=match):
            McoreEngineConfig(override_mcore_model_config=override)


def test_a_reward_model_compute_dtype_is_refused_as_it_would_be_ignored():
    # the FSDP reward model computes in its fixed dtype (bf16 on GPU, fp32 on CPU): another one is refused
    for override in (
        "+reward_model.model.fsdp_config.dtype=fp32",
        "+reward_model.model.fsdp_config.mixed_precision={param_dtype: fp32}",
    ):
        key = override.lstrip("+").split("=")[0]
        with pytest.raises(ConfigError, match=rf"{re.escape(key)}=.*keep {re.escape(key)}=null"):
            load_ppo_config([override], config_name="arith_demo")
