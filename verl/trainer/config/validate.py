"""Start-up validation of the PPO config: structure and types first, then the rules between keys.

Design decisions:
- Every problem is collected and reported in one `ConfigError`, one line each, so a user fixes a
  broken command line in one round trip instead of one error per run.
- Structure (unknown keys with a did-you-mean, missing keys, types, choices, unimplemented
  features) comes from the dataclass table in `schema.py`; the cross-key rules (batch
  arithmetic, estimator/critic consistency, sampling sanity) are written out below, one short
  function per concern, mirroring the checks upstream's trainer does before it builds workers.
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
import dataclasses
import math
import os
import re
import types
import typing
import warnings
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from verl.trainer.config import schema as S
from verl.trainer.config.errors import ConfigError, ConfigWarning, did_you_mean
from verl.utils.config import omega_conf_to_dataclass

# --------------------------------------------------------------------------------------- types


def is_section_type(tp) -> bool:
    """Whether a schema type is a nested section (a dataclass) rather than a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def type_name(tp) -> str:
    """Readable name of a schema type: `int | null`, `list[str]`, `dict`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list[{type_name(arg)}]"
    if tp is dict or origin is dict:
        return "dict"
    if tp is Any:
        return "any"
    if is_section_type(tp):
        return "section"
    return tp.__name__


def _matches(value, tp) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_matches(v, arg) for v in value)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    raise TypeError(f"schema type {tp!r} is not supported by the validator")


_EXAMPLE = {int: "a whole number such as 8", float: "a number such as 0.5", bool: "true or false", str: "a string"}


def _type_hint(tp) -> str:
    base = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    for b in base:
        if b in _EXAMPLE:
            return _EXAMPLE[b]
    return f"a value of type {type_name(tp)}"


# ---------------------------------------------------------------------------------- schema walk


def iter_schema_fields(cls: type = S.PPOConfig, prefix: str = ""):
    """Yield (dotted key, field, type, owning dataclass) for every leaf and section, depth first; a
    section's subclass-only keys (`S.section_fields`) come with the subclass as their owner."""
    for f, owner, tp in S.section_fields(cls):
        full = f"{prefix}{f.name}"
        yield full, f, tp, owner
        if is_section_type(tp):
            yield from iter_schema_fields(tp, full + ".")


def schema_keys() -> list[str]:
    """Every dotted key the schema declares, sections included."""
    return [key for key, *_ in iter_schema_fields()]


