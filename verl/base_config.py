"""`BaseConfig`: the base of every typed config section, as upstream verl names it.

A config section is a dataclass built once from the composed YAML (see
`verl.utils.config.omega_conf_to_dataclass`) and then handed to the code that reads it.

Design decisions:
- Frozen by default. A section is read by several components (driver, workers, rollout); a
  component that changed a value would make the others disagree with it and with the logged
  config. Assigning to a field after construction raises `dataclasses.FrozenInstanceError`.
  A subclass that must fill a value in late (a batch size normalised per rank, say) names it in
  the class attribute `_mutable_fields`, upstream's escape hatch; `__post_init__` may set any
  field through `object.__setattr__`.
- Not `@dataclass(frozen=True)`: subclasses are plain `@dataclass`es (upstream's are), and a
  frozen base would force every subclass to be frozen too and forbid `_mutable_fields`.
- Reads like a read-only mapping (`cfg["key"]`, `cfg.get("key", default)`, `"key" in cfg`,
  iteration over field names, `len`), so code written against a DictConfig section keeps working
  when handed the dataclass. A missing key raises `ConfigKeyError`, which is both a `KeyError`
  (what a mapping raises, and what `in` relies on) and an `AttributeError` (what upstream raises).
  As upstream, an attribute set on an instance after construction (`cfg.extra = 1`, not a field)
  is readable by key too (`cfg["extra"]`, `"extra" in cfg`) and frozen once set; iteration and
  `len` still cover the declared fields only.
- `_target_` is a keyword-only field so subclasses may declare fields without defaults after it;
  it holds the dotted class path the YAML names, "" when built directly.
- `doc(...)` declares one field with the metadata the validator and the docs generator read; it is
  here, in the base layer, so a section declared below the workers (the profiler's) uses it too.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["BaseConfig", "ConfigKeyError", "doc"]

# Field status values (see `doc`).
SUPPORTED = "supported"
IGNORED = "ignored"  # accepted for compatibility with upstream configs; has no effect here
UNSUPPORTED = "unsupported"  # rejected unless it holds its neutral value
DEPRECATED = "deprecated"  # still honoured, with a warning naming the replacement
PENDING = "pending"  # rejected unless neutral: the feature is being implemented ("not implemented yet")
HARDWARE = "hardware"  # rejected unless neutral: only meaningful on hardware this build does not support

_NO_NEUTRAL = object()
NPU = "Ascend NPUs"
TRTLLM = "TensorRT-LLM (trtllm)"


class ConfigKeyError(KeyError, AttributeError):
    """A config section has no field of that name."""

    def __str__(self) -> str:  # KeyError's str() would quote the whole message
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass
class BaseConfig(collections.abc.Mapping):
    """A dataclass config section: frozen after construction except `_mutable_fields`, readable as a mapping."""

    _mutable_fields: ClassVar[frozenset[str] | set[str]] = frozenset()

    _target_: str = dataclasses.field(default="", kw_only=True)

    def __setattr__(self, name: str, value: Any) -> None:
        # A name already in __dict__ has been set by __init__: later writes are frozen. The
        # first write (inside the generated __init__) must go through.
        if name in self.__dict__ and name not in type(self)._mutable_fields:
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__}.{name} is frozen: config sections are read-only once built, "
                f"so every component sees the same value; build a new one with "
                f"dataclasses.replace(cfg, {name}=...) or list {name!r} in {type(self).__name__}._mutable_fields"
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name not in type(self)._mutable_fields:
            raise dataclasses.FrozenInstanceError(f"{type(self).__name__}.{name} is frozen and cannot be deleted")
        super().__delattr__(name)

    def _field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))

    def _has_key(self, key: str) -> bool:
        # A declared field, or an attribute set on this instance after construction (upstream
        # reads any attribute by key); methods and class attributes are not keys.
        return key in self._field_names() or key in self.__dict__

    def get(self, key: str, default: Any = None) -> Any:
        """The field `key`, or `default` when this section has no such field."""
        try:
            return self[key]
        except KeyError:
            return default

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str):
            raise TypeError(f"{type(self).__name__} keys are field names (str), got {type(key).__name__} {key!r}")
        if not self._has_key(key):
            raise ConfigKeyError(
                f"{type(self).__name__} has no field {key!r}; its fields are: {', '.join(self._field_names())}"
            )
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._has_key(key)

    def __iter__(self):
        return iter(self._field_names())

    def __len__(self) -> int:
        return len(dataclasses.fields(self))


def doc(
    text: str,
    *,
    choices: tuple | Callable[[], tuple] | None = None,
    status: str = SUPPORTED,
    neutral: Any = _NO_NEUTRAL,
    replacement: str | None = None,
    optional: bool = False,
    unset_ok: bool = False,
    hardware: str | None = None,
    hardware_values: dict | None = None,
    default: Any = dataclasses.MISSING,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
):
    """Declare one config key: its documentation and how the validator treats it.

    default / default_factory: the value when the section is built without the key (a section
        class used at runtime has upstream's defaults; the YAML holds the same values).

    choices: valid values (each element is checked when the value is a list), or a function
        returning them (for tables owned by a module too heavy to import here).
    status: SUPPORTED, IGNORED, UNSUPPORTED / PENDING (need `neutral`), DEPRECATED (needs
        `replacement`) or HARDWARE (needs `neutral` and `hardware`).
    neutral: the only value accepted for UNSUPPORTED, PENDING and HARDWARE keys (the one that
        switches the feature off).
    optional: the key may be absent (only one of the compositions holds it).
    unset_ok: `???` (Hydra's "must be set") is accepted: the key is only read by a feature that
        is off or not implemented.
    hardware_values: {value: hardware} of choices that only exist on hardware this build does not
        support (`trainer.device=npu`): refused in one line naming the hardware.
    """
    if status in (UNSUPPORTED, PENDING, HARDWARE) and neutral is _NO_NEUTRAL:
        raise TypeError("an unsupported, pending or hardware-only key needs the neutral value it must keep")
    if status == DEPRECATED and not replacement:
        raise TypeError("a deprecated key needs the name of its replacement")
    if status == HARDWARE and not hardware:
        raise TypeError("a hardware-only key needs the hardware it is for")
    meta = {
        "doc": text,
        "choices": choices,
        "status": status,
        "neutral": neutral,
        "replacement": replacement,
        "optional": optional,
        "unset_ok": unset_ok,
        "hardware": hardware,
        "hardware_values": hardware_values or {},
    }
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)
