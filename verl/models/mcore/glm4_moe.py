"""GLM-4.5 / GLM-4.5-Air (`model_type: glm4_moe`, transformers' `Glm4MoeForCausalLM`) on
megatron-core's local layer spec.

The family is two known pieces put together, so it adds only a translation of config fields:
- Attention is the standard grouped-query attention of the Qwen2/Qwen3 path
  (`verl.models.mcore.config`, `weights`): `attention_bias` biases q/k/v only (megatron's
  `add_qkv_bias`; o_proj never has one), `use_qk_norm` is Qwen3's per-head q/k RMSNorm before the
  rotary embedding (`qk_layernorm`), and `partial_rotary_factor` rotates the first
  `head_dim * factor` dimensions of each head in HF's halves layout (`rotate_half`), which is
  megatron's `rotary_percent` with `rotary_interleaved=False`: the same dimensions, frequencies and
  pairing, so the q/k weights go over unchanged.
- The MLPs are DeepSeek-V3's (`verl.models.mcore.deepseek.deepseek_moe_fields`): the first
  `first_k_dense_replace` layers dense, then MoE layers of `n_routed_experts` experts routed by
  sigmoid scores plus the fixed `e_score_correction_bias`, `n_group`/`topk_group` group limiting,
  renormalised chosen scores times `routed_scaling_factor`, and `n_shared_experts` shared experts.
  HF's names of those weights are DeepSeek-V3's, so the weight conversion is the same code.
- The multi-token-prediction layer of the released checkpoints (`num_nextn_predict_layers`, stored
  as layer `num_hidden_layers`) is ignored, as transformers' model ignores it; building it
  (`model.mtp.enable=true`) is refused by the engine.
- Refused, naming the field: a rotary dimension that is not a whole even number of head dimensions
  (`partial_rotary_factor`), `n_shared_experts=0`, and what DeepSeek-V3's routing refuses
  (`norm_topk_prob=false`, group scoring megatron cannot match, the load-balancing loss).
"""

from __future__ import annotations

__all__ = ["glm4_moe_config_fields", "partial_rotary_factor"]


def partial_rotary_factor(hf_config) -> float:
    """HF's fraction of each head that RoPE rotates (transformers 5 keeps it in `rope_parameters`)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


def glm4_moe_config_fields(hf_config, head_dim: int) -> dict:
    """The attention fields of a GLM-4.5 config (its MoE fields are `config._moe_fields`, the same
    routing as DeepSeek-V3); refuses what megatron cannot build exactly."""
    factor = partial_rotary_factor(hf_config)
    rotary_dim = head_dim * factor
    if not 0.0 < factor <= 1.0 or rotary_dim != int(rotary_dim) or int(rotary_dim) % 2:
        raise NotImplementedError(
            f"glm4_moe config has partial_rotary_factor={factor} with head_dim={head_dim}: the rotated part "
            f"({rotary_dim:g} dimensions) must be a whole, even number of dimensions for megatron's rotary_percent "
            "to rotate exactly HF's; use actor.strategy=fsdp for this model"
        )
    if not int(getattr(hf_config, "n_shared_experts", 0) or 0):
        raise NotImplementedError(
            "glm4_moe config has n_shared_experts=0: transformers still builds an (empty) shared-expert MLP whose "
            "weights the megatron backend would not carry back; use actor.strategy=fsdp for this model"
        )
    return {"qk_layernorm": bool(getattr(hf_config, "use_qk_norm", False))}