def _check_section(
    value: dict, cls: type, path: str, errors: list[tuple[str, str]], warns: list[str], all_keys: list[str]
):
    """Check one section against its dataclass (the caller resolved `_target_`); errors are (dotted key, message)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in S.config_fields(cls)}
    for key in value:
        if key in fields or key == "_target_" or S.is_open(cls) or (not path and key == "hydra"):
            continue
        full = f"{path}{key}"
        hint = did_you_mean(str(key), list(fields), prefix=path, all_keys=all_keys, full_key=full)
        where = path.rstrip(".") or "the top level"
        errors.append(
            (
                full,
                f"unknown config key {full!r}: {where} has no key {key!r}.{hint} "
                "Fix the spelling, or remove it (see docs/config_reference.md for every key)",
            )
        )
    for name, f in fields.items():
        full = f"{path}{name}"
        tp = hints[name]
        meta = S.field_meta(f)
        if name not in value:
            if not meta["optional"]:
                errors.append(
                    (
                        full,
                        f"config key {full} is missing; it has no default here because the YAML provides it: add it back",
                    )
                )
            continue
        v = value[name]
        if v == "???":
            if not meta["unset_ok"]:
                choices = meta["choices"]
                options = f" (one of: {', '.join(map(str, choices))})" if choices else ""
                errors.append((full, f"config key {full} must be set (it is ???); pass {full}=...{options}"))
            continue
        if is_section_type(tp):
            if not isinstance(v, dict):
                errors.append(
                    (
                        full,
                        f"{full} is a section of keys, but it is set to {v!r}; set its keys instead, e.g. {full}.<key>=...",
                    )
                )
            else:
                try:
                    tp = S.section_class(tp, v, full)
                except ValueError as e:
                    errors.append((f"{full}._target_", str(e)))
                    continue
                _check_section(v, tp, full + ".", errors, warns, all_keys)
            continue
        if not _matches(v, tp):
            errors.append(
                (
                    full,
                    f"{full}={v!r} has type {type(v).__name__}, but {type_name(tp)} is expected; set it to {_type_hint(tp)}",
                )
            )
            continue
        hardware = meta["hardware_values"]
        items = v if isinstance(v, list) else [v]
        refused = [item for item in items if isinstance(item, str) and item in hardware]
        for item in refused:
            errors.append(
                (
                    full,
                    f"{full}={item} is for {hardware[item]}, which this build of verl does not support; "
                    f"remove the override",
                )
            )
        if refused:
            continue
        choices = meta["choices"]
        if choices:
            for item in items:
                if item is not None and item not in choices:
                    hint = did_you_mean(str(item), [str(c) for c in choices])
                    errors.append(
                        (
                            full,
                            f"{full}={item!r} is not a valid choice.{hint} Valid values: {', '.join(map(str, choices))}",
                        )
                    )
        status = meta["status"]
        if status in (S.UNSUPPORTED, S.PENDING, S.HARDWARE) and not is_neutral(v, meta["neutral"]):
            keep = f"{full}={_yaml(neutral_value(meta['neutral']))}"
            what = meta["doc"].rstrip(".")
            if status == S.UNSUPPORTED:
                msg = (
                    f"{full}={_yaml(v)} is not implemented in this verl ({what}); running without it would silently "
                    f"train something else, so remove the override (keep {keep})"
                )
            elif status == S.PENDING:
                msg = f"{full}={_yaml(v)}: not implemented yet ({what}); remove the override (keep {keep})"
            else:
                msg = (
                    f"{full}={_yaml(v)} is for {meta['hardware']}, which this build of verl does not support "
                    f"({what}); remove the override (keep {keep})"
                )
            errors.append((full, msg))
        if status == S.DEPRECATED and v is not None:
            warns.append(f"{full} is deprecated; {meta['replacement']}")


def is_neutral(value, neutral) -> bool:
    """Whether `value` is the neutral value (or one of the neutral values, when a tuple lists several)."""
    if isinstance(neutral, tuple):
        return any(is_neutral(value, n) for n in neutral)
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    return value == neutral


def neutral_value(neutral):
    """The neutral value to suggest (the first of several)."""
    return neutral[0] if isinstance(neutral, tuple) else neutral


def _yaml(v) -> str:
    if v is None:
        return "null"
    return str(v).lower() if isinstance(v, bool) else str(v)


# ------------------------------------------------------------------------------- cross-key rules


def _get(c: dict, key: str):
    node = c
    for part in key.split("."):
        node = node[part]
    return node


def need_critic(cfg) -> bool:
    """Whether the run trains a value function (upstream: critic.enable, else adv_estimator == gae)."""
    c = _plain(cfg)
    enable = c["critic"].get("enable")
    return bool(enable) if enable is not None else c["algorithm"]["adv_estimator"] == "gae"


def need_reference_policy(cfg) -> bool:
    """Whether the run needs the frozen reference policy (any KL term)."""
    c = _plain(cfg)
    return bool(c["actor_rollout_ref"]["actor"]["use_kl_loss"] or c["algorithm"]["use_kl_in_reward"])


def world_size(cfg) -> int:
    """Worker processes (GPUs, or CPU processes) in the trainer's worker group."""
    c = _plain(cfg)
    return c["trainer"]["nnodes"] * c["trainer"]["n_gpus_per_node"]


def _next_multiple(start: int, ok) -> int:
    m = max(start, 1)
    while not ok(m):
        m += 1
    return m


def _check_typed_sections(c: dict, errors: list[str]):
    """Build each typed section: its `__post_init__` holds the checks that need only that section."""
    for key, cls in S.TYPED_SECTIONS.items():
        value = _get(c, key)
        try:
            cls = S.section_class(cls, value)
        except ValueError:
            continue  # the schema walk already reported the bad `_target_` under its own key
        try:
            omega_conf_to_dataclass(value, cls)
        except ValueError as e:
            message = str(e)
            # a class shared by several sections names its key relative to the section
            prefix = key.rpartition(".")[0]
            errors.append(f"{prefix}.{message}" if prefix and not message.startswith(key) else message)


def _check_positive(c: dict, errors: list[str]):
    for key, minimum in (
        ("data.train_batch_size", 1),
        ("data.max_prompt_length", 1),
        ("data.max_response_length", 1),
        ("actor_rollout_ref.rollout.n", 1),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", 1),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", 1),
        ("actor_rollout_ref.actor.ppo_epochs", 1),
        ("actor_rollout_ref.rollout.val_kwargs.n", 1),
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


