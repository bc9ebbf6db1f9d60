"""Fixes applied to a live vLLM model (upstream's `verl.utils.vllm.patch`).

`patch_vllm_moe_model_weight_loader(model)`: vLLM's fused-MoE layers keep their expert weights in
`w13_weight` / `w2_weight` parameters without the `weight_loader` attribute that
`model.load_weights` looks for on every parameter (a vLLM bug since 0.8.2), so a weight update
streamed to a running engine fails on them. The patch gives each such parameter its experts
module's `weight_loader`, for the MoE families upstream patches (DeepSeek-V2/V3, Mixtral,
Qwen2-MoE, Qwen3-MoE and its VL language model, Qwen3-Next, Kimi-VL); other models are left alone.
vLLM is imported on call: without it the call fails and says so.
"""

from __future__ import annotations

__all__ = ["patch_vllm_moe_model_weight_loader"]

# vLLM model classes (by name: a vLLM build may lack some of them) whose experts need the patch
_MOE_MODEL_CLASSES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeLLMForCausalLM",
    "Qwen3NextForCausalLM",
    "KimiVLForConditionalGeneration",
)
# the attribute holding a layer's MoE block, where it is not `mlp`
_MLP_ATTRIBUTE = {"MixtralForCausalLM": "block_sparse_moe"}


def _is_patched_family(obj) -> bool:
    return any(cls.__name__ in _MOE_MODEL_CLASSES for cls in type(obj).__mro__)


def patch_vllm_moe_model_weight_loader(model) -> None:
    """Give the fused expert weights of vLLM MoE `model` their experts' `weight_loader` (in place)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "patch_vllm_moe_model_weight_loader patches a vLLM model, but vLLM is not installed in this "
            "environment; install vllm (or run the rollout in the vllm virtualenv)"
        ) from e
    if hasattr(model, "runnable") and "ACLGraphWrapper" in type(model).__name__:
        model = model.runnable  # Ascend's graph wrapper
    inner = getattr(model, "model", None) or getattr(model, "language_model", None)
    if inner is None:
        raise ValueError(
            f"patch_vllm_moe_model_weight_loader: {type(model).__name__} has no 'model' or 'language_model' attribute"
        )
    if not (_is_patched_family(model) or _is_patched_family(inner)):
        return
    if type(inner).__name__ == "Qwen3MoeLLMForCausalLM":  # Qwen3-VL-MoE: the decoder is one level down
        inner = inner.model
    mlp_attribute = _MLP_ATTRIBUTE.get(type(model).__name__, "mlp")
    for layer in inner.layers:
        mlp = getattr(layer, mlp_attribute, None)
        experts = getattr(mlp, "experts", None) if mlp is not None else None
        if experts is None or not hasattr(experts, "weight_loader"):
            continue
        for name, param in mlp.named_parameters():
            if "w13_weight" in name or "w2_weight" in name:
                param.weight_loader = experts.weight_loader
