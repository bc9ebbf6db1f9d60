"""What the upstream-script tests share: the recorded override sets, upstream's own composition of
each (the reference), and ours.

The reference needs no upstream code: upstream's composed defaults are recorded leaf by leaf
(upstream/*_leaves.yaml), a script's own config is recorded under upstream/configs/, and the
overrides are applied with Hydra's rules (a key that does not exist needs `+`; `+` on a key that
holds a value other than null needs `++`), so a set upstream itself refuses is told apart from one
refused here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from verl.trainer.config.loader import _has_key  # the loader's own rule for "this key exists"

DATA = Path(__file__).parent / "upstream"

# Sets the issue leaves out (hardware this build does not support).
EXCLUDED = {
    "npu": re.compile(r"(^trainer\.device=npu$|^global_profiler\.tool=npu$|_npu\.sh|ascend)"),
    "trtllm": re.compile(r"(rollout\.name=trtllm|_trtllm\.sh)"),
    "engine": re.compile(
        r"(^model_engine=(veomni|torchtitan|mindspeed|mlite)$|_veomni\.sh|_mindspeed\.sh|megatron_lite\.sh)"
    ),
}


@dataclass
class ScriptSet:
    script: str
    config: str
    config_path: str | None
    overrides: list[str]

    @property
    def base(self) -> str:
        """ppo_trainer or ppo_megatron_trainer: the bundled config the set starts from."""
        if self.config.startswith("configs/"):
            return self.user_config()["defaults"][0]
        return self.config

    def user_config(self) -> dict:
        return yaml.safe_load((DATA / f"{self.config}.yaml").read_text())

    def excluded(self) -> str | None:
        texts = [self.script, *self.overrides]
        if self.config.startswith("configs/"):
            texts += [f"{k}={v}" for k, v in flat(self.user_config()).items()]
        for reason, pattern in EXCLUDED.items():
            if any(pattern.search(t) for t in texts):
                return reason
        return None


def script_sets() -> list[ScriptSet]:
    raw = yaml.safe_load((DATA / "launch_scripts.yaml").read_text())
    return [ScriptSet(e["script"], e["config"], e.get("config_path"), list(e["overrides"])) for e in raw]


def flat(node, prefix: str = "") -> dict:
    """Dotted key -> leaf of a nested dict (an empty dict is a leaf)."""
    if not isinstance(node, dict) or not node:
        return {prefix[:-1]: node}
    out = {}
    for key, value in node.items():
        out.update(flat(value, f"{prefix}{key}."))
    return out


def unflatten(leaves: dict) -> dict:
    out: dict = {}
    for dotted, value in leaves.items():
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


# v0.7 keys v0.9 moved, which this build reads as aliases of the new ones (docs/upstream.md)
RENAMED = {"critic.model.fsdp_config.": "critic.fsdp."}


class UpstreamRefuses(Exception):
    """Upstream's Hydra composition fails on this set (a stale key, a `+` on an existing value, ...)."""