def _check_rollout_layout(c: dict, errors: list[str]) -> int | None:
    """Rollout tensor parallelism must tile the workers; returns the world size when it does."""
    world = world_size(c)
    tp = c["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"]
    if tp < 1 or world < 1:
        return None
    if world % tp:
        errors.append(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the {world} workers "
            f"(trainer.nnodes x trainer.n_gpus_per_node), so the engine's tensor-parallel groups cannot be formed; "
            f"use a divisor of {world} or change trainer.n_gpus_per_node"
        )
        return None
    return world


def _check_micro(
    errors: list[str],
    *,
    role: str,
    global_key: str,
    per_gpu_key: str,
    values: dict,
    dp: int,
    dynamic: bool,
    dynamic_key: str,
    per_rank_batch: int | None = None,
    batch_desc: str = "",
):
    """One role's micro-batch: exactly one spelling, required unless packing by tokens, and tiling the mini-batch."""
    g, p = values[global_key.rsplit(".", 1)[-1]], values[per_gpu_key.rsplit(".", 1)[-1]]
    if g is not None and p is not None:
        errors.append(
            f"{global_key}={g} and {per_gpu_key}={p} are both set, but they say the same thing two ways; "
            f"keep only {per_gpu_key} ({global_key} is deprecated)"
        )
        return
    if g is not None:
        if g % dp:
            errors.append(
                f"{global_key}={g} is not divisible by the {dp} data-parallel ranks; set {per_gpu_key} instead"
            )
            return
        p = g // dp
    if p is None:
        if not dynamic:
            errors.append(
                f"{role} needs a micro-batch size: set {per_gpu_key} (sequences per forward pass on one rank), "
                f"or {dynamic_key}=true to pack micro-batches by token count"
            )
        return
    if p < 1:
        errors.append(f"{per_gpu_key}={p} must be at least 1")
        return
    if per_rank_batch is None or dynamic:
        return
    if p >= per_rank_batch:  # an upper bound: the whole mini-batch of a rank fits in one micro-batch
        return
    if per_rank_batch % p:
        divisors = [d for d in range(1, per_rank_batch + 1) if per_rank_batch % d == 0 and d <= p]
        errors.append(
            f"{per_gpu_key}={p} does not divide the {per_rank_batch} sequences each rank gets per mini-batch "
            f"({batch_desc}), so gradient accumulation would drop or double-count sequences; "
            f"use a divisor such as {divisors[-1]}"
        )


def _check_train_batches(c: dict, errors: list[str], world: int, warns: list[str]):
    """Batch arithmetic of the actor (and the critic when it is trained)."""
    arr = c["actor_rollout_ref"]
    n = arr["rollout"]["n"]
    tbs = c["data"]["train_batch_size"]
    sp = arr["actor"].get("ulysses_sequence_parallel_size") or 1
    dp = world // sp if world % sp == 0 else world
    _check_megatron_batch(c, errors, world)
    if (tbs * n) % world:
        good = _next_multiple(tbs, lambda m: (m * n) % world == 0)
        errors.append(
            f"data.train_batch_size x actor_rollout_ref.rollout.n = {tbs} x {n} = {tbs * n} sequences per step is not "
            f"divisible by the {world} workers (trainer.nnodes x trainer.n_gpus_per_node), so the batch cannot be "
            f"split evenly across them; set data.train_batch_size={good} (or another value making the product a "
            f"multiple of {world}) or change trainer.n_gpus_per_node"
        )
    roles = [("actor", "actor_rollout_ref.actor", arr["actor"])]
    if need_critic(c):
        roles.append(("critic", "critic", c["critic"]))
    for role, prefix, sec in roles:
        mini = sec["ppo_mini_batch_size"]
        if mini < 1:
            continue
        if mini > tbs and sec["use_dynamic_bsz"]:
            # upstream's rule: with token packing a mini-batch larger than the batch is the whole batch
            warns.append(
                f"{prefix}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={tbs}, so each step "
                "takes one optimizer step over the whole batch"
            )
            continue
        if mini > tbs:
            errors.append(
                f"{prefix}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={tbs}: a mini-batch is a "
                f"slice of the step's batch (both count prompts); set {prefix}.ppo_mini_batch_size to at most {tbs}"
            )
            continue
        if tbs % mini:
            divs = [d for d in range(1, tbs + 1) if tbs % d == 0 and d <= mini]
            errors.append(
                f"data.train_batch_size={tbs} is not divisible by {prefix}.ppo_mini_batch_size={mini}, so the last "
                f"optimizer step of each batch would see fewer prompts; use a divisor such as {divs[-1]}"
            )
        if (mini * n) % dp:
            errors.append(
                f"{prefix}.ppo_mini_batch_size x rollout.n = {mini} x {n} = {mini * n} sequences is not divisible by "
                f"the {dp} data-parallel ranks, so a mini-batch cannot be split evenly; make it a multiple of {dp} "
                f"(e.g. {prefix}.ppo_mini_batch_size={_next_multiple(mini, lambda m: (m * n) % dp == 0)})"
            )
            continue
        per_rank = mini * n // dp
        _check_micro(
            errors,
            role=role,
            global_key=f"{prefix}.ppo_micro_batch_size",
            per_gpu_key=f"{prefix}.ppo_micro_batch_size_per_gpu",
            values=sec,
            dp=dp,
            dynamic=sec["use_dynamic_bsz"],
            dynamic_key=f"{prefix}.use_dynamic_bsz",
            per_rank_batch=per_rank,
            batch_desc=f"{prefix}.ppo_mini_batch_size {mini} x rollout.n {n} / {dp} ranks",
        )


