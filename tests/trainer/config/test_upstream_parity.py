"""Our config tree against upstream verl's: the same keys with the same defaults, loadable without verl.

The reference is test data written down from upstream's generated full configs
(upstream/ppo_trainer_leaves.yaml, upstream/ppo_megatron_trainer_leaves.yaml,
upstream/sft_trainer_engine_leaves.yaml): every leaf with its
default, interpolations unresolved. Our composed configs may hold more keys (ours, listed in
docs/upstream.md), never fewer, and never another default.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from verl.trainer.config import CONFIG_DIR
from verl.trainer.config.loader import compose

DATA = Path(__file__).parent / "upstream"


def upstream_leaves(name: str) -> dict:
    return yaml.safe_load((DATA / f"{name}_leaves.yaml").read_text())


def leaves(cfg, prefix: str = "") -> dict:
    """Dotted key -> value of every leaf (an empty section is a leaf `{}`), interpolations unresolved."""
    out = {}
    for key in cfg:
        node = cfg._get_node(key)
        full = f"{prefix}{key}"
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_interpolation() and len(node):
            out.update(leaves(node, full + "."))
        elif isinstance(node, DictConfig | ListConfig) and not node._is_none() and not node._is_interpolation():
            out[full] = OmegaConf.to_container(node)
        else:
            out[full] = node._value()
    return out


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer", "sft_trainer_engine"])
def test_composed_config_holds_every_upstream_key_with_upstreams_default(name):
    ours = leaves(compose(name))
    theirs = upstream_leaves(name)
    missing = sorted(k for k in theirs if k not in ours)
    assert not missing, f"{len(missing)} of upstream's {len(theirs)} keys are missing: {missing[:20]}"
    different = {k: (theirs[k], ours[k]) for k in theirs if ours[k] != theirs[k]}
    assert not different, f"defaults that differ from upstream's (upstream, ours): {different}"
    assert len(theirs) == {"ppo_trainer": 767, "ppo_megatron_trainer": 847, "sft_trainer_engine": 163}[name]


def test_a_changed_default_would_be_caught():
    """The comparison above can fail: a composed config with one default changed differs."""
    cfg = compose("ppo_trainer")
    cfg.actor_rollout_ref.rollout.n = 8
    theirs = upstream_leaves("ppo_trainer")
    assert leaves(cfg)["actor_rollout_ref.rollout.n"] != theirs["actor_rollout_ref.rollout.n"]


_PLAIN_HYDRA = """
import json, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
out = {}
with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    for name in ("ppo_trainer", "ppo_megatron_trainer"):
        cfg = compose(config_name=name, overrides=["actor_rollout_ref.rollout.name=vllm"])
        OmegaConf.resolve(cfg)  # every interpolation, with OmegaConf's own resolvers only
        out[name] = [cfg.actor_rollout_ref.actor.rollout_n, cfg.critic.ppo_mini_batch_size, cfg.actor_rollout_ref.ref.strategy]
out["verl_imported"] = any(m == "verl" or m.startswith("verl.") for m in sys.modules)
print(json.dumps(out))
"""


def test_yaml_composes_and_resolves_with_plain_hydra_without_importing_verl():
    result = subprocess.run(
        [sys.executable, "-c", _PLAIN_HYDRA, str(CONFIG_DIR)], capture_output=True, text=True, cwd="/", check=False
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["verl_imported"] is False
    assert out["ppo_trainer"] == [1, 256, "fsdp"]
    assert out["ppo_megatron_trainer"] == [1, 256, "megatron"]
