"""The `reward` section (upstream v0.9) and its older spellings: one effective reward config.

Upstream v0.9 moved the reward settings under `reward.*` and left the older top-level keys
(`reward_model.*`, `custom_reward_function.*`, `sandbox_fusion.*`) with null defaults: a key set to
something else is copied onto its `reward.*` counterpart (`migrate_legacy_reward_impl`). This project
also keeps v0.7's `reward_manager.*` section and `reward_model.sandbox_fusion.*` (removed upstream) as
further spellings of the same settings.

`resolve_reward_spellings(cfg)` runs once, when the config loads (and again, idempotently, on the
validator's copy), and:
1. gathers, for every `reward.*` key, the values given to it: the key itself when it differs from
   its default in reward/reward.yaml, and each older spelling that is not null (an empty dict counts
   as unset for `reward_kwargs`);
2. refuses two different values for one setting (upstream lets the older spelling win silently; here a
   script that sets both, differently, is told which keys disagree);
3. writes the effective value to `reward.*` AND back to every older spelling this code base's readers
   use (the reward manager, the reward-model workers, the validator, user code written against v0.7),
   so `config.reward.reward_model.enable` and `config.reward_model.enable` say the same thing.

Why migrate once and mirror back rather than rewrite every reader: about a hundred places (including
user reward managers and recipes written for v0.7) read `config.reward_model.*` or
`config.custom_reward_function.*`, and the legacy `reward_model` section also holds this project's own
keys (strategy, micro-batch sizes, megatron, overlong_buffer, ...) that have no `reward.*` counterpart.
With both spellings holding the same value after loading, old and new readers agree.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from functools import cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from verl.trainer.config.errors import ConfigError

__all__ = ["LEGACY_SPELLINGS", "migrate_legacy_reward_impl", "resolve_reward_spellings", "reward_defaults"]

_REWARD_YAML = Path(__file__).parent / "reward" / "reward.yaml"

# the generative reward model's engine keys the legacy reward_model.rollout section holds
_LEGACY_ROLLOUT_KEYS = (
    "name",
    "dtype",
    "gpu_memory_utilization",
    "enforce_eager",
    "cudagraph_capture_sizes",
    "free_cache_engine",
    "data_parallel_size",
    "expert_parallel_size",
    "tensor_model_parallel_size",
    "max_num_batched_tokens",
    "max_model_len",
    "max_num_seqs",
    "load_format",
    "engine_kwargs",
    "limit_images",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "disable_log_stats",
    "skip_tokenizer_init",
    "prompt_length",
    "response_length",
)
_SANDBOX_KEYS = ("url", "max_concurrent", "memory_limit_mb")

LEGACY_SPELLINGS: dict[str, tuple[str, ...]] = {
    "num_workers": ("reward_model.num_workers",),
    "reward_manager.name": ("reward_model.reward_manager", "reward_manager.name"),
    "reward_manager.source": ("reward_model.reward_loop_source", "reward_manager.source"),
    "reward_manager.module.path": ("reward_model.reward_loop_module_path", "reward_manager.module.path"),
    "reward_manager.module.name": ("reward_model.reward_loop_class_name", "reward_manager.module.name"),
    "custom_reward_function.path": ("custom_reward_function.path",),
    "custom_reward_function.name": ("custom_reward_function.name",),
    "reward_model.enable": ("reward_model.enable",),
    "reward_model.enable_resource_pool": ("reward_model.enable_resource_pool",),
    "reward_model.n_gpus_per_node": ("reward_model.n_gpus_per_node",),
    "reward_model.nnodes": ("reward_model.nnodes",),
    "reward_model.model_path": ("reward_model.model.path",),
    **{f"reward_model.rollout.{k}": (f"reward_model.rollout.{k}",) for k in _LEGACY_ROLLOUT_KEYS},
    **{f"sandbox_fusion.{k}": (f"sandbox_fusion.{k}", f"reward_model.sandbox_fusion.{k}") for k in _SANDBOX_KEYS},
}
"""`reward.*` key -> its older spellings (full dotted keys), the ones upstream migrates first."""

# legacy keys with no `reward.*` counterpart: the value a null takes (their defaults before v0.9)
_LEGACY_FALLBACKS = {
    "reward_model.model.external_lib": "${actor_rollout_ref.model.external_lib}",
    "reward_model.model.trust_remote_code": False,
}
# v0.7's custom reward *loop* class (reward_model.reward_loop_*) and v0.7's custom reward *manager*
# (reward_manager.source/module) are two interfaces; the mirror writes the manager's source/module back
# only to the spelling the user chose
_LOOP_KEYS = {"reward_model.reward_loop_source", "reward_model.reward_loop_module_path"}
_LOOP_KEYS |= {"reward_model.reward_loop_class_name"}


@cache
def _defaults() -> dict:
    return OmegaConf.to_container(OmegaConf.load(_REWARD_YAML), resolve=False)


def reward_defaults() -> dict:
    """The `reward` section's defaults (reward/reward.yaml) as a plain dict (a copy)."""
    return copy.deepcopy(_defaults())