def upstream_config(entry: ScriptSet) -> DictConfig:
    """Upstream's composed config of a set: its recorded defaults, the script's config, the overrides
    applied with Hydra's rules. Raises UpstreamRefuses where upstream's own composition would fail."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    base_name = entry.base
    engine = [o.split("=", 1)[1] for o in entry.overrides if o.split("=", 1)[0] == "model_engine"]
    if engine:  # upstream v0.9's config-group choice: its generated megatron config is ppo_trainer + this
        if engine[-1] not in ("dp", "megatron"):
            raise UpstreamRefuses(f"model_engine={engine[-1]}: not recorded here")
        base_name = "ppo_megatron_trainer" if engine[-1] == "megatron" else "ppo_trainer"
    base = yaml.safe_load((DATA / f"{base_name}_leaves.yaml").read_text())
    cfg = OmegaConf.create(unflatten(base))
    if entry.config.startswith("configs/"):
        own = {k: v for k, v in entry.user_config().items() if k not in ("defaults", "hydra")}
        cfg = OmegaConf.merge(cfg, own)  # a config file may add keys (Hydra merges it before struct mode)
    OmegaConf.set_struct(cfg, True)
    parser = OverridesParser.create()
    for text in entry.overrides:
        if text.split("=", 1)[0] == "model_engine":
            continue  # chose the base above
        try:
            (ov,) = parser.parse_overrides([text])
        except HydraException as e:
            raise UpstreamRefuses(f"{text!r} does not parse: {e}") from None
        key = ov.key_or_group
        if ov.package is not None or "/" in key:
            raise UpstreamRefuses(f"{text!r}: a config-group override (not recorded here)")
        for old, new in RENAMED.items():  # v0.7's spelling of a key v0.9 moved, read here as an alias
            if key.startswith(old) and not _has_key(cfg, key):
                key = new + key[len(old) :]
                (ov,) = parser.parse_overrides(
                    [f"{text.split('=', 1)[0].replace(old, new, 1)}={text.split('=', 1)[1]}"]
                )
        present = _has_key(cfg, key)
        if ov.is_delete():
            if not present:
                raise UpstreamRefuses(f"{text!r}: no such key to delete")
            parent, _, leaf = key.rpartition(".")
            with _open(cfg):
                del (OmegaConf.select(cfg, parent) if parent else cfg)[leaf]
            continue
        value = ov.value()
        if ov.is_add() and present:
            current = OmegaConf.select(cfg, key, throw_on_missing=False)
            if current is not None and not isinstance(value, dict | list):
                raise UpstreamRefuses(f"{text!r}: Hydra cannot append, an item is already at {key}")
        if not (ov.is_add() or ov.is_force_add()) and not present:
            raise UpstreamRefuses(f"{text!r}: {key} is not in upstream's config")
        with _open(cfg):
            OmegaConf.update(cfg, key, value, merge=True, force_add=True)
    if OmegaConf.is_missing(cfg.actor_rollout_ref.rollout, "name"):  # upstream's RolloutConfig requires it
        raise UpstreamRefuses("actor_rollout_ref.rollout.name is not set")
    _move_legacy_reward_keys(cfg)
    return cfg


# upstream v0.9's legacy reward spellings -> the `reward` section (its migrate_legacy_reward_impl's map)
_LEGACY_REWARD = {
    "reward_model.num_workers": "reward.num_workers",
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.reward_loop_source": "reward.reward_manager.source",
    "reward_model.reward_loop_module_path": "reward.reward_manager.module.path",
    "reward_model.reward_loop_class_name": "reward.reward_manager.module.name",
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.enable_resource_pool": "reward.reward_model.enable_resource_pool",
    "reward_model.n_gpus_per_node": "reward.reward_model.n_gpus_per_node",
    "reward_model.nnodes": "reward.reward_model.nnodes",
    "reward_model.model.path": "reward.reward_model.model_path",
    "reward_model.reward_kwargs": "reward.reward_kwargs",
}


def _move_legacy_reward_keys(cfg: DictConfig) -> None:
    """The reward config a v0.7-style set means: each legacy key the set gave a value moves to its
    `reward.*` key (a null one means unset), then the legacy sections go, as upstream's migration does."""
    if "reward" not in cfg:
        return
    moves = dict(_LEGACY_REWARD)
    for section, target in (
        ("custom_reward_function", "reward.custom_reward_function"),
        ("sandbox_fusion", "reward.sandbox_fusion"),
        ("reward_model.rollout", "reward.reward_model.rollout"),
    ):
        node = OmegaConf.select(cfg, section)
        for key in node or {}:
            moves[f"{section}.{key}"] = f"{target}.{key}"
    with _open(cfg):
        for old, new in moves.items():
            value = OmegaConf.select(cfg, old, throw_on_missing=False)
            if value is not None:
                OmegaConf.update(cfg, new, value, merge=True, force_add=True)
        for section in ("reward_model", "custom_reward_function", "sandbox_fusion"):
            cfg.pop(section, None)


class _open:
    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, True)


def resolved_leaves(cfg) -> dict:
    """Dotted key -> resolved value of every leaf (`???` kept as is)."""
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    return flat(container)


def our_config(entry: ScriptSet, substitutes: dict[str, str]):
    """Our loader on the set (validated); `substitutes` replaces values of keys naming files."""
    from verl.trainer.config import load_ppo_config

    overrides = []
    for text in entry.overrides:
        key = text.split("=", 1)[0].lstrip("+~")
        overrides.append(f"{text.split('=', 1)[0]}={substitutes[key]}" if key in substitutes else text)
    if entry.config.startswith("configs/"):
        return load_ppo_config(overrides, DATA / f"{entry.config}.yaml")
    return load_ppo_config(overrides, entry.config_path, config_name=entry.config)


def is_config_value(v) -> bool:
    return isinstance(v, DictConfig | ListConfig)
