"""DeepSeek-V3 (`model_type: deepseek_v3`, also Moonlight) on megatron-core's local layer spec.

What the family adds to the Qwen3-MoE path (`verl.models.mcore.config`, `weights`):
- Multi-head latent attention (MLA): megatron's `MLASelfAttention` with `MLATransformerConfig`.
  Two things in megatron-core 0.16.1 stop it from running without TransformerEngine, worked
  around here: its constructor takes TransformerEngine's mock module (megatron imports one when
  TE is absent) for the real thing and fails on `isinstance(..., TELinear)`
  (`CpuMLASelfAttention` corrects the flag while it is built), and the local spec's
  `DotProductAttention` rejects MLA's `k_channels`/`v_channels` (query/key and value head sizes
  differ), so the core attention is our SDPA one (`ContextParallelAttention`, which at
  context_parallel_size=1 is a plain causal attention). Its rotary embedding allocates on
  `torch.cuda.current_device()`, which the CPU shim (`verl.utils.megatron.cpu_compat`) answers.
- The latent down-projections (`linear_q_down_proj`, `linear_kv_down_proj`) are replicated
  linear layers, as TransformerEngine's spec makes them ("duplicated"): the local spec's
  column-parallel form gathers the output along the feature dimension, whose backward keeps
  only this rank's columns, so the shared rotary key (`k_pe`, used by every rank's heads) would
  get only the gradient of the heads of the rank that holds its columns. Replicated, under
  sequence parallelism each rank projects its slice of the sequence and the rotary key is
  all-gathered (its backward sums over the tensor ranks); the weights' gradients, partial per
  slice, are summed over the tensor group like a sequence-parallel norm's.
- Rotary dimensions: megatron's MLA takes them as interleaved pairs and de-interleaves them before
  its `rotate_half` RoPE, exactly as HF does with `rope_interleave=true` (DeepSeek's checkpoints),
  so those weights go over unchanged. With `rope_interleave=false` (HF's halves layout) the
  conversion interleaves the rotary rows of `q_b_proj` (or `q_proj`) and `kv_a_proj_with_mqa`, and
  de-interleaves them on the way back: a permutation, exact both ways.
- Mixed layers: the first `first_k_dense_replace` layers are dense MLPs (`intermediate_size`),
  the rest MoE (`moe_layer_freq`), each with `n_shared_experts` shared experts
  (`moe_shared_expert_intermediate_size`, tensor-parallel like a dense MLP).
- Routing is HF's `DeepseekV3TopkRouter`: sigmoid scores, experts chosen on score + the
  `e_score_correction_bias`, limited to `topk_group` of `n_group` groups (a group scored by its
  top-2 experts: megatron's `topk // group_topk`, so it is refused unless that is 2), the chosen
  scores renormalised (megatron always does, so `norm_topk_prob=false` is refused) and scaled by
  `routed_scaling_factor`. The bias is a fixed buffer (`mlp.router.expert_bias`), never updated
  online, as on the FSDP actor: megatron's own bias buffer would be created on CUDA and updated
  from token counts, so it is attached after the router is built (`attach_expert_bias`).
- Not done, refused: multi-token prediction layers (`num_nextn_predict_layers > 0`; a value model
  never builds them, so the megatron engine builds a critic without them), rope scaling
  (DeepSeek-V3's released yarn config; `rope_theta_of`), attention biases, the router
  load-balancing loss (DeepSeek-V3 is aux-loss-free; its sigmoid router has no softmax
  probabilities for HF's loss).
- Context parallelism needs nothing of its own: megatron's MLA slices its rotary table to this
  rank's chunks (`get_pos_emb_on_this_cp_rank`, the layout `ContextParallelAttention` assumes), and
  that core attention gathers the per-head keys and values (query/key and value head sizes
  differ) over the context group.
"""

from __future__ import annotations

import torch
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

__all__ = [
    "CpuMLASelfAttention",
    "attach_expert_bias",
    "deepseek_attention_to_hf",
    "deepseek_attention_to_mcore",
    "deepseek_config_fields",
    "deepseek_moe_fields",
    "is_moe_layer",
    "use_local_mla",
]

_MTP = "num_nextn_predict_layers"


