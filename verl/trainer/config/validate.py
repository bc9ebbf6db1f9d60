"""Start-up validation of the PPO config: structure and types first, then the rules between keys.

Design decisions:
- Every problem is collected and reported in one `ConfigError`, one line each, so a user fixes a
  broken command line in one round trip instead of one error per run.
- Structure (unknown keys with a did-you-mean, missing keys, types, choices, unimplemented
  features) comes from the dataclass table in `schema.py`, walked by `schema_walk.py`; checks that
  need one section only run in its class's `__post_init__` (built here, `_check_typed_sections`);
  the cross-key rules (estimator/critic consistency, engines, trainer, LoRA, async training,
  Ulysses) are written out below, one short function per concern, mirroring the checks upstream's
  trainer does before it builds workers. The batch arithmetic is in `validate_batches.py`, the
  agent-loop and multi-turn rules in `validate_agent.py`.
- Batch semantics are upstream's: `data.train_batch_size` and `ppo_mini_batch_size` count
  prompts (x `rollout.n` sequences), split evenly over the data-parallel ranks;
  `*_micro_batch_size_per_gpu` counts sequences on one rank.
- `_target_` keys (Hydra instantiation hints in upstream's newer YAML files) and a top-level
  `hydra` section are accepted anywhere and ignored, so a config copied from upstream loads.
- Type checks are strict on purpose (no string-to-number coercion): after Hydra's parsing a
  string where a number belongs means a typo such as `data.train_batch_size=32x`.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import warnings

from omegaconf import DictConfig

from verl.trainer.config import schema as S
from verl.trainer.config.driver_keys import DriverKeys
from verl.trainer.config.errors import ConfigError, ConfigWarning
from verl.trainer.config.interpolation import interpolation_sources, plain
from verl.trainer.config.reward_migration import resolve_reward_spellings
from verl.trainer.config.schema_walk import (  # noqa: F401  (re-exported: the validator's public helpers)
    _check_section,
    is_neutral,
    is_section_type,
    iter_schema_fields,
    neutral_value,
    schema_keys,
    type_name,
)
from verl.trainer.config.validate_agent import _check_multi_turn
from verl.trainer.config.validate_batches import (
    _check_forward_batches,
    _check_rollout_layout,
    _check_train_batches,
    _get,
    need_critic,
    need_reference_policy,
    world_size,
)
from verl.trainer.config.validate_checkpoint_engine import check_checkpoint_engine
from verl.trainer.config.validate_checkpoints import check_checkpoints
from verl.trainer.config.validate_critic import check_critic_fsdp_spelling
from verl.trainer.config.validate_experts import check_megatron_experts, check_rollout_experts
from verl.trainer.config.validate_features import check_feature_combinations
from verl.trainer.config.validate_lora import check_lora
from verl.trainer.config.validate_mtp import check_mtp
from verl.trainer.config.validate_multimodal import check_multimodal, is_vision_language, local_hf_config
from verl.trainer.config.validate_router_replay import _check_router_replay
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.ulysses_keys import reference_sp, role_sp

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------- cross-key rules


def _check_typed_sections(c: dict, errors: list[str]):
    """Build each typed section: its `__post_init__` holds the checks that need only that section.

    A section holding a nested typed section is built after it (TYPED_SECTIONS lists them so) and
    skipped when the nested one failed: its error is reported once, under the nested key. A message
    that does not name the section's own keys comes from a nested section checked elsewhere (the
    engine sections: `_check_megatron`), and is left to that check, which names the full key."""
    failed: list[str] = []
    for key, cls in S.TYPED_SECTIONS.items():
        if any(bad.startswith(key + ".") for bad in failed):
            continue
        value = _get(c, key)
        try:
            cls = S.section_class(cls, value)
        except ValueError:
            continue  # the schema walk already reported the bad `_target_` under its own key
        try:
            omega_conf_to_dataclass(value, cls)
        except ValueError as e:
            failed.append(key)
            message = str(e)
            # a class shared by several sections names its key relative to the section
            prefix, _, name = key.rpartition(".")
            if not message.startswith((key, name + ".")):
                continue
            errors.append(f"{prefix}.{message}" if prefix and not message.startswith(key) else message)


def _check_positive(c: dict, errors: list[str]):
    for key, minimum in (
        ("data.train_batch_size", 1),
        ("data.max_prompt_length", 1),
        ("data.max_response_length", 1),
        ("trainer.nnodes", 1),
        ("trainer.n_gpus_per_node", 1),
        ("trainer.total_epochs", 1),
        ("trainer.log_val_generations", 0),
        ("trainer.critic_warmup", 0),
    ):
        v = _get(c, key)
        if v < minimum:
            errors.append(f"{key}={v} must be at least {minimum}")
    steps = c["trainer"]["total_training_steps"]
    if steps is not None and steps < 1:
        errors.append(
            f"trainer.total_training_steps={steps} must be at least 1, or null to run trainer.total_epochs epochs"
        )
    for key in ("trainer.save_freq", "trainer.test_freq"):
        v = _get(c, key)
        if v == 0 or v < -1:
            errors.append(f"{key}={v} is not a step interval; use a positive number of steps, or -1 to disable")


def _check_algorithm(c: dict, errors: list[str], warns: list[str]):
    alg = c["algorithm"]
    arr = c["actor_rollout_ref"]
    rollout = arr["rollout"]
    est = alg["adv_estimator"]
    n = rollout["n"]
    if est in S.GROUP_ADV_ESTIMATORS and n < 2:
        # upstream accepts this (its launch scripts use it): a group of one has no baseline
        warns.append(
            f"algorithm.adv_estimator={est} compares each response with the other responses to the same prompt, "
            f"but actor_rollout_ref.rollout.n={n} samples one per prompt, so there is no group baseline and each "
            "advantage is the raw score (REINFORCE without a baseline); set actor_rollout_ref.rollout.n to 2 or more "
            "(8 is typical) for the group-relative estimate"
        )
    if est == "gae" and c["critic"]["enable"] is False:
        errors.append(
            "algorithm.adv_estimator=gae needs a value function, but critic.enable=false; "
            "set critic.enable=true (or null), or choose a critic-free estimator such as grpo"
        )
    for key, section in (
        ("actor_rollout_ref.actor", arr["actor"]),
        ("actor_rollout_ref.ref", arr["ref"]),
        ("critic", c["critic"]),
    ):
        if section["rollout_n"] != n:
            errors.append(
                f"{key}.rollout_n={section['rollout_n']} differs from actor_rollout_ref.rollout.n={n}; "
                "leave it at its default (it follows actor_rollout_ref.rollout.n)"
            )
    if arr["actor"]["use_kl_loss"] and alg["use_kl_in_reward"]:
        warns.append(
            "actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are both on, so the KL to the "
            "reference is penalised twice (in the loss and in the reward); usually only one is wanted"
        )
    if not rollout["do_sample"] and n > 1 and est in S.GROUP_ADV_ESTIMATORS:
        warns.append(
            f"actor_rollout_ref.rollout.do_sample=false decodes greedily, so the {n} responses per prompt are "
            f"identical and {est} gives them zero advantage; set do_sample=true to learn"
        )
    tis_cap = arr["actor"]["tis_imp_ratio_cap"]
    if tis_cap is not None and tis_cap > 0 and not arr["rollout"]["calculate_log_probs"]:
        errors.append(
            f"actor_rollout_ref.actor.tis_imp_ratio_cap={tis_cap} weights the loss by the rollout engine's log-probs, "
            "which are not computed; set actor_rollout_ref.rollout.calculate_log_probs=true (or tis_imp_ratio_cap=-1)"
        )
    if est in ("optimal_token_baseline", "tir_optimal_token_baseline") and not arr["actor"].get(
        "calculate_sum_pi_squared"
    ):
        errors.append(
            f"algorithm.adv_estimator={est} weighs each token by its score norm, which needs sum_v pi_v^2 from the "
            "actor's log-prob pass; set actor_rollout_ref.actor.calculate_sum_pi_squared=true"
        )
    _check_rollout_correction(c, errors)
    if alg["use_pf_ppo"] and est != "gae":
        warns.append(
            f"algorithm.use_pf_ppo=true has no effect with algorithm.adv_estimator={est}: PF-PPO redraws the batch "
            "after GAE only (as upstream); use adv_estimator=gae or drop use_pf_ppo"
        )
    ob = c["reward_model"]["overlong_buffer"]
    if ob["enable"] and ob["len"] > c["data"]["max_response_length"]:
        errors.append(
            f"reward_model.overlong_buffer.len={ob['len']} exceeds data.max_response_length="
            f"{c['data']['max_response_length']}; the buffer is the tail of the response budget, so make it shorter"
        )


def _check_rollout_correction(c: dict, errors: list[str]):
    """algorithm.rollout_correction's own rules (levels, thresholds, rejection modes) and what it needs
    from the rest of the config (the rollout's log-probs; no second importance weighting)."""
    from verl.trainer.ppo.rollout_corr_helper import check_rollout_correction, rollout_correction_config

    arr = c["actor_rollout_ref"]
    try:
        check_rollout_correction(
            rollout_correction_config(c),
            calculate_log_probs=bool(arr["rollout"]["calculate_log_probs"]),
            loss_mode=arr["actor"]["policy_loss"]["loss_mode"],
            tis_imp_ratio_cap=arr["actor"].get("tis_imp_ratio_cap"),
        )
    except ValueError as e:
        errors.append(str(e))


def _check_lengths(c: dict, errors: list[str]):
    rollout = c["actor_rollout_ref"]["rollout"]
    total = rollout["prompt_length"] + rollout["response_length"]
    if rollout["max_model_len"] is not None and rollout["max_model_len"] < total:
        errors.append(
            f"actor_rollout_ref.rollout.max_model_len={rollout['max_model_len']} is shorter than prompt_length + "
            f"response_length = {total}; raise it or leave it null"
        )


def _check_not_implemented(c: dict, errors: list[str]):
    """Upstream choices this implementation does not have yet: fail instead of silently running something else."""
    arr = c["actor_rollout_ref"]
    if _check_engines(c, errors):
        _check_megatron(c, errors)
    _check_grad_clip(c, errors)
    _check_reward_manager(c, errors)
    prometheus = arr["rollout"].get("prometheus") or {}
    if prometheus.get("enable") and arr["rollout"].get("disable_log_stats", True):
        errors.append(
            "actor_rollout_ref.rollout.prometheus.enable=true needs actor_rollout_ref.rollout.disable_log_stats=false "
            "(as upstream: the engines' statistics are what Prometheus scrapes); set disable_log_stats=false"
        )
    if (arr["rollout"]["engine_kwargs"] or {}).get("trtllm"):
        errors.append(
            "actor_rollout_ref.rollout.engine_kwargs.trtllm is for TensorRT-LLM, which this build of verl does not "
            "support; remove it"
        )


def _engine_sections(c: dict) -> list[tuple[str, str, dict, str]]:
    """(role key, strategy, section holding the engine keys, engine-section key) of every model that runs."""
    arr = c["actor_rollout_ref"]
    out = [("actor_rollout_ref.actor", arr["actor"]["strategy"], arr["actor"], "actor_rollout_ref.actor")]
    if need_reference_policy(c):
        out.append(("actor_rollout_ref.ref", arr["ref"]["strategy"], arr["ref"], "actor_rollout_ref.ref"))
    if need_critic(c):
        critic = c["critic"]
        out.append(("critic", critic["strategy"], critic, "critic"))
    rm = c["reward_model"]
    if rm["enable"]:
        out.append(("reward_model", rm["strategy"], rm, "reward_model"))
    return out


def _check_engines(c: dict, errors: list[str]) -> bool:
    """Each running model's strategy has its engine section (fsdp_config / megatron) in the composed config."""
    ok = True
    for role, strategy, section, prefix in _engine_sections(c):
        if strategy == "megatron":
            if "megatron" not in section:
                ok = False
                errors.append(
                    f"{role}.strategy=megatron needs the {prefix}.megatron section, which the FSDP composition "
                    "(ppo_trainer) does not hold; add model_engine=megatron (or start from --config-name=ppo_megatron_trainer, "
                    f"upstream's rule) instead of overriding {role}.strategy"
                )
        else:
            holder, name = section, "fsdp_config"
            if role == "critic":
                name = "fsdp"
            elif role == "reward_model":
                holder = section["model"]
            where = f"{prefix}.model.{name}" if role == "reward_model" else f"{prefix}.{name}"
            if name not in holder:
                ok = False
                errors.append(
                    f"{role}.strategy={strategy} needs the {where} section, which the Megatron composition "
                    "(ppo_megatron_trainer) does not hold; use model_engine=dp (or --config-name=ppo_trainer) for FSDP"
                )
    return ok


def _check_role_engine_batch_keys(c: dict, errors: list[str]) -> None:
    """Refuse upstream's engine batch keys under a PPO role's engine section: the role's own keys hold them."""
    from verl.workers.config.engine import ROLE_BATCH_KEYS

    for role, strategy, section, prefix in _engine_sections(c):
        if strategy == "megatron":
            holder, where = section.get("megatron"), f"{prefix}.megatron"
        elif role in ("critic", "reward_model"):
            holder, where = section.get("model", {}).get("fsdp_config"), f"{prefix}.model.fsdp_config"
        else:
            holder, where = section.get("fsdp_config"), f"{prefix}.fsdp_config"
        holders = [(holder, where)]
        if role == "critic" and strategy != "megatron":
            holders.append((section.get("fsdp"), f"{prefix}.fsdp"))
        for key in ROLE_BATCH_KEYS:
            if strategy == "megatron" and key == "use_remove_padding":
                continue  # upstream's engine/megatron.yaml holds it (a speed knob here)
            for holder, where in holders:
                if not (isinstance(holder, dict) and key in holder):
                    continue
                errors.append(
                    f"{where}.{key}={holder[key]!r} is upstream's engine batch key, which a PPO role does not read: the "
                    f"role's own keys hold it ({prefix}.use_dynamic_bsz, its *_micro_batch_size_per_gpu and "
                    f"*_max_token_len_per_gpu keys, model.use_remove_padding / use_fused_kernels); remove it and set "
                    "the role's key"
                )


def _check_grad_clip(c: dict, errors: list[str]):
    """An FSDP role's grad_clip and its optim.clip_grad (upstream's newer spelling) must not disagree."""
    for prefix, section in (("actor_rollout_ref.actor", c["actor_rollout_ref"]["actor"]), ("critic", c["critic"])):
        if "grad_clip" not in section:
            continue
        grad_clip, clip_grad = section["grad_clip"], section["optim"]["clip_grad"]
        if grad_clip != clip_grad and grad_clip != 1.0 and clip_grad != 1.0:
            errors.append(
                f"{prefix}.grad_clip={grad_clip} and {prefix}.optim.clip_grad={clip_grad} both set the gradient-norm "
                f"clip, to different values; set one of them ({prefix}.optim.clip_grad is upstream's newer key)"
            )


def _check_reward_manager(c: dict, errors: list[str]):
    rm = c["reward_manager"]
    if rm["source"] == "importlib" and not rm["module"]["path"]:
        errors.append(
            "reward_manager.source=importlib needs reward_manager.module.path (the Python file defining the class "
            "reward_manager.module.name); or set reward_manager.source=register"
        )


def _named_manager_of_reward_file(c: dict, key: str, message: str) -> bool:
    """Whether `message` refuses a reward-manager name that `custom_reward_function.path` may register:
    that file registers its managers (`@register(name)`) when it is imported, which happens when the
    manager is built (verl.trainer.ppo.reward.load_reward_manager, in upstream's order), and the name
    is checked there; the check here would need to run the user's file."""
    names = ("reward_model.reward_manager", "reward_manager.name", "reward.reward_manager.name")
    return key in names and bool(c["custom_reward_function"]["path"]) and "is not a valid choice" in message


def _is_megatron(strategy: str) -> bool:
    return strategy == "megatron"


def _check_load_weight(c: dict, actor_meg: bool, rm_meg: bool, errors: list[str]) -> None:
    """`load_weight=false` (random initialisation) is read by the megatron engines only, and the
    reference policy, being the initial policy, starts the way the actor does."""
    arr = c["actor_rollout_ref"]
    ref_loads = arr["ref"].get("load_weight", True)
    if need_reference_policy(c):
        if not actor_meg and ref_loads is not True:
            errors.append(
                f"actor_rollout_ref.ref.load_weight={ref_loads} is read by the megatron backend only (the FSDP "
                "reference always loads model.path); remove it or use the megatron actor"
            )
        elif actor_meg and ref_loads != arr["actor"].get("load_weight", True):
            errors.append(
                f"actor_rollout_ref.ref.load_weight={ref_loads} differs from actor_rollout_ref.actor.load_weight="
                f"{arr['actor'].get('load_weight', True)}: the reference policy is the initial policy, so it starts "
                "as the actor does (with both false, from the same seeded random weights); set them equal"
            )
    rm = c["reward_model"]
    if rm["enable"] and not rm_meg and rm.get("load_weight", True) is not True:
        errors.append(
            f"reward_model.load_weight={rm.get('load_weight')} is read with reward_model.strategy=megatron only (the "
            f"{rm['strategy']} reward model always loads model.path); remove it or set reward_model.strategy=megatron"
        )


def _check_megatron(c: dict, errors: list[str]):
    """strategy=megatron: the package is there, the layout fits the ranks, actor and reference agree."""
    arr = c["actor_rollout_ref"]
    actor_meg = _is_megatron(arr["actor"]["strategy"])
    critic_meg = need_critic(c) and _is_megatron(c["critic"]["strategy"])
    rm_meg = c["reward_model"]["enable"] and _is_megatron(c["reward_model"]["strategy"])
    if arr["ref"]["strategy"] != arr["actor"]["strategy"] and need_reference_policy(c):
        errors.append(
            f"actor_rollout_ref.ref.strategy={arr['ref']['strategy']} differs from actor_rollout_ref.actor.strategy="
            f"{arr['actor']['strategy']}: the reference policy lives in the actor's workers and uses its backend; "
            "leave ref.strategy at its default (the actor's)"
        )
    _check_load_weight(c, actor_meg, rm_meg, errors)
    if not (actor_meg or critic_meg or rm_meg):
        return
    from importlib.util import find_spec

    if find_spec("megatron") is None or find_spec("megatron.core") is None:
        errors.append(
            "strategy=megatron needs megatron-core, which is not installed; `pip install -e .[mcore]` "
            "(megatron-core 0.16.1 or newer), or use strategy=fsdp"
        )
    if actor_meg:
        for key, value, neutral, why in (
            ("actor_rollout_ref.model.lora_rank", arr["model"]["lora_rank"], 0, "LoRA adapters"),
            ("actor_rollout_ref.model.lora_adapter_path", arr["model"]["lora_adapter_path"], None, "LoRA adapters"),
        ):
            if value != neutral:
                errors.append(
                    f"{key}={value} ({why}) is the FSDP backend's LoRA (peft) and is not read with "
                    f"actor_rollout_ref.actor.strategy=megatron; set {key}={neutral} and use the megatron keys "
                    "actor_rollout_ref.model.lora.rank / lora.alpha / lora.target_modules, or strategy=fsdp"
                )
    world = c["trainer"]["nnodes"] * c["trainer"]["n_gpus_per_node"]
    sections = [("actor_rollout_ref.actor", arr["actor"])] if actor_meg else []
    if critic_meg:
        sections.append(("critic", c["critic"]))
    if rm_meg:
        sections.append(("reward_model", c["reward_model"]))

    # models of different layouts are fine: the trainer gives each megatron layout its own worker
    # processes on the shared pool (verl/trainer/ppo/process_sets.py)
    for name, section in sections:
        m = section["megatron"]
        tp, pp, cp = m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"], m["context_parallel_size"]
        for key, value in (
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
            ("context_parallel_size", cp),
        ):
            if not isinstance(value, int) or value < 1:
                errors.append(f"{name}.megatron.{key}={value!r} must be a positive integer")
                return
        if m.get("use_dist_checkpointing"):
            path = m.get("dist_checkpointing_path")
            if name == "reward_model":
                errors.append(
                    "reward_model.megatron.use_dist_checkpointing=true: a reward model's score head comes from its HF "
                    "checkpoint; set it to false"
                )
            elif not path:
                errors.append(
                    f"{name}.megatron.use_dist_checkpointing=true needs {name}.megatron.dist_checkpointing_path (make "
                    "one with `python -m verl.models.mcore.converter --hf_model_path HF --output_path OUT`)"
                )
            elif "://" not in str(path) and not os.path.isdir(os.path.expanduser(str(path))):
                errors.append(f"{name}.megatron.dist_checkpointing_path={path} does not exist")
        check_megatron_experts(name, m, world, errors)
        if world % (tp * pp * cp):
            errors.append(
                f"{name}.megatron.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x "
                f"context_parallel_size={cp} = {tp * pp * cp} ranks per model copy does not divide the {world} ranks "
                f"(trainer.nnodes x trainer.n_gpus_per_node); choose sizes whose product divides {world}"
            )


def _check_trainer(c: dict, errors: list[str], warns: list[str]):
    t = c["trainer"]
    resume_path = t["resume_from_path"]
    if t["resume_mode"] == "resume_path" and not resume_path:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a .../global_step_N directory)")
    elif t["resume_mode"] == "resume_path" and not re.fullmatch(
        r"global_step_\d+", os.path.basename(os.path.normpath(str(resume_path)))
    ):
        errors.append(
            f"trainer.resume_from_path={resume_path} does not name a checkpoint: resuming needs one step's directory, "
            f"whose name is global_step_N; point it at e.g. {os.path.join(str(resume_path), 'global_step_100')}, or "
            "set trainer.resume_mode=auto to resume from the latest checkpoint in trainer.default_local_dir"
        )
    elif resume_path and t["resume_mode"] == "auto":
        warns.append(
            f"trainer.resume_from_path={resume_path} is set but trainer.resume_mode=auto ignores it (auto resumes from "
            "the latest checkpoint in trainer.default_local_dir); set trainer.resume_mode=resume_path to use it, or "
            "remove trainer.resume_from_path"
        )
    nonfinite = t["max_consecutive_nonfinite_steps"]
    if nonfinite is not None and nonfinite < 1:
        errors.append(
            f"trainer.max_consecutive_nonfinite_steps={nonfinite} must be at least 1, or null to never stop on "
            "NaN/inf losses"
        )
    crf = c["custom_reward_function"]
    manager_on_error = (c["reward_model"]["reward_kwargs"] or {}).get("on_error")
    if manager_on_error is not None and manager_on_error != crf["on_error"] and crf["on_error"] != "raise":
        errors.append(
            f"custom_reward_function.on_error={crf['on_error']} and reward_model.reward_kwargs.on_error="
            f"{manager_on_error} disagree; set only custom_reward_function.on_error"
        )
    path = c["custom_reward_function"]["path"]
    if path and not os.path.isfile(os.path.expanduser(path)):
        errors.append(
            f"custom_reward_function.path={path!r} does not exist; point it at the Python file defining {c['custom_reward_function']['name']}()"
        )
    sandbox_url = c["reward_model"]["sandbox_fusion"]["url"]
    if path and sandbox_url:
        warns.append(
            f"reward_model.sandbox_fusion.url={sandbox_url!r} is used by the built-in scorer only, and "
            f"custom_reward_function.path={path!r} replaces it (as upstream); pass the url to your function yourself "
            "(verl.utils.reward_score.default_compute_score takes sandbox_fusion_url) or drop one of the two"
        )
    if sandbox_url and not str(sandbox_url).startswith(("http://", "https://")):
        errors.append(
            f"reward_model.sandbox_fusion.url={sandbox_url!r} is not an http(s) URL; give the service's run_code "
            "endpoint, e.g. http://localhost:8080/run_code"
        )
    loggers = [t["logger"]] if isinstance(t["logger"], str) else t["logger"]
    from verl.utils.tracking import missing_backend_packages

    for backend, install in missing_backend_packages([b for b in loggers if b in S.LOGGERS]):
        errors.append(
            f"trainer.logger includes {backend!r}, but its package is not installed; run `{install}` or remove it from trainer.logger"
        )


