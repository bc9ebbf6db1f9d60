"""gpt-oss (`model_type: gpt_oss`, transformers' `GptOssForCausalLM`) on megatron-core's local layer spec.

Every piece of the family is a megatron-core 0.16 config field, used where it computes HF's function:
- Attention sinks (a learnable logit per head that joins each row's softmax and is then dropped):
  `softmax_type="learnable"`, the local `DotProductAttention`'s `softmax_offset` [heads], split by
  heads over the tensor-parallel ranks as the heads are.
- Alternating sliding-window and full attention (`layer_types`, `sliding_window`): `window_size`
  with `window_attn_skip_freq` as a per-layer list (1 = sliding). HF lets a query see the keys less
  than `sliding_window` positions back; megatron's window (left, 0) lets it see `left` positions
  back, so left = sliding_window - 1. The local attention then builds the causal window mask
  itself (our forward left-aligns rows, so padding trails every real token and needs no mask).
- The clamped SwiGLU of the experts, `(up + 1) * gate * sigmoid(alpha * gate)` with
  `gate <= limit` and `|up| <= limit`: `activation_func=quick_gelu` (x * sigmoid(1.702 x)),
  `glu_linear_offset=1` and `activation_func_clamp_value=limit`. HF's `alpha` is a config field
  (`swiglu_alpha`); megatron's quick_gelu hard-codes 1.702, so another alpha is refused.
- Biases on q/k/v, o_proj, the router and both expert projections: `add_bias_linear=True` (one
  switch for every linear layer, which is exactly gpt-oss's set: it has no dense MLP).
- Routing: top-k of the router's logits, then a softmax over the chosen ones
  (`moe_router_pre_softmax=False`).
- YaRN RoPE: megatron's `YarnRotaryEmbedding` (GPTModel's `position_embedding_type="yarn"`), whose
  frequencies, correction range (`truncate` = `yarn_correction_range_round_to_int`) and cos/sin
  scale are HF's formulas; the fields are set on the TransformerConfig as GPTModel reads them.

Around megatron-core 0.16.1: the sinks are a plain parameter there, marked tensor-parallel here
(`mark_sinks_tensor_parallel`) so the gradient norm counts every rank's heads; the experts' fc2 output
is copied before megatron adds the routed bias share in place, and at expert_tensor_parallel_size > 1
each expert-tensor rank adds 1/etp of fc2's bias, which megatron-core would add once per rank (its
config refuses biased experts at etp > 1; `expert_fc2_class`); and an expert's
bias, which megatron marks sequence-parallel, is reduced with the other expert gradients only
(`verl.workers.actor.megatron_actor.finalize_megatron_grads`).

Refused, naming the field: `attention_bias=false` (megatron's one bias
switch would drop the experts' biases too), another `swiglu_alpha`, rope types other than yarn and
default, an explicit YaRN `attention_factor`, context parallelism (megatron-core's local
`DotProductAttention`, which holds the sinks and the windows, asserts context_parallel_size == 1, and
`context_parallel.ContextParallelAttention` has neither).

The router load-balancing loss (`output_router_logits`) is the shared one
(`verl.models.mcore.moe.MegatronRouterAuxLoss`), unchanged: gpt-oss routes with a softmax over
the top-k logits only, but transformers' gpt-oss aux loss (`load_balancing_loss_func` on the
router's first output) is Switch Transformer's over the softmax of all E biased logits, which is
what megatron's `gating` returns (weight and bias) and what the FSDP actor records.
"""

from __future__ import annotations

import torch

__all__ = [
    "QUICK_GELU_ALPHA",
    "experts_to_hf",
    "expert_fc2_class",
    "experts_to_mcore",
    "gpt_oss_config_fields",
    "mark_sinks_tensor_parallel",
    "set_yarn_fields",
    "yarn_parameters",
]

QUICK_GELU_ALPHA = 1.702  # megatron.core.activations.quick_gelu's constant


