"""Build typed config sections (dataclasses) from the composed OmegaConf config.

`omega_conf_to_dataclass(config, dataclass_type=None)` has upstream verl's name, signature and
results: the YAML's values override the dataclass's defaults; with no type given, the section's
`_target_` key names the class (`verl.workers.config.FSDPActorConfig`, ...).

Design decisions:
- A converter of our own rather than `OmegaConf.structured` + `merge` + `to_object` (upstream's
  route): OmegaConf's structured configs reject `from __future__ import annotations` string
  hints in some forms, and their errors name OmegaConf internals. Here an unknown key, a value of
  the wrong type or a missing required field raises `ConfigError` naming the full key path, the
  value, what was expected, and the valid keys.
- Nested sections are converted by the field's type hint (`Optional[X]` included), or by the
  nested mapping's own `_target_` when it names a subclass of that type (a `FSDPEngineConfig`
  inside a field typed `EngineConfig`). A field typed `dict`/`Any` keeps the mapping as a plain
  dict: those are the genuinely open sections (`override_config`, `engine_kwargs`).
- Scalars are checked, not coerced beyond what YAML writers expect: an int is accepted where a
  float is declared (`lr: 1` means 1.0); a bool is never accepted as a number, and a string never
  as a number, because either is a typo that would otherwise train something else.
- `_target_` with no dataclass type may name any callable; a non-dataclass target is called with
  the (converted) remaining keys, as Hydra's `instantiate` would.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["ConfigError", "omega_conf_to_dataclass", "target_class", "validate_config"]

_TARGET = "_target_"


class ConfigError(ValueError):
    """A config section cannot be built into its dataclass; the message names the key path."""


def omega_conf_to_dataclass(config: DictConfig | dict | Any, dataclass_type: type | None = None) -> Any:
    """Build `dataclass_type` (or the class `config._target_` names) from `config`.

    Args:
        config: a DictConfig or dict section; an object that is not a mapping (an already
            built dataclass, say) is returned unchanged.
        dataclass_type: the dataclass to build. When None, `config` must hold `_target_`.

    Returns:
        The built instance. An empty or None `config` gives `dataclass_type()` (all defaults),
        or None when no type is given either.
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return config  # already built (a BaseConfig is a Mapping too: don't rebuild it)
    if config is None or (isinstance(config, DictConfig | ListConfig | Mapping | list) and len(config) == 0):
        return None if dataclass_type is None else dataclass_type()
    if not isinstance(config, DictConfig | ListConfig | Mapping | list):
        return config
    if isinstance(config, DictConfig | ListConfig):
        config = OmegaConf.to_container(config, resolve=True)
    if dataclass_type is None:
        if not isinstance(config, Mapping) or _TARGET not in config:
            keys = list(config) if isinstance(config, Mapping) else f"a list of {len(config)} items"
            raise ConfigError(
                f"cannot tell which class to build from a config section without `_target_` (keys: {keys}); "
                "pass dataclass_type=..., or add `_target_: <module.Class>` to the section as the YAML "
                "sections do (e.g. actor_rollout_ref.actor._target_: verl.workers.config.FSDPActorConfig)"
            )
        return _build_target(config, path="")
    if not dataclasses.is_dataclass(dataclass_type) or not isinstance(dataclass_type, type):
        raise ConfigError(f"dataclass_type must be a dataclass class, got {dataclass_type!r}")
    if not isinstance(config, Mapping):
        raise ConfigError(f"cannot build {dataclass_type.__name__} from a list; expected a mapping of its fields")
    return _build_dataclass(dataclass_type, config, path="")


def _locate(dotted: str, path: str) -> Any:
    module_name, _, attr = str(dotted).rpartition(".")
    try:
        if not module_name:
            raise ImportError(f"{dotted!r} has no module part")
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"{_where(path, _TARGET)}={dotted!r} does not name an importable class ({e}); "
            "write the dotted path of a class, e.g. verl.workers.config.FSDPActorConfig"
        ) from e


def _where(path: str, key: str | None = None) -> str:
    full = f"{path}.{key}" if path and key else (key or path)
    return full or "<config>"


def _build_target(config: Mapping, path: str) -> Any:
    target = _locate(config[_TARGET], path)
    if dataclasses.is_dataclass(target) and isinstance(target, type):
        return _build_dataclass(target, config, path)
    kwargs = {k: _convert_untyped(v, _where(path, k)) for k, v in config.items() if k != _TARGET}
    return target(**kwargs)


