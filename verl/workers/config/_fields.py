"""Field metadata shared by every typed config section: `doc(...)` and the option tables.

A config dataclass declares each key with `doc(text, choices=..., status=..., default=...)`: the
validator (`validate.py`), the reference-docs generator (`docgen.py`) and the runtime (through the
dataclass's own defaults and `__post_init__`) read the same declaration.

Kept apart from `schema.py` so the upstream-named section classes (`verl.trainer.config.algorithm`,
`verl.workers.config`) can use it while `schema.py` composes them into the whole tree, with the
arrows pointing one way (schema -> sections -> fields). It sits in the workers layer, the lowest
layer that holds config sections; its choice tables come from `verl.algorithms` (below it). The two
tables owned by the agent loop (`experimental/`, above the workers) stay in
`verl.trainer.config.fields`, which re-exports everything here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

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


# Option tables. Each is the one place a reader finds every valid name for a config choice.
# The advantage-estimator names follow upstream's `AdvantageEstimator`; the group-based ones need
# several samples per prompt (rollout.n >= 2) because their baseline is the group's statistics.
def adv_estimator_choices() -> tuple[str, ...]:
    """`algorithm.adv_estimator` names: verl.algorithms' table (user-registered estimators included)."""
    # Lazy: verl.algorithms imports torch, and a config module is imported by light tools (docgen).
    from verl.algorithms.advantages import ADV_ESTIMATORS

    return tuple(ADV_ESTIMATORS)


def policy_loss_choices() -> tuple[str, ...]:
    """`actor.policy_loss.loss_mode` names: verl.algorithms' table, plus upstream's hyphenated spellings."""
    from verl.algorithms.policy_losses import POLICY_LOSSES

    return tuple(POLICY_LOSSES) + tuple(n.replace("_", "-") for n in POLICY_LOSSES if "_" in n and n != "geo_mean")


GROUP_ADV_ESTIMATORS = (
    "grpo",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "reinforce_plus_plus_baseline",
    "grpo_vectorized",
    "rloo_vectorized",
)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# "+" suffix: straight-through variant (value from the named estimator, gradient of k2).
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full", "k1+", "low_var_kl+", "k3+")
ROLLOUT_NAMES = ("hf", "vllm", "sglang")
ROLLOUT_MODES = ("sync", "async")
STRATEGIES = ("fsdp", "fsdp2", "megatron")
LOGGERS = ("console", "file", "mlflow", "swanlab", "tensorboard", "wandb")
RESUME_MODES = ("auto", "disable", "resume_path")


def device_choices() -> tuple[str, ...]:
    """Valid `trainer.device` values, owned by verl.utils.device (imported lazily: it imports torch)."""
    from verl.utils.device import _VALID

    return tuple(_VALID)


TRUNCATIONS = ("error", "left", "right", "middle")
LR_SCHEDULES = ("constant", "cosine")
KL_CTRL_TYPES = ("fixed", "adaptive")
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime")
REWARD_MANAGER_SOURCES = ("register", "importlib")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
ROLLOUT_DTYPES = ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
MODEL_DTYPES = ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
ENGINE_DTYPES = ("auto", *MODEL_DTYPES)
PF_PPO_METHODS = ("pow", "max_min", "max_random")
REWARD_ON_ERROR = ("raise", "zero")
PROFILER_TOOLS = ("nsys", "npu", "torch", "torch_memory")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")


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


_SPEED = "Speed or memory only: the results do not depend on it"
