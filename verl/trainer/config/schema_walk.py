"""The structural check of a PPO config against the schema: unknown keys (with a did-you-mean),
missing keys, types, choices and unimplemented features, one section at a time.

Split from validate.py, which runs this walk first and then the rules between keys. Everything here
reads only the schema's tables (`schema.py`, the section classes' `doc(...)` metadata), never a rule
of its own: a key's contract is declared once, with its field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from verl.trainer.config import schema as S
from verl.trainer.config.errors import did_you_mean

_EXAMPLE = {int: "a whole number such as 8", float: "a number such as 0.5", bool: "true or false", str: "a string"}


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


def _type_hint(tp) -> str:
    base = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    for b in base:
        if b in _EXAMPLE:
            return _EXAMPLE[b]
    return f"a value of type {type_name(tp)}"


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
