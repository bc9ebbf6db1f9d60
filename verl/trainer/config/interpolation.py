"""Interpolations of a composed config: resolving them with errors that name the key, the plain
(resolved) copy the validator reads, and which key a `${...}` copies.

Shared by the loader (which resolves the config it returns) and the validator (which reports a bad
value once, under the key it was written to, not again under every key that copies it), so that
neither imports the other.
"""

from __future__ import annotations

import copy
import re

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from verl.trainer.config.errors import ConfigError


def resolve(cfg: DictConfig) -> DictConfig:
    """Evaluate every interpolation in place, turning resolver failures into a ConfigError."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(
            f"config key {key} could not be resolved: {getattr(e, 'msg', e)}; "
            "check the ${...} interpolation it uses (the key it points at must exist)"
        ) from e
    return cfg


def plain(cfg) -> dict:
    """`cfg` as a resolved plain dict (a dict is returned as is); a resolver failure names its key."""
    if isinstance(cfg, dict):
        return cfg
    if not isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    try:  # to_container resolves without touching cfg (no copy needed)
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException:
        return OmegaConf.to_container(
            resolve(copy.deepcopy(cfg)), resolve=True, throw_on_missing=False
        )  # the error says which key


def interpolation_sources(cfg: DictConfig, prefix: str = "") -> dict[str, str]:
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
            out.update(interpolation_sources(node, full + "."))
    return out