# ---------------------------------------------------------------------------------------- entry


def _check_async_training(c: dict, errors: list[str]):
    """Generation ahead of training: what it cannot be combined with, and the rollout pool's size."""
    at = c["async_training"]
    k = at["staleness_threshold"]
    if k < 0:
        errors.append(
            f"async_training.staleness_threshold={k} must be >= 0 (0: synchronous; s: generation up to s batches ahead)"
        )
    n = at["trigger_parameter_sync_step"]
    if n < 1:
        errors.append(
            f"async_training.trigger_parameter_sync_step={n} must be >= 1 (1: push weights after every update)"
        )
    if at["partial_rollout_check_steps"] < 1:
        errors.append(
            f"async_training.partial_rollout_check_steps={at['partial_rollout_check_steps']} must be >= 1 "
            "(decode steps between two checks for newer weights)"
        )
    if k <= 0:
        for key, off in (("trigger_parameter_sync_step", n == 1), ("partial_rollout", not at["partial_rollout"])):
            if not off:
                errors.append(
                    f"async_training.{key}={at[key]} only applies to generation running ahead of training in its "
                    "own rollout pool, but async_training.staleness_threshold=0 (the colocated engine always "
                    "generates with the current weights); set async_training.staleness_threshold > 0 or drop it"
                )
        return
    whole = math.floor(k)
    if n > whole + 1:
        errors.append(
            f"async_training.trigger_parameter_sync_step={n} with staleness_threshold={k}: between two syncs the "
            f"rollout pool's weights fall up to {n - 1} versions behind the trainer's, so the batch trained right "
            f"before a sync would have to be generated {n - 1} versions early, beyond the {k} batches generation "
            f"may run ahead; set staleness_threshold >= {n - 1} or trigger_parameter_sync_step <= {whole + 1}"
        )
    rollout = c["actor_rollout_ref"]["rollout"]
    if at["partial_rollout"] and rollout["name"] not in ("hf", "vllm"):
        errors.append(
            f"async_training.partial_rollout=true is implemented for the built-in engine and vLLM, not for "
            f"actor_rollout_ref.rollout.name={rollout['name']} (it cannot pause a generation to load weights here); "
            "set actor_rollout_ref.rollout.name=hf or vllm, or async_training.partial_rollout=false"
        )
    algo = c["algorithm"]
    clashes = {
        "algorithm.filter_groups.enable=true (DAPO dynamic sampling)": algo["filter_groups"]["enable"],
        "algorithm.adv_estimator=remax (its greedy baseline needs the current weights)": algo["adv_estimator"]
        == "remax",
        "algorithm.use_kl_in_reward=true (the in-reward KL needs the trained step's log-probs)": algo[
            "use_kl_in_reward"
        ],
    }
    for what, clash in clashes.items():
        if clash:
            errors.append(
                f"async_training.staleness_threshold={k} cannot be combined with {what}; set "
                "async_training.staleness_threshold=0 or turn that option off"
            )
    for key in ("nnodes", "n_gpus_per_node"):
        if c["rollout"][key] < 1:
            errors.append(
                f"rollout.{key}={c['rollout'][key]} must be >= 1: with async_training.staleness_threshold={k} "
                "generation runs in its own pool of rollout.nnodes x rollout.n_gpus_per_node workers"
            )