def _check_megatron_batch(c: dict, errors: list[str], world: int):
    """Upstream's rule for a megatron actor with fixed micro-batches: a step's sequences split into whole
    micro-batches of every data-parallel group (data-parallel size = ranks / (tp x pp x cp))."""
    actor = c["actor_rollout_ref"]["actor"]
    meg = actor.get("megatron")
    if actor["strategy"] != "megatron" or not meg or actor["use_dynamic_bsz"]:
        return
    model_parallel = meg["tensor_model_parallel_size"] * meg["pipeline_model_parallel_size"]
    copies = model_parallel * meg["context_parallel_size"]
    micro = actor["ppo_micro_batch_size_per_gpu"]
    if not isinstance(micro, int) or micro < 1 or copies < 1 or world % copies:
        return  # reported by the micro-batch and layout checks
    minimal = world // copies * micro
    sequences = c["data"]["train_batch_size"] * c["actor_rollout_ref"]["rollout"]["n"]
    if sequences % minimal:
        errors.append(
            f"data.train_batch_size x rollout.n = {sequences} sequences per step do not split into whole "
            f"micro-batches of the {world // copies} megatron data-parallel groups ({world} ranks / tp x pp x cp = "
            f"{copies}) of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}, i.e. into multiples of "
            f"{minimal}; change data.train_batch_size or the micro-batch size"
        )


