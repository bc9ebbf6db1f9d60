"""megatron-core models built from HF configs (Qwen2, Llama, Qwen3-MoE, DeepSeek-V3), and exact weight conversion both ways.

Importing this package imports megatron-core; only the megatron backend does.
"""

from verl.models.mcore.config import (
    build_gpt_model,
    build_model_chunks,
    compute_autocast,
    hf_to_mcore_config,
    megatron_dtypes,
    padded_vocab_size,
    set_compute_dtype,
)
from verl.models.mcore.registry import get_mcore_forward_fn, get_mcore_weight_converter
from verl.models.mcore.weights import hf_to_mcore_state_dict, load_hf_state_dict, mcore_to_hf_named_tensors

__all__ = [
    "build_gpt_model",
    "build_model_chunks",
    "compute_autocast",
    "get_mcore_forward_fn",
    "get_mcore_weight_converter",
    "hf_to_mcore_config",
    "hf_to_mcore_state_dict",
    "load_hf_state_dict",
    "mcore_to_hf_named_tensors",
    "megatron_dtypes",
    "padded_vocab_size",
    "set_compute_dtype",
]