def _model_heads(model: dict) -> tuple[int, int] | None:
    """(num_attention_heads, num_key_value_heads) from the HF config.json of a model section, or
    None when it is not a readable local directory (a hub id is checked when the model is built)."""
    hf = local_hf_config(model)
    if hf is None:
        return None
    hf = hf.get("text_config", hf)  # a vision-language model's decoder holds the attention heads
    heads = hf.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    kv = hf.get("num_key_value_heads") or heads
    return heads, kv


def _check_ulysses(c: dict, errors: list[str]):
    """Ulysses sequence parallelism (docs/sequence_parallel.md), checked before Ray starts: the same rules
    the workers enforce when they build the model, so a bad size fails in seconds, not after start-up.

    sp groups tile the worker group (sp | nnodes x n_gpus_per_node), the sequence split needs the packed
    (remove-padding) layout, the reference shares the actor's sp groups, and each sp rank gets an equal
    share of the attention heads (read from the model's config.json when it is a local directory)."""
    arr = c["actor_rollout_ref"]
    world = world_size(c)
    roles = []
    if arr["actor"]["strategy"] in ("fsdp", "fsdp2"):
        actor_rp = arr["actor"].get("use_remove_padding")
        if actor_rp is None:  # the worker's rule: the actor's own key, else the model's
            actor_rp = arr["model"].get("use_remove_padding", False)
        rp_key = "actor_rollout_ref.model.use_remove_padding"
        if arr["model"].get("use_remove_padding") and not actor_rp:
            rp_key = "actor_rollout_ref.actor.use_remove_padding"  # set apart from the model's: name that one
        roles.append(("actor_rollout_ref.actor", arr["actor"], actor_rp, rp_key, arr["model"]))
        try:  # the reference shares the actor's sp groups (either spelling of either key)
            reference_sp(arr["actor"], arr["ref"])
        except ValueError as e:
            errors.append(str(e))
    critic = c["critic"]
    if need_critic(c) and critic["strategy"] in ("fsdp", "fsdp2"):
        rp = critic["model"].get("use_remove_padding", False)
        roles.append(("critic", critic, rp, "critic.model.use_remove_padding", critic["model"]))
    rm = c["reward_model"]
    if rm.get("enable") and rm.get("strategy") in ("fsdp", "fsdp2"):
        rp = rm["model"].get("use_remove_padding", False)
        roles.append(("reward_model", rm, rp, "reward_model.model.use_remove_padding", rm["model"]))
    elif rm.get("enable") and role_sp(rm, "reward_model")[0] > 1:
        sp, key = role_sp(rm, "reward_model")
        errors.append(
            f"{key}={sp} with reward_model.strategy={rm.get('strategy')}: Ulysses is the FSDP reward model's; a "
            f"Megatron one splits sequences with reward_model.megatron.context_parallel_size; set {key}=1"
        )
    for prefix, section, remove_padding, rp_key, model in roles:
        try:
            sp, key = role_sp(section, prefix)
        except ValueError as e:
            errors.append(str(e))
            continue
        if sp <= 1:
            continue
        group = world
        if prefix == "reward_model" and section.get("enable_resource_pool"):
            group = (section.get("nnodes") or 0) * (section.get("n_gpus_per_node") or 0)
        if group >= 1 and group % sp:
            divisors = [d for d in range(1, group + 1) if group % d == 0]
            where = (
                "reward_model.nnodes x reward_model.n_gpus_per_node"
                if group is not world
                else "trainer.nnodes x trainer.n_gpus_per_node"
            )
            errors.append(
                f"{key}={sp} does not divide the {group} workers ({where}): each sequence-parallel group takes "
                f"{sp} of them; use one of {divisors}"
            )
        if not remove_padding:
            errors.append(
                f"{key}={sp} needs {rp_key}=true: Ulysses splits the packed (padding-free) token "
                f"sequence across ranks; set {rp_key}=true, or {key}=1"
            )
        heads = _model_heads(model)
        if heads is not None:
            h, kv = heads
            if h % sp or (kv % sp and sp % kv):
                ok = [d for d in range(1, h + 1) if h % d == 0 and (kv % d == 0 or d % kv == 0)]
                errors.append(
                    f"{key}={sp} cannot split the attention heads of "
                    f"{model.get('hf_config_path') or model.get('path')} "
                    f"(num_attention_heads={h}, num_key_value_heads={kv}): each sequence-parallel rank takes an "
                    f"equal share, so the heads must be a multiple of {sp} and the key/value heads a multiple or a "
                    f"divisor of it; use one of {ok}"
                )