def _check_forward_batches(c: dict, errors: list[str], world: int):
    """Micro-batches of the forward-only passes (old log-probs, reference, values, reward model)."""
    arr = c["actor_rollout_ref"]
    rollout = arr["rollout"]
    passes = [("old-log-prob pass", "actor_rollout_ref.rollout", rollout, "log_prob")]
    if need_reference_policy(c):
        passes.append(("reference policy", "actor_rollout_ref.ref", arr["ref"], "log_prob"))
    for role, prefix, sec, stem in passes:
        _check_micro(
            errors,
            role=role,
            global_key=f"{prefix}.{stem}_micro_batch_size",
            per_gpu_key=f"{prefix}.{stem}_micro_batch_size_per_gpu",
            values=sec,
            dp=world,
            dynamic=sec["log_prob_use_dynamic_bsz"],
            dynamic_key=f"{prefix}.log_prob_use_dynamic_bsz",
        )
    critic = c["critic"]
    trained_micro = critic["ppo_micro_batch_size"], critic["ppo_micro_batch_size_per_gpu"]
    if need_critic(c) and (
        trained_micro != (None, None) or critic["use_dynamic_bsz"] or "forward_micro_batch_size" in critic
    ):
        # the Megatron critic has no forward_* keys: its value pass uses the training micro-batch (whose
        # absence is reported once, for the training pass)
        forward = {
            "forward_micro_batch_size": critic.get("forward_micro_batch_size"),
            "forward_micro_batch_size_per_gpu": critic.get(
                "forward_micro_batch_size_per_gpu", critic["ppo_micro_batch_size_per_gpu"]
            ),
        }
        _check_micro(
            errors,
            role="critic value pass",
            global_key="critic.forward_micro_batch_size",
            per_gpu_key="critic.forward_micro_batch_size_per_gpu",
            values=forward,
            dp=world,
            dynamic=c["critic"]["use_dynamic_bsz"],
            dynamic_key="critic.use_dynamic_bsz",
        )
    rm = c["reward_model"]
    if rm["enable"] and not rm["model"]["path"]:
        errors.append(
            "reward_model.enable=true but reward_model.model.path is null; set it to the reward model's directory"
        )
    # upstream's reward loop batches reward-model requests itself: no micro-batch needed with it
    if rm["enable"] and not rm.get("use_reward_loop", False):
        _check_micro(
            errors,
            role="reward model",
            global_key="reward_model.micro_batch_size",
            per_gpu_key="reward_model.micro_batch_size_per_gpu",
            values=rm,
            dp=world,
            dynamic=rm["use_dynamic_bsz"],
            dynamic_key="reward_model.use_dynamic_bsz",
        )


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
    if rollout["do_sample"] and rollout["temperature"] <= 0:
        errors.append(
            f"actor_rollout_ref.rollout.do_sample=true with temperature={rollout['temperature']} cannot sample; "
            "set temperature > 0 (1.0 is typical) or do_sample=false for greedy decoding"
        )
    if not rollout["do_sample"] and n > 1 and est in S.GROUP_ADV_ESTIMATORS:
        warns.append(
            f"actor_rollout_ref.rollout.do_sample=false decodes greedily, so the {n} responses per prompt are "
            f"identical and {est} gives them zero advantage; set do_sample=true to learn"
        )
    val = rollout["val_kwargs"]
    if val["do_sample"] and val["temperature"] <= 0:
        errors.append(
            f"actor_rollout_ref.rollout.val_kwargs.do_sample=true with temperature={val['temperature']} cannot sample; "
            "set val_kwargs.temperature > 0, or val_kwargs.do_sample=false for greedy validation"
        )
    if arr["actor"]["clip_ratio_c"] <= 1:
        errors.append(
            f"actor_rollout_ref.actor.clip_ratio_c={arr['actor']['clip_ratio_c']} must be > 1 (dual-clip bound; 3.0 is typical)"
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


def _check_agent_loop_keys(rollout: dict, errors: list[str]):
    """Tracing and over-sampling: keys only the agent-loop rollout reads."""
    import importlib.util

    trace, rate = rollout["trace"], rollout["over_sample_rate"]
    backend, multi_turn = trace["backend"], rollout["multi_turn"]["enable"]
    if backend is not None and not multi_turn:
        errors.append(
            f"actor_rollout_ref.rollout.trace.backend={backend} traces agent-loop episodes only (as upstream), and "
            "multi_turn.enable=false generates without agent loops, so nothing would be traced; set "
            "actor_rollout_ref.rollout.multi_turn.enable=true or trace.backend=null"
        )
    package = {"mlflow": "mlflow", "weave": "weave"}.get(backend)
    if package and importlib.util.find_spec(package) is None:
        errors.append(
            f"actor_rollout_ref.rollout.trace.backend={backend} needs the {package} package, which is not installed; "
            f"run `pip install {package}` or set trace.backend=null"
        )
    _check_agent_loop_names(rollout["agent"], errors)
    limit = trace["max_samples_per_step_per_worker"]
    if limit is not None and limit < 0:
        errors.append(
            f"actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker={limit} must be >= 0, or null to "
            "trace every episode"
        )
    if not 0 <= rate < 1:
        errors.append(
            f"actor_rollout_ref.rollout.over_sample_rate={rate} must be in [0, 1): the share of each batch's "
            "episodes cut once the others have finished (0: off)"
        )
    elif rate > 0 and not multi_turn:
        errors.append(
            f"actor_rollout_ref.rollout.over_sample_rate={rate} cuts the slowest agent-loop episodes, and "
            "multi_turn.enable=false generates without agent loops (one batch, nothing to cut); set "
            "actor_rollout_ref.rollout.multi_turn.enable=true or over_sample_rate=0"
        )


def _check_agent_loop_names(agent: dict, errors: list[str]):
    """The agent-loop config file reads as a list of loops, and the default loop is one that exists:
    registered here, registered by that file, or an import path (imported when the worker builds it)."""
    from verl.trainer.config.fields import agent_loop_choices, agent_loop_file_names

    names = set(agent_loop_choices())
    path = agent["agent_loop_config_path"]
    if path:
        try:
            names.update(agent_loop_file_names(path))
        except (OSError, ValueError) as e:
            errors.append(str(e))
            return
    default = agent["default_agent_loop"]
    if default not in names and "." not in default:
        errors.append(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={default!r} is not an agent loop: choose one of "
            f"{sorted(names)}, register it in agent.agent_loop_config_path, or give the import path of an "
            "AgentLoopBase subclass"
        )


def _check_multi_turn(c: dict, errors: list[str]):
    rollout = c["actor_rollout_ref"]["rollout"]
    _check_agent_loop_keys(rollout, errors)
    mt = rollout["multi_turn"]
    if not mt["enable"]:
        return
    path = mt["tool_config_path"]
    if path and not os.path.isfile(os.path.expanduser(path)):
        errors.append(
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path!r} does not exist; point it at a tool "
            "config YAML (see docs/multi_turn.md) or leave it null for no tools"
        )
    for key in ("max_assistant_turns", "max_user_turns"):
        if mt[key] is not None and mt[key] < 1:
            errors.append(f"actor_rollout_ref.rollout.multi_turn.{key}={mt[key]} must be >= 1, or null for no limit")
    for key in ("max_parallel_calls", "max_tool_response_length"):
        if mt[key] < 1:
            errors.append(f"actor_rollout_ref.rollout.multi_turn.{key}={mt[key]} must be >= 1")