def deepseek_config_fields(hf_config) -> dict:
    """The MLA fields of `MLATransformerConfig` for a DeepSeek-V3 config (its MoE fields are
    `config._moe_fields`); refuses what the backend does not build."""
    if int(getattr(hf_config, _MTP, 0) or 0) > 0:
        raise NotImplementedError(
            f"deepseek_v3 config has {_MTP}={getattr(hf_config, _MTP)} (multi-token prediction layers), which the "
            f"megatron backend does not build yet; set {_MTP}=0 in actor_rollout_ref.model.override_config "
            "(the MTP weights are then not trained) or use actor.strategy=fsdp"
        )
    return {
        "multi_latent_attention": True,
        "q_lora_rank": getattr(hf_config, "q_lora_rank", None),
        "kv_lora_rank": hf_config.kv_lora_rank,
        "qk_head_dim": hf_config.qk_nope_head_dim,
        "qk_pos_emb_head_dim": hf_config.qk_rope_head_dim,
        "v_head_dim": hf_config.v_head_dim,
        "rope_type": "rope",
        "rotary_scaling_factor": 1.0,  # no yarn: softmax scale 1/sqrt(qk_head_dim + rope), as HF's
        "qk_layernorm": True,  # q_a_layernorm / kv_a_layernorm
    }


def deepseek_moe_fields(hf_config) -> dict:
    """DeepSeek-V3's routing and layer pattern as megatron MoE fields (see the module docstring);
    GLM-4.5 (`glm4_moe`) routes and stacks its layers the same way."""
    family = hf_config.model_type
    if not getattr(hf_config, "norm_topk_prob", True):
        raise NotImplementedError(
            f"{family} config has norm_topk_prob=false; megatron's sigmoid router always renormalises the "
            "chosen scores, so the megatron backend would train a different model; use actor.strategy=fsdp"
        )
    if bool(getattr(hf_config, "output_router_logits", False)):
        raise NotImplementedError(
            f"actor_rollout_ref.model.override_config.output_router_logits=true on {family}: the load-balancing "
            f"loss is a softmax-router loss and {family} routes by sigmoid scores with a correction bias "
            "(aux-loss-free); leave output_router_logits=false"
        )
    groups, topk_group = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
    topk = hf_config.num_experts_per_tok
    if groups > 1 and topk // topk_group != 2:
        raise NotImplementedError(
            f"{family} config with n_group={groups}: HF scores a group by its top-2 experts, megatron by its "
            f"top num_experts_per_tok // topk_group = {topk} // {topk_group}; they agree only when that is 2"
        )
    dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    layers = hf_config.num_hidden_layers
    if getattr(hf_config, "moe_layer_freq", 1) not in (None, 1):
        raise NotImplementedError(f"{family} config with moe_layer_freq != 1 is not built by the megatron backend")
    return {
        "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        "moe_shared_expert_intermediate_size": (
            hf_config.moe_intermediate_size * hf_config.n_shared_experts if hf_config.n_shared_experts else None
        ),
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": topk_group if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(hf_config.routed_scaling_factor),
    }


def is_moe_layer(tf_config, layer: int) -> bool:
    """Whether global layer `layer` (0-based) has routed experts."""
    if not tf_config.num_moe_experts:
        return False
    freq = tf_config.moe_layer_freq
    return bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0


def use_local_mla(attention, norm) -> None:
    """Make the local spec's MLA self-attention spec (`attention`) run here: our subclass, `norm`
    (the backend's RMSNorm) for the latent norms, replicated down-projections, our core attention."""
    from verl.models.mcore.context_parallel import ContextParallelAttention

    attention.module = CpuMLASelfAttention
    attention.submodules.linear_q_down_proj = attention.submodules.linear_kv_down_proj = ReplicatedLinear
    attention.submodules.q_layernorm = attention.submodules.kv_layernorm = norm
    attention.submodules.core_attention = ContextParallelAttention


class CpuMLASelfAttention(MLASelfAttention):
    """megatron's MLA self-attention, buildable without TransformerEngine (see the module
    docstring); it also takes the replicated down-projections (`use_local_mla`)."""

    def __init__(self, config, *args, **kwargs):
        from megatron.core.transformer import multi_latent_attention as mla

        have_te, linear = mla.HAVE_TE, mla.Linear
        # without TransformerEngine megatron's TE extension imports as mocks, so the module believes
        # TE is there and `isinstance(..., TELinear)` fails on the mock
        mla.HAVE_TE = have_te and isinstance(mla.TELinear, type)
        mla.Linear = ReplicatedLinear  # the one replicated linear the constructor accepts
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            mla.HAVE_TE, mla.Linear = have_te, linear


def attach_expert_bias(model) -> None:
    """Give every sigmoid router with a group or bias a fixed `expert_bias` buffer (zeros until
    loaded), which megatron's routing adds to the scores when choosing experts."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        sigmoid = isinstance(module, TopKRouter) and module.config.moe_router_score_function == "sigmoid"
        if sigmoid and getattr(module, "expert_bias", None) is None:
            del module.expert_bias  # a plain None attribute
            module.register_buffer("expert_bias", torch.zeros(module.config.num_moe_experts, dtype=torch.float32))


def _rope_order(rope_dim: int) -> torch.Tensor:
    """Row order taking interleaved pairs to [even; odd] (megatron's MLA layout -> HF's halves)."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _reorder_rope_rows(weight: torch.Tensor, block: int, rope_dim: int, inverse: bool) -> torch.Tensor:
    """Reorder the last `rope_dim` rows of every `block`-row block of `weight`."""
    order = _rope_order(rope_dim)
    if inverse:
        order = torch.argsort(order)
    blocks = weight.reshape(-1, block, *weight.shape[1:])
    rope = blocks[:, block - rope_dim :][:, order]
    return torch.cat([blocks[:, : block - rope_dim], rope], dim=1).reshape(weight.shape)