def _declared_by_driver(c: dict, key: str, msg: str, driver_keys: DriverKeys) -> bool:
    """Whether the error on `key` is about a setting the recipe driver's own config makes (logged)."""
    own_advantages = key == "algorithm.adv_estimator" and c["algorithm"].get("adv_estimator") is None
    if own_advantages and driver_keys.get(key, "") is None:
        what = "algorithm.adv_estimator: null (the driver computes its advantages itself)"
    elif msg.startswith("unknown config key") and driver_keys.declares(key):
        what = f"{key} (read by the recipe's own code)"
    else:
        return False
    logger.info(f"accepted {what}: declared by the recipe driver's config {driver_keys.source[key]}")
    return True


def _raise(errors: list[str]):
    if len(errors) == 1:
        raise ConfigError(f"invalid config: {errors[0]}", errors)
    lines = "\n".join(f"  - {e}" for e in errors)
    raise ConfigError(f"invalid config ({len(errors)} problems):\n{lines}", errors)


def validate_ppo_config(cfg: DictConfig | dict, driver_keys: DriverKeys | None = None) -> None:
    """Fail fast on a config that cannot run as asked; warn (ConfigWarning) on one that probably should not.

    Raises ConfigError listing every problem found. Accepts a resolved or unresolved DictConfig
    (e.g. straight from Hydra) or a plain dict; `cfg` is not modified. `driver_keys`: what a recipe
    driver's own config files declare (`verl.trainer.config.driver_keys`): unknown keys among them are
    the recipe's and accepted, and so is `algorithm.adv_estimator: null` there (the driver computes its
    advantages itself, as verl-recipe's SPPO).
    """
    c = copy.deepcopy(plain(cfg))
    try:  # the checks read the effective reward config (a no-op after loading)
        resolve_reward_spellings(c)
    except ConfigError as e:
        _raise([str(e)])
    keyed: list[tuple[str, str]] = []
    warns: list[str] = []
    _check_section(c, S.PPOConfig, "", keyed, warns, schema_keys())
    keyed = [(k, msg) for k, msg in keyed if not _named_manager_of_reward_file(c, k, msg)]
    if driver_keys:
        keyed = [(k, msg) for k, msg in keyed if not _declared_by_driver(c, k, msg, driver_keys)]
    if keyed:
        # A key copied by interpolation (`rollout.prompt_length: ${data.max_prompt_length}`) inherits its
        # source's bad value; report the source only.
        bad = {k for k, _ in keyed}
        follows = interpolation_sources(cfg) if isinstance(cfg, DictConfig) else {}

        def copies_a_bad_value(key: str) -> bool:
            seen = set()
            while key in follows and key not in seen:  # a chain: critic -> actor -> data.train_batch_size
                seen.add(key)
                key = follows[key]
                if key in bad:
                    return True
            return False

        _raise([msg for k, msg in keyed if not copies_a_bad_value(k)])
    errors: list[str] = []
    _check_typed_sections(c, errors)
    _check_positive(c, errors)
    world = _check_rollout_layout(c, errors)
    if world is not None and not errors:
        _check_train_batches(c, errors, world, warns)
        _check_forward_batches(c, errors, world)
    _check_algorithm(c, errors, warns)
    _check_lengths(c, errors)
    _check_multi_turn(c, errors)
    check_rollout_experts(c, errors)
    _check_not_implemented(c, errors)
    check_feature_combinations(c, errors, warns)
    _check_role_engine_batch_keys(c, errors)
    check_critic_fsdp_spelling(c, warns)
    _check_trainer(c, errors, warns)
    check_checkpoints(c, errors)
    check_lora(c, errors, warns)
    _check_async_training(c, errors)
    _check_ulysses(c, errors)
    _check_router_replay(c, errors)
    check_mtp(c, errors)
    check_checkpoint_engine(c, errors)
    check_multimodal(c, errors)
    if errors:
        _raise(errors)
    for w in warns:
        warnings.warn(w, ConfigWarning, stacklevel=2)