def _check_not_implemented(c: dict, errors: list[str]):
    """Upstream choices this implementation does not have yet: fail instead of silently running something else."""
    arr = c["actor_rollout_ref"]
    if _check_engines(c, errors):
        _check_megatron(c, errors)
    _check_grad_clip(c, errors)
    _check_reward_manager(c, errors)
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
                    "(ppo_trainer) does not hold; start from --config-name=ppo_megatron_trainer (upstream's rule) "
                    f"instead of overriding {role}.strategy"
                )
        else:
            holder = section["model"] if role in ("critic", "reward_model") else section
            where = f"{prefix}.model.fsdp_config" if role in ("critic", "reward_model") else f"{prefix}.fsdp_config"
            if "fsdp_config" not in holder:
                ok = False
                errors.append(
                    f"{role}.strategy={strategy} needs the {where} section, which the Megatron composition "
                    "(ppo_megatron_trainer) does not hold; start from --config-name=ppo_trainer for FSDP"
                )
    return ok


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


def _is_megatron(strategy: str) -> bool:
    return strategy == "megatron"


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
                    f"{key}={value} ({why}) is not available with actor_rollout_ref.actor.strategy=megatron yet; "
                    f"set {key}={neutral} or use strategy=fsdp"
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
        _check_megatron_experts(name, m, world, errors)
        if world % (tp * pp * cp):
            errors.append(
                f"{name}.megatron.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x "
                f"context_parallel_size={cp} = {tp * pp * cp} ranks per model copy does not divide the {world} ranks "
                f"(trainer.nnodes x trainer.n_gpus_per_node); choose sizes whose product divides {world}"
            )


