"""The schema and ppo_trainer.yaml describe the same keys, with upstream's names."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import CONFIG_DIR, PPOConfig
from verl.trainer.config import schema as S
from verl.trainer.config.validate import is_section_type, iter_schema_fields, schema_keys


def raw_yaml() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"), resolve=False)


def yaml_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        keys.append(prefix + k)
        if isinstance(v, dict) and v:
            keys.extend(yaml_keys(v, prefix + k + "."))
    return keys


def dict_valued_fields() -> set[str]:
    """Keys whose value is a free-form dict (their contents are not schema keys)."""
    return {k for k, _, tp, _ in iter_schema_fields() if not is_section_type(tp) and "dict" in str(tp)}


def test_yaml_and_schema_list_the_same_keys():
    free = dict_valued_fields()
    in_yaml = {k for k in yaml_keys(raw_yaml()) if not any(k.startswith(f + ".") for f in free)}
    in_schema = set(schema_keys())
    assert in_yaml - in_schema == set(), "keys in ppo_trainer.yaml that the schema does not declare"
    assert in_schema - in_yaml == set(), "schema keys missing from ppo_trainer.yaml (it holds every default)"


def test_every_field_is_documented():
    for key, f, _, owner in iter_schema_fields():
        text = S.field_meta(f)["doc"]
        assert text and text.endswith("."), f"{key}: doc must be a sentence"
        assert owner.__doc__, f"{owner.__name__} needs a docstring"


def test_yaml_defaults_are_valid_choices_and_neutral_values():
    raw = raw_yaml()
    for key, f, tp, _ in iter_schema_fields():
        if is_section_type(tp):
            continue
        value = raw
        for part in key.split("."):
            value = value[part]
        meta = S.field_meta(f)
        if isinstance(value, str) and value.startswith("${"):
            continue  # interpolation: checked after resolution by the defaults-validate test
        if meta["choices"]:
            for item in value if isinstance(value, list) else [value]:
                assert item is None or item in meta["choices"], f"{key}: default {item!r} not among its choices"
        if meta["status"] == S.UNSUPPORTED:
            assert value == meta["neutral"], f"{key}: an unimplemented feature must default to off"


def test_schema_types_are_ones_the_validator_understands():
    allowed = {int, float, bool, str, dict, type(None)}
    for key, _, tp, _ in iter_schema_fields():
        if is_section_type(tp):
            continue
        for arg in typing.get_args(tp) or (tp,):
            inner = typing.get_args(arg) if typing.get_origin(arg) is list else (arg,)
            assert all(a in allowed or typing.get_origin(a) is dict for a in inner), f"{key}: {tp}"


def test_doc_helper_insists_on_what_status_needs():
    with pytest.raises(TypeError, match="neutral"):
        S.doc("x.", status=S.UNSUPPORTED)
    with pytest.raises(TypeError, match="replacement"):
        S.doc("x.", status=S.DEPRECATED)


# Keys upstream users set in their scripts (upstream's ppo_trainer.yaml, examples and DAPO recipe).
UPSTREAM_KEYS = [
    "data.train_files",
    "data.val_files",
    "data.prompt_key",
    "data.reward_fn_key",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.train_batch_size",
    "data.val_batch_size",
    "data.gen_batch_size",
    "data.return_raw_chat",
    "data.shuffle",
    "data.filter_overlong_prompts",
    "data.truncation",
    "data.seed",
    "data.dataloader_num_workers",
    "data.custom_cls.path",
    "data.custom_cls.name",
    "data.tokenizer",
    "actor_rollout_ref.hybrid_engine",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.model.trust_remote_code",
    "actor_rollout_ref.model.override_config",
    "actor_rollout_ref.model.external_lib",
    "actor_rollout_ref.model.use_shm",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.actor.grad_clip",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.policy_loss.loss_mode",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.use_torch_compile",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.shuffle",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.checkpoint.save_contents",
    "actor_rollout_ref.actor.checkpoint.load_contents",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
    "actor_rollout_ref.actor.optim.min_lr_ratio",
    "actor_rollout_ref.actor.optim.warmup_style",
    "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "actor_rollout_ref.actor.optim.total_training_steps",
    "actor_rollout_ref.actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.betas",
    "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.actor.fsdp_config.offload_policy",
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size",
    "actor_rollout_ref.actor.fsdp_config.wrap_policy",
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch",
    "actor_rollout_ref.actor.fsdp_config.model_dtype",
    "actor_rollout_ref.ref.fsdp_config.param_offload",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.mode",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.dtype",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.ignore_eos",
    "actor_rollout_ref.rollout.enforce_eager",
    "actor_rollout_ref.rollout.free_cache_engine",
    "actor_rollout_ref.rollout.load_format",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.max_model_len",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.do_sample",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.rollout.engine_kwargs",
    "actor_rollout_ref.rollout.val_kwargs.top_k",
    "actor_rollout_ref.rollout.val_kwargs.top_p",
    "actor_rollout_ref.rollout.val_kwargs.temperature",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.val_kwargs.do_sample",
    "actor_rollout_ref.rollout.multi_turn.enable",
    "critic.optim.lr",
    "critic.model.path",
    "critic.model.use_remove_padding",
    "critic.model.enable_gradient_checkpointing",
    "critic.model.fsdp_config.param_offload",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.ppo_mini_batch_size",
    "critic.use_dynamic_bsz",
    "critic.ppo_max_token_len_per_gpu",
    "critic.cliprange_value",
    "critic.grad_clip",
    "critic.enable",
    "reward_model.enable",
    "reward_model.strategy",
    "reward_model.model.path",
    "reward_model.model.input_tokenizer",
    "reward_model.micro_batch_size_per_gpu",
    "reward_model.reward_manager",
    "reward_model.launch_reward_fn_async",
    "reward_model.overlong_buffer.enable",
    "reward_model.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor",
    "custom_reward_function.path",
    "custom_reward_function.name",
    "algorithm.gamma",
    "algorithm.lam",
    "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty",
    "algorithm.kl_ctrl.type",
    "algorithm.kl_ctrl.kl_coef",
    "algorithm.kl_ctrl.horizon",
    "algorithm.kl_ctrl.target_kl",
    "algorithm.use_pf_ppo",
    "algorithm.filter_groups.enable",
    "algorithm.filter_groups.metric",
    "algorithm.filter_groups.max_num_gen_batches",
    "trainer.balance_batch",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.logger",
    "trainer.log_val_generations",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.save_freq",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.val_before_train",
    "trainer.val_only",
    "trainer.test_freq",
    "trainer.critic_warmup",
    "trainer.default_hdfs_dir",
    "trainer.default_local_dir",
    "trainer.del_local_ckpt_after_load",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep",
    "trainer.ray_wait_register_center_timeout",
    "trainer.device",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
    "ray_init.num_cpus",
    "ray_init.timeline_json_file",
    "ray_kwargs.ray_init.num_cpus",
    "ray_kwargs.timeline_json_file",
]


def test_upstream_key_names_are_all_present():
    assert set(UPSTREAM_KEYS) - set(schema_keys()) == set()


def test_root_schema_sections():
    assert [f.name for f in dataclasses.fields(PPOConfig)] == [
        "data",
        "actor_rollout_ref",
        "critic",
        "reward_model",
        "custom_reward_function",
        "algorithm",
        "trainer",
        "ray_kwargs",
        "ray_init",
        "async_training",
        "rollout",
    ]