def _convert_untyped(value: Any, path: str) -> Any:
    """A value whose type is open: nested `_target_` sections are built, the rest stays plain."""
    if isinstance(value, Mapping):
        if _TARGET in value:
            return _build_target(value, path)
        return {k: _convert_untyped(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_convert_untyped(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def target_class(declared: type, config: Any, path: str = "") -> type:
    """The dataclass a section builds: the subclass of `declared` its `_target_` names, else `declared`.

    The one place a section's class is chosen; the config schema uses it too, so the validator and
    `omega_conf_to_dataclass` agree on which keys a section has. Raises ConfigError when `_target_`
    names nothing importable or no subclass of `declared`; a class of `declared`'s own name is `declared` (the
    same definition imported under another module name, e.g. `__main__`). A class may list in `TARGET_ALIASES` other
    dotted names upstream's YAML gives its section (`global_profiler`'s `verl.utils.profiler.ProfilerConfig`).
    """
    target = config.get(_TARGET) if isinstance(config, Mapping) else None
    if not target or target in getattr(declared, "TARGET_ALIASES", ()):
        return declared
    named = _locate(target, path)
    if named is not declared and getattr(named, "__qualname__", None) == declared.__qualname__:
        # The declared class under another module name: the same file imported twice (a test module
        # pytest imported by its file name, a script run as __main__). Upstream ignores `_target_` when
        # the type is given; here it may only narrow the type, and this is the type itself.
        return declared
    if not (isinstance(named, type) and dataclasses.is_dataclass(named) and issubclass(named, declared)):
        raise ConfigError(
            f"{_where(path, _TARGET)}={target!r} names {getattr(named, '__name__', named)}, "
            f"which is not a {declared.__name__}; fix the `_target_` or drop it"
        )
    return named


def _build_dataclass(cls: type, config: Mapping, path: str) -> Any:
    cls = target_class(cls, config, path)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = [k for k in config if k not in fields and k != _TARGET]
    if unknown:
        raise ConfigError(
            f"{_where(path)}: unknown key(s) {', '.join(map(repr, unknown))} for {cls.__name__}; "
            f"its keys are: {', '.join(fields)}. Check the spelling, or drop the key"
        )
    kwargs = {}
    for key, value in config.items():
        if key == _TARGET and key not in fields:
            continue  # a plain (non-BaseConfig) dataclass has no field to keep it in
        kwargs[key] = _convert(value, hints.get(key, Any), _where(path, key))
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(
            f"{_where(path)}: {cls.__name__} needs {', '.join(map(repr, missing))}, which the config does not set; "
            "add them to the section"
        )
    return cls(**kwargs)


def _convert(value: Any, hint: Any, path: str) -> Any:
    if hint is Any or hint is object:
        return _convert_untyped(value, path)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(value, option, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}={value!r} matches none of {_type_name(hint)}: " + "; ".join(errors))
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"{path}={value!r} is not one of {', '.join(map(repr, args))}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return _build_dataclass(hint, value, path)
        raise ConfigError(f"{path}={value!r} must be a mapping of {hint.__name__}'s fields")
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}={value!r} must be a list")
        homogeneous = len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis)
        item = args[0] if homogeneous else Any
        items = [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}={value!r} must be a mapping")
        item = args[1] if len(args) == 2 else Any
        return {k: _convert(v, item, f"{path}.{k}") for k, v in value.items()}
    if value is None:
        raise ConfigError(f"{path} is null but must be a {_type_name(hint)}; set a value or remove the key")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is bool or hint is str:
        if isinstance(value, hint):
            return value
    else:
        return value  # a type this converter does not check (a callable, an enum, ...)
    raise ConfigError(f"{path}={value!r} ({type(value).__name__}) must be a {_type_name(hint)}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def validate_config(config, use_reference_policy: bool = True, use_critic: bool = True) -> None:
    """Upstream's config check for drivers that compose their own config (recipes' `TaskRunner`s):
    here the whole check `main_ppo` runs before Ray starts (`verl.trainer.config.validate_ppo_config`:
    unknown keys, types, batch arithmetic, settings not implemented here), which covers every
    section whatever the two flags say; they are accepted for upstream's signature. Keys the
    calling driver's own `config/*.yaml` declares beyond the schema are the recipe's and accepted
    (`verl.trainer.config.driver_keys`). Raises the trainer's `ConfigError` listing every problem."""
    del use_reference_policy, use_critic  # every section is checked

    # the check lives with the schema it checks
    from verl.trainer.config import validate_ppo_config
    from verl.trainer.config.driver_keys import calling_driver_file, driver_keys_near

    # the calling driver's own config files declare the recipe's keys (verl.trainer.config.driver_keys)
    validate_ppo_config(config, driver_keys=driver_keys_near(calling_driver_file()))