def check_machine(cfg) -> None:
    """Fail in one line when the config asks for a device or rollout engine this machine does not have.

    Kept apart from `validate_ppo_config`, which judges the config alone (a cluster's config is valid
    on a laptop); `main_ppo` runs both before Ray starts, and `--cfg job` too.
    """
    import importlib.util

    c = plain(cfg)
    device = c["trainer"]["device"]
    engine = c["actor_rollout_ref"]["rollout"]["name"]
    problems, switches = [], []
    from verl.utils.device import ACCELERATOR_NAME

    if device == ACCELERATOR_NAME:
        import torch

        if not torch.cuda.is_available():
            problems.append("trainer.device=cuda but torch sees no CUDA GPU on this machine")
            switches.append("trainer.device=cpu")
    packages = {"vllm": "vllm", "sglang": "sglang"}
    if engine in packages and importlib.util.find_spec(packages[engine]) is None:
        problems.append(f"actor_rollout_ref.rollout.name={engine} but the {packages[engine]} package is not installed")
        switches.append("actor_rollout_ref.rollout.name=hf")
    elif "trainer.device=cpu" in switches and engine != "hf":
        switches.append("actor_rollout_ref.rollout.name=hf")
    elif engine == "vllm" and importlib.util.find_spec("torchvision") is None:
        hf_config = local_hf_config(c["actor_rollout_ref"]["model"])
        if hf_config is not None and is_vision_language(hf_config):
            problems.append(
                "actor_rollout_ref.rollout.name=vllm with a vision-language model, but vLLM's image path imports "
                "torchvision, which is not installed here (no build of it matches this torch on CPU)"
            )
            switches.append("actor_rollout_ref.rollout.name=hf")
    if problems:
        raise ConfigError(
            f"{' and '.join(problems)}; to run here set {' '.join(switches)} (the built-in engine runs on CPU and GPU)"
        )