def yarn_parameters(hf_config) -> dict | None:
    """HF's rope parameters when they are YaRN (None for plain RoPE); other scalings are refused."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise NotImplementedError(
            f"gpt_oss config has rope_type={rope_type!r}; the megatron backend builds gpt-oss with yarn or plain "
            "RoPE only; use actor.strategy=fsdp for this model"
        )
    if params.get("attention_factor") is not None:
        raise NotImplementedError(
            f"gpt_oss config has rope_parameters.attention_factor={params['attention_factor']}: megatron's YaRN "
            "derives the cos/sin scale from factor (and mscale); remove it or use actor.strategy=fsdp"
        )
    return params


def gpt_oss_config_fields(hf_config, megatron_cfg_get) -> dict:
    """The TransformerConfig fields of a gpt-oss config beyond the shared ones (see the module
    docstring); `megatron_cfg_get(key, default)` reads the `actor.megatron` section."""
    from megatron.core.activations import quick_gelu

    if not bool(getattr(hf_config, "attention_bias", True)):
        raise NotImplementedError(
            "gpt_oss config has attention_bias=false: megatron's add_bias_linear biases attention and experts "
            "together, and gpt-oss's experts always have biases; use actor.strategy=fsdp for this model"
        )
    alpha = float(getattr(hf_config, "swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise NotImplementedError(
            f"gpt_oss config has swiglu_alpha={alpha}: megatron's quick_gelu computes x * sigmoid(1.702 x) only; "
            "use actor.strategy=fsdp for this model"
        )
    if int(megatron_cfg_get("context_parallel_size", 1)) > 1:
        raise NotImplementedError(
            "actor.megatron.context_parallel_size > 1 on gpt_oss: megatron-core's local DotProductAttention, the "
            "one that implements attention sinks (softmax_offset) and sliding windows, asserts "
            "context_parallel_size == 1 (only TransformerEngine's attention splits sequences), and this backend's "
            "context-parallel attention has neither; set context_parallel_size=1 (or actor.strategy=fsdp)"
        )
    layers = hf_config.num_hidden_layers
    layer_types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * layers)
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != layers:
        raise NotImplementedError(
            f"gpt_oss config has layer_types={layer_types}: expected one of sliding_attention / full_attention per "
            f"layer ({layers} layers)"
        )
    fields = {
        "add_bias_linear": True,
        "add_qkv_bias": False,
        "softmax_type": "learnable",
        "activation_func": quick_gelu,
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(hf_config.swiglu_limit),
        "qk_layernorm": False,
        "moe_router_pre_softmax": False,  # top-k of the logits, then the softmax over those
    }
    if "sliding_attention" in layer_types:
        window = getattr(hf_config, "sliding_window", None)
        if not window or int(window) < 1:
            raise NotImplementedError(f"gpt_oss config has sliding layers but sliding_window={window!r}")
        fields["window_size"] = (int(window) - 1, 0)
        fields["window_attn_skip_freq"] = [int(t == "sliding_attention") for t in layer_types]
    return fields


def set_yarn_fields(tf_config, hf_config) -> None:
    """The YaRN fields GPTModel and the attention read (`getattr` on the TransformerConfig) from HF's
    rope parameters; nothing for plain RoPE."""
    params = yarn_parameters(hf_config)
    if params is None:
        return
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = hf_config.max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # HF then scales by 0.1 ln(factor) + 1, as megatron does for None
        mscale = mscale_all_dim = None
    tf_config.yarn_rotary_scaling_factor = float(factor)
    tf_config.yarn_original_max_position_embeddings = int(original)
    tf_config.yarn_beta_fast = float(params.get("beta_fast") or 32)
    tf_config.yarn_beta_slow = float(params.get("beta_slow") or 1)
    tf_config.yarn_mscale = mscale
    tf_config.yarn_mscale_all_dim = mscale_all_dim
    tf_config.yarn_correction_range_round_to_int = bool(params.get("truncate", True))


def experts_to_mcore(hf, src: str, dst: str, tf_config, ep_rank: int, etp_rank: int) -> dict:
    """One gpt-oss MoE layer for this (ep_rank, etp_rank): the router's weight and bias (replicated)
    and the local experts, each a megatron MLP with biases.

    HF keeps `experts.gate_up_proj` as [E, H, 2I] with gate and up interleaved along the last
    dimension (gate in the even columns, up in the odd ones), its bias [E, 2I] likewise, and
    `experts.down_proj` [E, I, H] (inputs first). Megatron's fc1 is [gate shard; up shard] rows
    ([2I/etp, H]) and fc2 [H, I/etp]; fc2's bias is whole on every expert-tensor rank (it is added
    once, after the reduction).
    """
    experts, ep, etp = (
        tf_config.num_moe_experts,
        tf_config.expert_model_parallel_size,
        tf_config.expert_tensor_parallel_size,
    )
    local = experts // ep
    gate_up, gate_up_bias = hf(src + "experts.gate_up_proj"), hf(src + "experts.gate_up_proj_bias")
    down, down_bias = hf(src + "experts.down_proj"), hf(src + "experts.down_proj_bias")
    out = {
        dst + "router.weight": hf(src + "router.weight").clone(),
        dst + "router.bias": hf(src + "router.bias").clone(),
    }
    for j in range(local):
        e = ep_rank * local + j
        name = f"{dst}experts.local_experts.{j}."
        gate, up = gate_up[e][:, 0::2].t(), gate_up[e][:, 1::2].t()  # [I, H] each
        gate_b, up_b = gate_up_bias[e][0::2], gate_up_bias[e][1::2]
        out[name + "linear_fc1.weight"] = torch.cat([gate.chunk(etp)[etp_rank], up.chunk(etp)[etp_rank]]).clone()
        out[name + "linear_fc1.bias"] = torch.cat([gate_b.chunk(etp)[etp_rank], up_b.chunk(etp)[etp_rank]]).clone()
        out[name + "linear_fc2.weight"] = down[e].t().chunk(etp, dim=1)[etp_rank].clone()
        out[name + "linear_fc2.bias"] = down_bias[e].clone()
    return out


def experts_to_hf(dst: str, local_param, emit, owner: int, hf_config, tf_config, ep_gather, etp_gather):
    """The inverse of `experts_to_mcore`: (HF name, full tensor) for one layer's router and experts,
    gathered over the expert-tensor and expert-parallel groups, sent along the pipeline by `emit`."""
    experts, ep = tf_config.num_moe_experts, tf_config.expert_model_parallel_size
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    yield emit(f"{dst}mlp.router.weight", lambda: local_param("mlp.router.weight").clone(), owner, (experts, hidden))
    yield emit(f"{dst}mlp.router.bias", lambda: local_param("mlp.router.bias").clone(), owner, (experts,))

    def local_experts(suffix: str) -> list[torch.Tensor]:
        return [local_param(f"mlp.experts.local_experts.{j}.{suffix}") for j in range(experts // ep)]

    def interleaved(fc1: torch.Tensor) -> torch.Tensor:
        """fc1 shards [2I/etp, ...] -> HF's [..., 2I] with gate and up alternating (weights transposed)."""
        parts = [p.chunk(2) for p in etp_gather(fc1, 0)]
        gate, up = torch.cat([g for g, _ in parts]), torch.cat([u for _, u in parts])
        if gate.dim() == 2:
            gate, up = gate.t(), up.t()
        return torch.stack([gate, up], dim=-1).flatten(-2)

    def gate_up():
        return ep_gather(torch.stack([interleaved(fc1) for fc1 in local_experts("linear_fc1.weight")]))

    def gate_up_bias():
        return ep_gather(torch.stack([interleaved(b) for b in local_experts("linear_fc1.bias")]))

    def down():
        return ep_gather(
            torch.stack([torch.cat(etp_gather(fc2, 1), dim=1).t() for fc2 in local_experts("linear_fc2.weight")])
        )

    def down_bias():
        return ep_gather(torch.stack([b.clone() for b in local_experts("linear_fc2.bias")]))

    yield emit(f"{dst}mlp.experts.gate_up_proj", gate_up, owner, (experts, hidden, 2 * inter))
    yield emit(f"{dst}mlp.experts.gate_up_proj_bias", gate_up_bias, owner, (experts, 2 * inter))
    yield emit(f"{dst}mlp.experts.down_proj", down, owner, (experts, inter, hidden))
    yield emit(f"{dst}mlp.experts.down_proj_bias", down_bias, owner, (experts, hidden))