def _check_megatron_experts(name: str, m: dict, world: int, errors: list[str]) -> None:
    """Expert parallelism (docs/megatron.md, "Mixture of experts"): the expert layout must fit the ranks
    (whether ep divides the model's experts is checked when the model is built, from its HF config)."""
    tp, pp = m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"]
    ep, etp = m.get("expert_model_parallel_size", 1), m.get("expert_tensor_parallel_size")
    etp = tp if etp is None else etp
    for key, value in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if not isinstance(value, int) or value < 1:
            errors.append(f"{name}.megatron.{key}={value!r} must be a positive integer (or null for etp)")
            return
    if world % (etp * ep * pp):
        errors.append(
            f"{name}.megatron.expert_tensor_parallel_size={etp} x expert_model_parallel_size={ep} x "
            f"pipeline_model_parallel_size={pp} = {etp * ep * pp} does not divide the {world} ranks (megatron "
            f"carves its expert groups out of the same ranks); choose sizes whose product divides {world}"
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


def _check_lora(c: dict, errors: list[str], warns: list[str]):
    model = c["actor_rollout_ref"]["model"]
    rank, alpha = model["lora_rank"], model["lora_alpha"]
    if rank < 0:
        errors.append(f"actor_rollout_ref.model.lora_rank={rank} must be 0 (train all weights) or a positive LoRA rank")
    if model["lora_adapter_path"]:
        _check_lora_adapter(model, errors, warns)
        return
    if rank <= 0:
        return
    if alpha <= 0:
        errors.append(
            f"actor_rollout_ref.model.lora_alpha={alpha} must be positive: the adapter's update is scaled by "
            "lora_alpha / lora_rank (16 or 2 x lora_rank are usual)"
        )
    if not model["target_modules"]:
        errors.append(
            "actor_rollout_ref.model.target_modules is empty, so LoRA would adapt nothing; use all-linear or a list "
            "of linear layer names"
        )
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        errors.append(
            f"actor_rollout_ref.model.lora_rank={rank} needs the peft package, which is not installed; run "
            "`pip install peft` or set lora_rank=0"
        )


def _check_lora_adapter(model: dict, errors: list[str], warns: list[str]):
    """model.lora_adapter_path: a usable adapter directory (a remote one is checked by the workers
    once fetched); warn where a LoRA layout set beside it disagrees with the adapter's, which wins."""
    import importlib.util

    path = str(model["lora_adapter_path"])
    key = f"actor_rollout_ref.model.lora_adapter_path={path}"
    if importlib.util.find_spec("peft") is None:
        errors.append(f"{key} needs the peft package, which is not installed; run `pip install peft`")
        return
    if "://" in path:
        return
    from verl.utils.lora import check_adapter_dir

    try:
        adapter = check_adapter_dir(os.path.expanduser(path))
    except ValueError as e:
        errors.append(f"{key}: {e}")
        return
    if model["lora_rank"] > 0 and (model["lora_rank"], model["lora_alpha"]) != (adapter["r"], adapter["lora_alpha"]):
        warns.append(
            f"actor_rollout_ref.model.lora_rank={model['lora_rank']}, lora_alpha={model['lora_alpha']} differ from the "
            f"adapter's r={adapter['r']}, lora_alpha={adapter['lora_alpha']} in {path}: the adapter's are used (a "
            "trained adapter only fits its own layout); set them to the adapter's, or lora_rank=0"
        )
    targets = model["target_modules"]
    if isinstance(targets, list) and sorted(targets) != sorted(adapter.get("target_modules") or []):
        warns.append(
            f"actor_rollout_ref.model.target_modules={targets} differ from the adapter's "
            f"{adapter.get('target_modules')} in {path}: the adapter's are used; drop the override"
        )
    if adapter.get("lora_dropout"):
        warns.append(
            f"the adapter in {path} was trained with lora_dropout={adapter['lora_dropout']}; it trains on here without "
            "dropout (as fresh adapters do), so the trained function is the one the rollout samples from"
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


_SP = "ulysses_sequence_parallel_size"


def _model_heads(model: dict) -> tuple[int, int] | None:
    """(num_attention_heads, num_key_value_heads) from the HF config.json of a model section, or
    None when it is not a readable local directory (a hub id is checked when the model is built)."""
    import json

    path = model.get("path")
    file = os.path.join(os.path.expanduser(str(path)), "config.json") if path else None
    if not file or not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None  # an unreadable config is the model loader's error to report, with its path
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
    actor_sp = arr["actor"].get(_SP) or 1
    roles = []
    if arr["actor"]["strategy"] in ("fsdp", "fsdp2"):
        actor_rp = arr["actor"].get("use_remove_padding")
        if actor_rp is None:  # the worker's rule: the actor's own key, else the model's
            actor_rp = arr["model"].get("use_remove_padding", False)
        rp_key = "actor_rollout_ref.model.use_remove_padding"
        if arr["model"].get("use_remove_padding") and not actor_rp:
            rp_key = "actor_rollout_ref.actor.use_remove_padding"  # set apart from the model's: name that one
        roles.append(("actor_rollout_ref.actor", actor_sp, actor_rp, rp_key, arr["model"]))
        ref_sp = arr["ref"].get(_SP)
        if ref_sp is not None and ref_sp != actor_sp:
            errors.append(
                f"actor_rollout_ref.ref.{_SP}={ref_sp} differs from actor_rollout_ref.actor.{_SP}={actor_sp}: the "
                "reference runs in the actor's worker processes and uses their sequence-parallel groups; set both "
                "to the same value (or leave the reference's unset)"
            )
    critic = c["critic"]
    if need_critic(c) and critic["strategy"] in ("fsdp", "fsdp2"):
        rp = critic["model"].get("use_remove_padding", False)
        roles.append(("critic", critic.get(_SP) or 1, rp, "critic.model.use_remove_padding", critic["model"]))
    for prefix, sp, remove_padding, rp_key, model in roles:
        if sp <= 1:
            continue
        if world >= 1 and world % sp:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            errors.append(
                f"{prefix}.{_SP}={sp} does not divide the {world} workers (trainer.nnodes x "
                f"trainer.n_gpus_per_node): each sequence-parallel group takes {sp} of them; use one of {divisors}"
            )
        if not remove_padding:
            errors.append(
                f"{prefix}.{_SP}={sp} needs {rp_key}=true: Ulysses splits the packed (padding-free) token "
                f"sequence across ranks; set {rp_key}=true, or {prefix}.{_SP}=1"
            )
        heads = _model_heads(model)
        if heads is not None:
            h, kv = heads
            if h % sp or (kv % sp and sp % kv):
                ok = [d for d in range(1, h + 1) if h % d == 0 and (kv % d == 0 or d % kv == 0)]
                errors.append(
                    f"{prefix}.{_SP}={sp} cannot split the attention heads of {model.get('path')} "
                    f"(num_attention_heads={h}, num_key_value_heads={kv}): each sequence-parallel rank takes an "
                    f"equal share, so the heads must be a multiple of {sp} and the key/value heads a multiple or a "
                    f"divisor of it; use one of {ok}"
                )


def _plain(cfg) -> dict:
    if isinstance(cfg, dict):
        return cfg
    from verl.trainer.config.loader import resolve

    if not isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    try:  # to_container resolves without touching cfg (no copy needed)
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException:
        return OmegaConf.to_container(
            resolve(copy.deepcopy(cfg)), resolve=True, throw_on_missing=False
        )  # the error says which key


def _interpolation_sources(cfg: DictConfig, prefix: str = "") -> dict[str, str]:
    """{key: the key it copies} for every plain `${other.key}` / `${.sibling}` interpolation, and
    `${oc.select:other.key,default}` (upstream's spelling of the same)."""
    out = {}
    for k in cfg:
        full = f"{prefix}{k}"
        if OmegaConf.is_interpolation(cfg, k):
            text = str(cfg._get_node(k)._value()).strip()
            m = re.fullmatch(r"\$\{(\.*)([\w.]+)\}", text) or re.fullmatch(
                r"\$\{oc\.select:\s*(\.*)([\w.]+)\s*(?:,.*)?\}", text
            )
            if m:
                dots, target = m.groups()
                base = full.split(".")[: -len(dots)] if dots else []
                out[full] = ".".join([*base, target])
            continue
        node = cfg._get_node(k)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            out.update(_interpolation_sources(node, full + "."))
    return out


def _raise(errors: list[str]):
    if len(errors) == 1:
        raise ConfigError(f"invalid config: {errors[0]}", errors)
    lines = "\n".join(f"  - {e}" for e in errors)
    raise ConfigError(f"invalid config ({len(errors)} problems):\n{lines}", errors)


def validate_ppo_config(cfg: DictConfig | dict) -> None:
    """Fail fast on a config that cannot run as asked; warn (ConfigWarning) on one that probably should not.

    Raises ConfigError listing every problem found. Accepts a resolved or unresolved DictConfig
    (e.g. straight from Hydra) or a plain dict; `cfg` is not modified.
    """
    c = _plain(cfg)
    keyed: list[tuple[str, str]] = []
    warns: list[str] = []
    _check_section(c, S.PPOConfig, "", keyed, warns, schema_keys())
    if keyed:
        # A key copied by interpolation (`gen_batch_size: ${data.train_batch_size}`) inherits its
        # source's bad value; report the source only.
        bad = {k for k, _ in keyed}
        follows = _interpolation_sources(cfg) if isinstance(cfg, DictConfig) else {}

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
    _check_not_implemented(c, errors)
    _check_trainer(c, errors, warns)
    _check_lora(c, errors, warns)
    _check_async_training(c, errors)
    _check_ulysses(c, errors)
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

    c = _plain(cfg)
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
    if problems:
        raise ConfigError(
            f"{' and '.join(problems)}; to run here set {' '.join(switches)} (the built-in engine runs on CPU and GPU)"
        )
