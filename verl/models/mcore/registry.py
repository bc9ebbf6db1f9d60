"""Upstream's per-architecture entry points (`verl.models.mcore.get_mcore_forward_fn`,
`get_mcore_weight_converter`), on this backend's models.

- `get_mcore_forward_fn(hf_config)` gives upstream's `model_forward(model, input_ids,
  attention_mask, position_ids, multi_modal_inputs, logits_processor=None,
  logits_processor_args=None, value_model=False, ...)`: the padded [B, S] batch in, per-token
  outputs [B, S, ...] out (zeros at padding), and, with a `logits_processor`, its dict of outputs
  instead. Upstream packs the rows (THD, TransformerEngine attention); here the rows are
  left-aligned (`verl.models.mcore.forward.left_align`: megatron's local attention takes no packed
  sequences) and mapped back, which gives every real token the same logits.
- `get_mcore_weight_converter(hf_config, dtype)` gives an object whose `convert_param(name,
  params)` maps one full (tensor-parallel-gathered, globally numbered) megatron parameter to HF
  names: q/k/v and gate/up come as separate parts (upstream's simple split), experts one by one.
  verl's own engine streams whole models with `mcore_to_hf_named_tensors` instead.

Not covered (clear errors): vision-language inputs, multi-token-prediction training, context
parallelism in the forward; latent-attention and gpt-oss weights in the per-tensor converter.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

__all__ = ["McoreToHFWeightConverter", "get_mcore_forward_fn", "get_mcore_weight_converter"]

_DENSE = ("qwen2", "llama")
_MOE = ("qwen3_moe",)


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _to_aligned(value: torch.Tensor, aligned) -> torch.Tensor:
    """[B, S, ...] per-token values of the padded batch -> [B, L, ...] at the aligned columns (zeros,
    or False, at the aligned padding)."""
    index = aligned.source_columns.reshape(*aligned.source_columns.shape, *([1] * (value.dim() - 2)))
    gathered = torch.gather(value, 1, index.expand(-1, -1, *value.shape[2:]))
    real = aligned.real.reshape(*aligned.real.shape, *([1] * (value.dim() - 2)))
    return torch.where(real, gathered, torch.zeros_like(gathered))


def _to_padded(value: torch.Tensor, aligned, seqlen: int) -> torch.Tensor:
    """[B, L, ...] at the aligned columns -> [B, S, ...] of the padded batch (zeros at its padding)."""
    rows, columns = aligned.real.nonzero(as_tuple=True)
    out = value.new_zeros(value.shape[0], seqlen, *value.shape[2:])
    out[rows, aligned.source_columns[rows, columns]] = value[rows, columns]
    return out


def _model_forward(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    multi_modal_inputs: dict,
    logits_processor: Callable | None = None,
    logits_processor_args: dict | None = None,
    value_model: bool = False,
    data_format: str = "thd",
    mtp_config=None,
):
    from verl.models.mcore.forward import left_align

    if data_format not in ("thd", "bshd"):
        raise ValueError(f"data_format must be 'thd' or 'bshd', got {data_format!r}")
    if multi_modal_inputs:
        raise NotImplementedError(
            f"multi_modal_inputs {sorted(multi_modal_inputs)}: the megatron backend runs text-only models"
        )
    if mtp_config is not None and getattr(mtp_config, "enable_train", False):
        raise NotImplementedError("mtp_config.enable_train in model_forward: train MTP through verl's megatron actor")
    inner = _unwrap(model)
    config = inner.config
    if config.context_parallel_size > 1:
        raise NotImplementedError("model_forward with context_parallel_size > 1: use verl's megatron actor")
    multiple_of = config.tensor_model_parallel_size if config.sequence_parallel else 1
    seqlen = input_ids.shape[1]
    aligned = left_align(input_ids, attention_mask, position_ids, response_length=0, multiple_of=multiple_of)
    output = model(input_ids=aligned.input_ids, position_ids=aligned.position_ids, attention_mask=None)
    if not inner.post_process:
        return output  # hidden states for the next pipeline stage
    if logits_processor is not None:
        args = {k: _to_aligned(v, aligned) for k, v in (logits_processor_args or {}).items()}
        return {k: _to_padded(v, aligned, seqlen) for k, v in logits_processor(output, **args).items()}
    output = _to_padded(output, aligned, seqlen)
    return output[..., 0] if value_model else output


def get_mcore_forward_fn(hf_config) -> Callable:
    """Upstream's forward for `hf_config`'s architecture (one function serves every text model here;
    see the module docstring)."""
    architectures = getattr(hf_config, "architectures", None) or []
    if len(architectures) > 1:
        raise ValueError(f"only one architecture is supported, got {architectures}")
    return _model_forward


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_DIRECT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# megatron suffix within a layer -> HF suffixes (one per part); TransformerEngine's fused-norm names too
_LAYER_PARTS = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.layer_norm_weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.weight": [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ],
    "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
    "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.layer_norm_weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.shared_experts.gate_weight": ["mlp.shared_expert_gate.weight"],
    "mlp.shared_experts.linear_fc1.weight": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_expert.down_proj.weight"],
}
# one expert's weights: megatron's sequential experts (local_experts.<e>.linear_fc1.weight) and
# TransformerEngine's grouped ones (linear_fc1.weight<e>); <e> is the global expert id
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


class McoreToHFWeightConverter:
    """Full megatron parameters of a dense or MoE (Qwen3-MoE) GPT model -> HF names.
    `hf_config` and `mcore_config` (megatron's TransformerConfig) as upstream's converters carry."""

    def __init__(self, hf_config, mcore_config):
        self.hf_config = hf_config
        self.mcore_config = mcore_config

    def convert_param(self, name: str, params_one_group: list[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
        """(HF names, tensors) for megatron parameter `name` (layer numbers global) given as its parts:
        [q, k, v] for linear_qkv, [gate, up] for linear_fc1, else [tensor]."""
        if name in _DIRECT:
            return [_DIRECT[name]], [params_one_group[0]]
        match = _LAYER.match(name)
        if match is None:
            raise NotImplementedError(f"Unsupported parameter name: {name}")
        layer, suffix = match.groups()
        expert = _EXPERT.match(suffix)
        if expert is not None:
            expert_id = expert.group(1) or expert.group(4)
            fc = expert.group(2) or expert.group(3)
            parts = ["gate_proj.weight", "up_proj.weight"] if fc == "linear_fc1" else ["down_proj.weight"]
            hf_suffixes = [f"mlp.experts.{expert_id}.{p}" for p in parts]
        elif suffix in _LAYER_PARTS:
            hf_suffixes = _LAYER_PARTS[suffix]
        else:
            raise NotImplementedError(f"Unsupported parameter name: {name}")
        if len(params_one_group) != len(hf_suffixes):
            raise ValueError(
                f"{name} converts to {len(hf_suffixes)} HF tensors ({', '.join(hf_suffixes)}) but {len(params_one_group)} "
                "parts were given; split fused q/k/v and gate/up first (default_tp_concat_fn with "
                "convert_qkv_gate_up_by_simple_split=True)"
            )
        return [f"model.layers.{layer}.{s}" for s in hf_suffixes], list(params_one_group)


def get_mcore_weight_converter(hf_config, dtype: torch.dtype) -> McoreToHFWeightConverter:
    """The per-tensor megatron -> HF converter for `hf_config` (its megatron config built with
    parameter dtype `dtype`)."""
    from verl.models.mcore.config import hf_to_mcore_config

    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _DENSE + _MOE:
        raise NotImplementedError(
            f"get_mcore_weight_converter supports model_type in {list(_DENSE + _MOE)}, got {model_type!r}; stream a "
            "whole model's HF tensors with verl.models.mcore.mcore_to_hf_named_tensors instead"
        )
    return McoreToHFWeightConverter(hf_config, hf_to_mcore_config(hf_config, None, dtype))