def _rope_layout(hf_config, weight: torch.Tensor, block: int, to_hf: bool = False) -> torch.Tensor:
    """HF rows -> megatron's (or back with `to_hf`): only a halves-layout checkpoint is reordered."""
    if getattr(hf_config, "rope_interleave", True):
        return weight
    return _reorder_rope_rows(weight, block, hf_config.qk_rope_head_dim, inverse=not to_hf)


_LATENT_NORMS = {"q_layernorm.weight": "q_a_layernorm.weight", "kv_layernorm.weight": "kv_a_layernorm.weight"}


def deepseek_attention_to_mcore(hf, src: str, dst: str, hf_config, shard) -> dict[str, torch.Tensor]:
    """One layer's MLA weights for this tensor rank (`shard(tensor, dim)` cuts its chunk): the
    up-projections split by output rows (whole heads), `linear_proj` by columns, the latent
    down-projections and norms replicated."""
    q_head = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    kv_rows = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
    out = {}
    if hf_config.q_lora_rank is None:
        out[dst + "linear_q_proj.weight"] = shard(_rope_layout(hf_config, hf(src + "q_proj.weight"), q_head))
    else:
        out[dst + "linear_q_down_proj.weight"] = hf(src + "q_a_proj.weight").clone()
        out[dst + "linear_q_up_proj.weight"] = shard(_rope_layout(hf_config, hf(src + "q_b_proj.weight"), q_head))
    kv_down = _rope_layout(hf_config, hf(src + "kv_a_proj_with_mqa.weight"), kv_rows)
    out[dst + "linear_kv_down_proj.weight"] = kv_down.clone()
    out[dst + "linear_kv_up_proj.weight"] = shard(hf(src + "kv_b_proj.weight"))
    out[dst + "linear_proj.weight"] = shard(hf(src + "o_proj.weight"), 1)
    for mcore_name, hf_name in _LATENT_NORMS.items():
        if hf_config.q_lora_rank is None and mcore_name.startswith("q_"):
            continue
        out[dst + mcore_name] = hf(src + hf_name).clone()
    return out


def deepseek_attention_to_hf(dst: str, local_param, emit, owner: int, hf_config, tp_gather):
    """One layer's MLA weights as HF names them (the inverse of `deepseek_attention_to_mcore`)."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    q_head = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    kv_rows = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
    q_lora = hf_config.q_lora_rank

    def rows(mcore_name):
        if "down_proj" in mcore_name:  # replicated
            return lambda: local_param("self_attention." + mcore_name).clone()
        return lambda: torch.cat(tp_gather(local_param("self_attention." + mcore_name), 0))

    def rope_rows(mcore_name, block):
        return lambda: _rope_layout(hf_config, rows(mcore_name)(), block, to_hf=True)

    attn = f"{dst}self_attn."
    if q_lora is None:
        yield emit(attn + "q_proj.weight", rope_rows("linear_q_proj.weight", q_head), owner, (heads * q_head, hidden))
    else:
        yield emit(attn + "q_a_proj.weight", rows("linear_q_down_proj.weight"), owner, (q_lora, hidden))
        yield emit(
            attn + "q_a_layernorm.weight",
            lambda: local_param("self_attention.q_layernorm.weight").clone(),
            owner,
            (q_lora,),
        )
        yield emit(
            attn + "q_b_proj.weight", rope_rows("linear_q_up_proj.weight", q_head), owner, (heads * q_head, q_lora)
        )
    yield emit(
        attn + "kv_a_proj_with_mqa.weight", rope_rows("linear_kv_down_proj.weight", kv_rows), owner, (kv_rows, hidden)
    )
    yield emit(
        attn + "kv_a_layernorm.weight",
        lambda: local_param("self_attention.kv_layernorm.weight").clone(),
        owner,
        (hf_config.kv_lora_rank,),
    )
    kv_up = (heads * (hf_config.qk_nope_head_dim + hf_config.v_head_dim), hf_config.kv_lora_rank)
    yield emit(attn + "kv_b_proj.weight", rows("linear_kv_up_proj.weight"), owner, kv_up)
    yield emit(
        attn + "o_proj.weight",
        lambda: torch.cat(tp_gather(local_param("self_attention.linear_proj.weight"), 1), dim=1),
        owner,
        (hidden, heads * hf_config.v_head_dim),
    )
