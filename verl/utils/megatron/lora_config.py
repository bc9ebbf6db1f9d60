"""The keys of upstream's megatron `model.lora` section this backend implements, and their checks.

Kept apart from `verl.models.mcore.lora` (which builds the adapters and needs megatron-core) so the
config classes can check a section without importing megatron.
"""

from __future__ import annotations

import torch

__all__ = ["DROPOUT_POSITIONS", "INIT_METHODS", "LORA_DTYPES", "LORA_TARGETS", "lora_config_errors"]

LORA_TARGETS = {"linear_qkv": "column", "linear_proj": "row", "linear_fc1": "column", "linear_fc2": "row"}
"""The megatron layers an adapter can go on, and how their weight is split over tensor ranks."""

INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
DROPOUT_POSITIONS = ("pre", "post")
LORA_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def lora_config_errors(lora_cfg, key: str = "actor_rollout_ref.model.lora") -> list[str]:
    """What is wrong with an enabled `model.lora` section (rank > 0, a mapping), one message per problem."""
    get = lora_cfg.get
    errors = []
    if get("type", "lora") != "lora":
        errors.append(
            f"{key}.type={get('type')!r} is not implemented on this backend (only 'lora': plain low-rank adapters); "
            "set it to lora"
        )
    if float(get("alpha", 32)) <= 0:
        errors.append(f"{key}.alpha={get('alpha')} must be positive: the adapters' update is scaled by alpha / rank")
    if not 0.0 <= float(get("dropout", 0.0)) < 1.0:
        errors.append(f"{key}.dropout={get('dropout')} must be in [0, 1)")
    if get("dropout_position", "pre") not in DROPOUT_POSITIONS:
        errors.append(f"{key}.dropout_position={get('dropout_position')!r}: choose one of {list(DROPOUT_POSITIONS)}")
    for which in ("lora_A_init_method", "lora_B_init_method"):
        if get(which, "zero") not in INIT_METHODS:
            errors.append(f"{key}.{which}={get(which)!r}: choose one of {list(INIT_METHODS)}")
    targets = list(get("target_modules", list(LORA_TARGETS)) or [])
    if not targets:
        errors.append(f"{key}.target_modules is empty, so LoRA would adapt nothing; use {list(LORA_TARGETS)}")
    for name in targets + list(get("exclude_modules", []) or []):
        if "*" not in str(name) and name not in LORA_TARGETS:
            errors.append(
                f"{key}: unknown module {name!r} in target_modules/exclude_modules; valid names are "
                f"{list(LORA_TARGETS)} (or a pattern with '*' over the full module name, e.g. '*.layers.0.*')"
            )
    dtype = get("dtype", None)
    if dtype is not None and str(dtype).replace("torch.", "") not in LORA_DTYPES:
        errors.append(f"{key}.dtype={dtype!r}: choose one of {sorted(LORA_DTYPES)} or null (the model's dtype)")
    if get("a2a_experimental", False):
        errors.append(
            f"{key}.a2a_experimental=true (megatron-bridge's all-to-all in place of the sequence-parallel scatter "
            "of a row-parallel adapter's output) is not implemented here, and the result is the same without it; "
            "set it to false"
        )
    if get("adapter_path", None):
        errors.append(
            f"{key}.adapter_path={get('adapter_path')!r}: starting from a pretrained megatron adapter is not "
            "implemented; remove it to train fresh adapters (a verl checkpoint resumes its adapters by itself)"
        )
    return errors
