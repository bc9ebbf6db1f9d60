"""Rollout engines: `BaseRollout` and the table of engines by `actor_rollout_ref.rollout.name`.

Engines are imported only when asked for, so importing this package stays light.
"""

from __future__ import annotations

import importlib
import importlib.util

# rollout.name -> "module:Class"
ROLLOUT_ENGINES = {
    "hf": "verl.workers.rollout.hf_rollout:HFRollout",
    "vllm": "verl.workers.rollout.vllm_rollout:vLLMRollout",
    "sglang": "verl.workers.rollout.sglang_rollout:SGLangRollout",
}


def default_rollout_name() -> str:
    """`vllm` when it is installed and registered, else the built-in `hf` engine."""
    if "vllm" in ROLLOUT_ENGINES and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "hf"


def get_rollout_class(name: str, mode: str | None = None):
    """The engine class for `rollout.name`. `mode` is upstream's second argument (`async`: its server
    adapter; `sync`): here every mode gets the same engine, which runs in the rollout workers."""
    if mode not in (None, "async", "sync"):
        raise ValueError(f"rollout mode {mode!r} is not one of async, sync")
    if name not in ROLLOUT_ENGINES:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={name!r} is not a known rollout engine; choose one of {sorted(ROLLOUT_ENGINES)}"
        )
    module, cls = ROLLOUT_ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


# upstream's names at the package level, imported when first asked for
_LAZY = {
    "BaseRollout": "verl.workers.rollout.base",
    "HFRollout": "verl.workers.rollout.hf_rollout",
    "RolloutReplica": "verl.workers.rollout.replica",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ROLLOUT_ENGINES", "default_rollout_name", "get_rollout_class", *_LAZY]
