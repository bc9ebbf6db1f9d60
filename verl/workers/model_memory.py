"""The model section's memory options, applied to a built FSDP actor or critic model: `tiled_mlp`
(`verl.models.transformers.tiled_mlp`) and `enable_activation_offload` (`verl.utils.activation_offload`).

Upstream applies them where its FSDP workers build the model (the tiled MLP before wrapping, the
offload after); here the actor and the critic apply them to the engine's wrapped model when they are
built, which is equivalent: the tiled MLP patches the MLP class, so existing instances take it, and the
offload wraps the layers' forwards, FSDP units included.
"""

from __future__ import annotations

import torch

from verl.models.transformers.tiled_mlp import apply_tiled_mlp_monkey_patch
from verl.utils.activation_offload import ActivationOffload, enable_activation_offloading
from verl.utils.hf_forward import hf_model

__all__ = ["apply_model_memory_options"]


def _get(section, key: str, default):
    if section is None:
        return default
    if isinstance(section, dict) or hasattr(section, "get"):
        return section.get(key, default)
    return getattr(section, key, default)


def apply_model_memory_options(
    module: torch.nn.Module, model_config, strategy: str, trains: bool
) -> ActivationOffload | None:
    """Tile the MLP of `module`'s model type when `model_config.tiled_mlp.enabled` (its `num_shards`), and,
    for a trained model (`trains`), offload its activations when `model_config.enable_activation_offload`
    (checkpointing them too when `enable_gradient_checkpointing`). `model_config`: the role's model section
    (dataclass, DictConfig or dict; None: nothing to apply). Returns the offload handler, if any."""
    tiled = _get(model_config, "tiled_mlp", None)
    if _get(tiled, "enabled", False):
        hf_module = hf_model(module)
        config = getattr(hf_module, "config", None)
        apply_tiled_mlp_monkey_patch(
            num_shards=int(_get(tiled, "num_shards", 4)), model_type=getattr(config, "model_type", None)
        )
    if not (trains and _get(model_config, "enable_activation_offload", False)):
        return None
    enable_ckpt = bool(_get(model_config, "enable_gradient_checkpointing", False))
    return enable_activation_offloading(module, strategy, enable_ckpt)