_EXPERT_FC2 = None


class _ShareOfBias(torch.autograd.Function):
    """`bias / parts` forward, the whole gradient backward (see `expert_fc2_class`)."""

    @staticmethod
    def forward(ctx, bias, parts):
        return bias / parts

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def expert_fc2_class():
    """megatron's `RowParallelLinear` for the experts' second projection, returning a fresh tensor
    and, at expert_tensor_parallel_size > 1, a 1/etp share of its bias.

    With biased experts, megatron-core 0.16's expert MLP adds the routed share of fc2's bias to fc2's
    output in place; with whole experts (expert_tensor_parallel_size=1) that output is the input the
    reduction returned as-is, which autograd refuses to modify in place while training. A copy of it
    (the size of the expert's output, [tokens, hidden]) makes the in-place add legal and changes no value.

    At etp > 1 each expert-tensor rank's fc2 output is a partial sum that the token dispatcher
    reduce-scatters over the expert-tensor ranks, so a whole bias added on every rank would count etp
    times (why megatron-core refuses biased experts there). Each rank adds bias / etp instead, which
    the reduction sums to the bias once (exact for a power of two). The bias is replicated on the
    expert-tensor ranks and the combine's backward hands each of them the same output gradient, so
    each copy's gradient is the whole one (`_ShareOfBias`: identity backward) and the copies stay
    equal with no reduction; the router probabilities' share of the term is summed back by the
    dispatcher's gather.
    """
    global _EXPERT_FC2
    if _EXPERT_FC2 is None:
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import RowParallelLinear

        class ExpertRowParallelLinear(RowParallelLinear):
            def forward(self, *args, **kwargs):
                output, bias = super().forward(*args, **kwargs)
                etp = mpu.get_expert_tensor_parallel_world_size()
                if bias is not None and etp > 1:
                    bias = _ShareOfBias.apply(bias, etp)
                return (output.clone() if torch.is_grad_enabled() else output), bias

        _EXPERT_FC2 = ExpertRowParallelLinear
    return _EXPERT_FC2


def mark_sinks_tensor_parallel(model) -> None:
    """Mark each attention's sinks (`softmax_offset`, one per head, split by heads) as a tensor-parallel
    shard, as megatron marks its split weights: megatron-core creates them as a plain parameter, so the
    gradient norm would otherwise count only one rank's heads."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for module in model.modules():
        offset = getattr(module, "softmax_offset", None)
        if isinstance(offset, torch.nn.Parameter):
            set_tensor_model_parallel_attributes(offset, True, 0, 1)