_ABSENT = object()


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        if isinstance(node, DictConfig):
            child = node._get_node(part)
            if child._is_missing():
                return "???"
            node = node[part]
        else:
            node = node[part]
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=False)
    return node


def _set(cfg, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        if part not in node or node[part] is None:
            node[part] = {}
        node = node[part]
    node[last] = copy.deepcopy(value)


def _unset(value) -> bool:
    return value is None or value is _ABSENT or (isinstance(value, Mapping) and not value)


def _given(cfg) -> tuple[dict, dict]:
    """(effective value, {key: value} of the keys that gave it) of each `reward.*` setting."""
    defaults = _defaults()
    effective, sources = {}, {}
    for new, olds in [*LEGACY_SPELLINGS.items(), ("reward_kwargs", ("reward_model.reward_kwargs",))]:
        default = _get(defaults, new)
        given = {}
        value = _get(cfg, f"reward.{new}")
        if value is not _ABSENT and value != default and not (new == "reward_kwargs" and _unset(value)):
            given[f"reward.{new}"] = value
        for old in olds:  # an older key at the default says nothing (and keeps this idempotent)
            value = _get(cfg, old)
            if not _unset(value) and value != default:
                given[old] = value
        if new == "reward_kwargs" and len(given) > 1:
            # keyword arguments merge key by key (a null one is unset): upstream's recipes set some under one
            # spelling and the rest under the other (nemo_gym's config and its scripts)
            given = {" + ".join(given): _merge_kwargs(given)}
        distinct = []
        for value in given.values():
            if value not in distinct:
                distinct.append(value)
        if len(distinct) > 1:
            said = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ConfigError(
                f"{said} set one setting to different values (reward.{new} is upstream v0.9's spelling, the others "
                f"its older ones, which upstream copies over it); set only reward.{new}"
            )
        effective[new] = distinct[0] if distinct else (None if default is _ABSENT else default)
        sources[new] = given
    return effective, sources


def _merge_kwargs(given: dict) -> dict:
    """The keyword-argument dicts of several spellings merged leaf by leaf; two different non-null values
    for one leaf are refused, naming it."""

    def merge(into: dict, value: Mapping, path: str, source: str) -> None:
        for key, item in value.items():
            where = f"{path}.{key}"
            if isinstance(item, Mapping):
                if not isinstance(into.get(key), dict):
                    into[key] = {} if into.get(key) is None else into[key]
                if not isinstance(into[key], dict):
                    raise ConfigError(f"{where} is a value in one spelling and a section in {source}; set only one")
                merge(into[key], item, where, source)
            elif item is not None and into.get(key) is not None and into[key] != item:
                raise ConfigError(
                    f"{where}={item!r} ({source}) and {into[key]!r}: one reward keyword argument set to two values "
                    "under reward.reward_kwargs and reward_model.reward_kwargs; set it once, under reward.reward_kwargs"
                )
            elif item is not None or key not in into:
                into[key] = copy.deepcopy(item)

    merged: dict = {}
    for source, value in given.items():
        merge(merged, value, "reward.reward_kwargs", source)
    return merged


_MANAGER_DEFAULTS = {"source": "register", "module.path": None, "module.name": "custom_reward_manager"}
_LOOP_DEFAULTS = {"source": "register", "module.path": None, "module.name": None}


def _write(cfg, effective: dict, sources: dict) -> None:
    # reward.reward_manager.{source,module} names a reward-loop class when written with v0.7's
    # reward_model.reward_loop_* keys, else a reward manager (v0.7's reward_manager.*): each older section
    # gets the effective value when it was the spelling used, its register default otherwise
    loop_spelling = any(k in _LOOP_KEYS for given in sources.values() for k in given)
    for new, value in effective.items():
        if new == "reward_kwargs":
            if not _unset(value):
                _set(cfg, "reward.reward_kwargs", value)
                if _get(cfg, "reward_model") is not _ABSENT:
                    _set(cfg, "reward_model.reward_kwargs", value)
            continue
        _set(cfg, f"reward.{new}", value)
        for old in LEGACY_SPELLINGS[new]:
            if _get(cfg, old.rsplit(".", 1)[0]) is _ABSENT:
                continue  # a composition without that older section
            written = value
            if new in ("reward_manager.source", "reward_manager.module.path", "reward_manager.module.name"):
                sub = new.removeprefix("reward_manager.")
                if old in _LOOP_KEYS and not loop_spelling:
                    written = _LOOP_DEFAULTS[sub]
                elif old.startswith("reward_manager.") and loop_spelling:
                    written = _MANAGER_DEFAULTS[sub]
            _set(cfg, old, written)
    for old, fallback in _LEGACY_FALLBACKS.items():
        if _get(cfg, old.rsplit(".", 1)[0]) is not _ABSENT and _get(cfg, old) in (None, _ABSENT):
            _set(cfg, old, fallback)


def resolve_reward_spellings(cfg: MutableMapping) -> MutableMapping:
    """Make `reward.*` and its older spellings hold the same, effective values (module docstring), in place.

    `cfg`: the whole trainer config, a DictConfig (struct or not) or a plain dict. A config without a
    `reward` section gets one with reward/reward.yaml's defaults first. Idempotent. Raises ConfigError when
    two spellings of one setting give different values. Returns `cfg`."""
    if isinstance(cfg, DictConfig):
        with open_dict(cfg):
            if "reward" not in cfg or cfg.reward is None:
                cfg.reward = reward_defaults()
            effective, sources = _given(cfg)
            _write(cfg, effective, sources)
        return cfg
    if cfg.get("reward") is None:
        cfg["reward"] = reward_defaults()
    effective, sources = _given(cfg)
    _write(cfg, effective, sources)
    return cfg


def _upstream_legacy_items(section, keys) -> dict:
    return {k: section.get(k) for k in keys if k in section}


def migrate_legacy_reward_impl(config):
    """Upstream v0.9's migration (`verl.experimental.reward_loop.migrate_legacy_reward_impl`): every
    non-null key of the older `reward_model`, `custom_reward_function` and `sandbox_fusion` sections is
    copied onto `config.reward` (the older key wins, as upstream), then those three sections are
    deleted. Returns `config` (changed in place; a DictConfig).

    As upstream: `reward_model.reward_loop_source`, when set, also sets `reward.reward_manager.module`'s
    path and name; `reward_model.reward_kwargs` becomes `reward.reward_kwargs`. Unlike upstream, a
    custom_reward_function / sandbox_fusion key left null keeps `reward`'s value (upstream copies the
    whole section, nulls included); this project's own keys in those sections are not copied.
    """
    with open_dict(config):
        rm = config.reward_model
        if rm.get("num_workers") is not None:
            config.reward.num_workers = rm.num_workers
        if rm.get("reward_manager") is not None:
            config.reward.reward_manager.name = rm.reward_manager
        if rm.get("reward_loop_source") is not None:
            config.reward.reward_manager.source = rm.reward_loop_source
            config.reward.reward_manager.module.path = rm.get("reward_loop_module_path")
            config.reward.reward_manager.module.name = rm.get("reward_loop_class_name")
        for key, value in _upstream_legacy_items(config.custom_reward_function, ("path", "name")).items():
            if value is not None:
                config.reward.custom_reward_function[key] = value
        for key in ("enable", "enable_resource_pool", "n_gpus_per_node", "nnodes"):
            if rm.get(key) is not None:
                config.reward.reward_model[key] = rm[key]
        if "model" in rm and rm.model.get("path") is not None:
            config.reward.reward_model.model_path = rm.model.path
        if rm.get("reward_kwargs"):
            config.reward.reward_kwargs = rm.reward_kwargs
        for key, value in (rm.get("rollout") or {}).items():
            if value is not None:
                config.reward.reward_model.rollout[key] = value
        sandbox = config.get("sandbox_fusion") or {}
        for key, value in _upstream_legacy_items(sandbox, _SANDBOX_KEYS).items():
            if value is not None:
                config.reward.sandbox_fusion[key] = value
        for section in ("reward_model", "custom_reward_function", "sandbox_fusion"):
            if section in config:
                del config[section]
    return config
