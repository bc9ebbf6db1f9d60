"""Field metadata shared by every typed config section: `doc(...)` and the option tables.

A config dataclass declares each key with `doc(text, choices=..., status=..., default=...)`: the
validator (`validate.py`), the reference-docs generator (`docgen.py`) and the runtime (through the
dataclass's own defaults and `__post_init__`) read the same declaration.

Kept apart from `schema.py` so the upstream-named section classes (`verl.trainer.config.algorithm`,
`verl.workers.config`) can use it while `schema.py` composes them into the whole tree, with the
arrows pointing one way (schema -> sections -> fields). `doc` itself and the status values live in
`verl.base_config` (the base layer, so a section declared there, `verl.utils.profiler.config`, uses
them too) and are re-exported here; the choice tables come from `verl.algorithms` (below the workers). The two
tables owned by the agent loop (`experimental/`, above the workers) stay in
`verl.trainer.config.fields`, which re-exports everything here.
"""

from __future__ import annotations

from verl.base_config import (  # noqa: F401  (re-exported: the field helpers every section imports from here)
    _NO_NEUTRAL,
    DEPRECATED,
    HARDWARE,
    IGNORED,
    NPU,
    PENDING,
    SUPPORTED,
    TRTLLM,
    UNSUPPORTED,
    doc,
)
from verl.utils.tracking import BACKENDS_NOT_IN_THIS_BUILD


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
    "gdpo",
)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# "+" suffix: straight-through variant (value from the named estimator, gradient of k2).
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full", "k1+", "low_var_kl+", "k3+")
ROLLOUT_NAMES = ("hf", "vllm", "sglang")
ROLLOUT_MODES = ("sync", "async")
STRATEGIES = ("fsdp", "fsdp2", "megatron")
# upstream's strategies whose engines are not in this build: refused by name (`doc(hardware_values=...)`)
STRATEGIES_NOT_IN_THIS_BUILD = {"veomni": "upstream's VeOmni engine"}
LOGGERS = ("clearml", "console", "file", "mlflow", "swanlab", "tensorboard", "tracking", "wandb")
# upstream's trackers not in this build: refused by name (`doc(hardware_values=...)`), owned by the tracker
LOGGERS_NOT_IN_THIS_BUILD = BACKENDS_NOT_IN_THIS_BUILD
RESUME_MODES = ("auto", "disable", "resume_path")


def device_choices() -> tuple[str, ...]:
    """Valid `trainer.device` values, owned by verl.utils.device (imported lazily: it imports torch)."""
    from verl.utils.device import _VALID

    return tuple(_VALID)


TRUNCATIONS = ("error", "left", "right", "middle")
LR_SCHEDULES = ("constant", "cosine")
KL_CTRL_TYPES = ("fixed", "adaptive")
# rate_limited is the driver's too; remote is the reward loop's (verl.experimental.reward_loop.reward_manager),
# which the trainer runs one sample per call (verl.trainer.ppo.reward)
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime", "rate_limited", "remote")
REWARD_MANAGER_SOURCES = ("register", "importlib")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
ROLLOUT_DTYPES = ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
MODEL_DTYPES = ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
ENGINE_DTYPES = ("auto", *MODEL_DTYPES)
PF_PPO_METHODS = ("pow", "max_min", "max_random")
REWARD_ON_ERROR = ("raise", "zero")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")


_SPEED = "Speed or memory only: the results do not depend on it"
