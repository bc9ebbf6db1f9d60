"""Typed config sections built from the real YAML, for tests of code that receives one section.

A test that needs, say, a rollout config takes `rollout_config(response_length=64, multi_turn={...})`:
the section composed from ppo_trainer.yaml (so every key a test leaves alone has the YAML's default,
the one a user's run gets), with the overrides merged in (a nested mapping merges into the nested
section), built into its `verl.workers.config` class. Writing partial dicts instead would give the
code under test defaults of its own choosing, which is what the typed configs exist to prevent.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from omegaconf import OmegaConf


@functools.cache
def _composed() -> dict:
    from verl.trainer.config import load_ppo_config

    # validate=False: the micro-batch sizes the whole config asks for are not what a section test is about
    cfg = load_ppo_config(overrides=["actor_rollout_ref.rollout.name=hf"], validate=False)
    return OmegaConf.to_container(cfg, resolve=True)


def _merge(base: dict, overrides: Mapping) -> dict:
    """`base` with `overrides` merged in, nested mappings key by key. A key the YAML lacks is kept: the
    typed class it is built into refuses a misspelled one, naming it."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def section(dotted: str, **overrides) -> dict:
    """The plain dict of the composed section `dotted` (e.g. "reward_model") with `overrides` merged in."""
    node = _composed()
    for key in dotted.split("."):
        node = node[key]
    return _merge(node, overrides)


def rollout_config(**overrides):
    """`RolloutConfig` of actor_rollout_ref.rollout from the YAML, `overrides` merged in.

    The YAML's engine is tensor-parallel over 2 workers (upstream's default); the engines these tests
    run are one per process, so `tensor_model_parallel_size` is 1 unless a test overrides it.
    """
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    values = section("actor_rollout_ref.rollout", tensor_model_parallel_size=1)
    return omega_conf_to_dataclass(_merge(values, overrides), RolloutConfig)


def engine_config(**overrides):
    """`rollout_config` for a test of one engine on its own: also dtype auto (the checkpoint's float32 on
    CPU, bfloat16 on GPU; the YAML's bfloat16 is a GPU run's choice) and load_format auto (the engine reads
    the checkpoint: no trainer syncs weights into it unless the test does; the YAML's dummy is the hybrid
    engine's start). `overrides` win over both."""
    return rollout_config(**{"dtype": "auto", "load_format": "auto", **overrides})
