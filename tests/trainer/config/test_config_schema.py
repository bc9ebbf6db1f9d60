"""The schema and the composed YAML configs (ppo_trainer, ppo_megatron_trainer) describe the same keys."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import PPOConfig
from verl.trainer.config import schema as S
from verl.trainer.config.loader import compose
from verl.trainer.config.validate import is_neutral, is_section_type, iter_schema_fields, schema_keys
from verl.utils.profiler.config import TOOL_CONFIGS

COMPOSITIONS = ("ppo_trainer", "ppo_megatron_trainer")


def raw_yaml(name: str = "ppo_trainer") -> dict:
    """The composed config `name` as a plain dict, interpolations unresolved."""
    return OmegaConf.to_container(compose(name), resolve=False)


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


def optional_keys() -> set[str]:
    # a key only a `_target_` subclass declares is held by the compositions that name that subclass
    subclass_only = {c for subs in S.SECTION_SUBCLASSES.values() for c in subs}
    return {k for k, f, _, owner in iter_schema_fields() if S.field_meta(f)["optional"] or owner in subclass_only}


def under(key: str, prefixes: set[str]) -> bool:
    return any(key.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_yaml_and_schema_list_the_same_keys(name):
    """Each composition holds every schema key that is not optional, and nothing the schema lacks."""
    free, optional = dict_valued_fields(), optional_keys()
    # `_target_` names the class a section builds (checked below), not a setting
    in_yaml = {k for k in yaml_keys(raw_yaml(name)) if not under(k, free) and not k.endswith("_target_")}
    in_schema = set(schema_keys())
    assert in_yaml - in_schema == set(), f"keys in the composed {name} that the schema does not declare"
    required = {k for k in in_schema if k not in optional and not under(k, optional)}
    assert required - in_yaml == set(), f"schema keys missing from the composed {name} (the YAML holds every default)"


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_every_yaml_target_names_the_schemas_class_for_that_section(name):
    sections = {k: tp for k, _, tp, _ in iter_schema_fields() if is_section_type(tp)}
    targets = {k.rpartition(".")[0]: v for k, v in _leaves(raw_yaml(name)).items() if k.endswith("._target_")}
    assert {"algorithm", "algorithm.kl_ctrl", "actor_rollout_ref.actor.checkpoint", "critic.checkpoint"} <= set(targets)
    for section, target in targets.items():
        module, _, attr = target.rpartition(".")
        named = getattr(__import__(module, fromlist=[attr]), attr)
        if section not in sections:
            # an entry of a profiler's `tool_config` / `global_tool_config` (a dict key of the schema):
            # upstream's YAML names each tool's class, the one the entry is built into
            owner, _, tool = section.rpartition(".")
            assert owner.endswith(("profiler.tool_config", "profiler.global_tool_config")), section
            assert named is TOOL_CONFIGS[tool], f"{section}._target_={target} is not {TOOL_CONFIGS[tool]}"
            continue
        cls = sections[section]
        if target in getattr(cls, "TARGET_ALIASES", ()):
            continue  # upstream's name for the section (global_profiler's), accepted as cls
        # the schema declares the common base; a `_target_` may name one of its listed subclasses
        assert named is cls or named in S.SECTION_SUBCLASSES.get(cls, ()), f"{section}._target_={target} is not {cls}"


def _leaves(node: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def test_every_field_is_documented():
    for key, f, _, owner in iter_schema_fields():
        text = S.field_meta(f)["doc"]
        assert text and text.endswith("."), f"{key}: doc must be a sentence"
        assert owner.__doc__, f"{owner.__name__} needs a docstring"


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_yaml_defaults_are_valid_choices_and_neutral_values(name):
    raw = raw_yaml(name)
    for key, f, tp, _ in iter_schema_fields():
        if is_section_type(tp):
            continue
        value, present = raw, True
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                present = False
                break
            value = value[part]
        meta = S.field_meta(f)
        if not present:
            assert key in optional_keys() or under(key, optional_keys()), f"{key} is missing from {name}"
            continue
        if isinstance(value, str) and (value.startswith("${") or value == "???"):
            continue  # interpolation or must-be-set: checked after resolution by the defaults-validate tests
        if meta["choices"]:
            for item in value if isinstance(value, list) else [value]:
                assert item is None or item in meta["choices"], f"{key}: default {item!r} not among its choices"
        if meta["status"] in (S.UNSUPPORTED, S.PENDING, S.HARDWARE):
            assert is_neutral(value, meta["neutral"]), f"{key}: an unimplemented feature must default to off"


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
    with pytest.raises(TypeError, match="neutral"):
        S.doc("x.", status=S.PENDING)
    with pytest.raises(TypeError, match="hardware"):
        S.doc("x.", status=S.HARDWARE, neutral=None)
    with pytest.raises(TypeError, match="replacement"):
        S.doc("x.", status=S.DEPRECATED)


def test_root_schema_sections():
    assert [f.name for f in dataclasses.fields(PPOConfig)] == [
        "model_engine",
        "data",
        "actor_rollout_ref",
        "critic",
        "reward_manager",
        "reward_model",
        "custom_reward_function",
        "sandbox_fusion",
        "reward",
        "algorithm",
        "trainer",
        "global_profiler",
        "transfer_queue",
        "distillation",
        "skip",
        "ray_kwargs",
        "ray_init",
        "async_training",
        "rollout",
    ]
