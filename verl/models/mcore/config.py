"""HF config -> megatron-core TransformerConfig, and the GPTModel built from it (Qwen2, Llama, Qwen3-MoE,
DeepSeek-V3, GLM-4.5, gpt-oss).

Design decisions:
- One translation for both families: they differ only in the q/k/v bias (Qwen2 always has it,
  Llama has it when `attention_bias`, which then also puts a bias on o_proj: not supported).
  Anything the translation cannot represent exactly (rope scaling, sliding windows, an MLP bias,
  dense layers between MoE layers) is an error that names the HF field rather than a silently
  different model.
- Qwen3-MoE: megatron's MoE layer in the local spec, experts as a `SequentialMLP` (the grouped
  GEMM needs TransformerEngine or the grouped_gemm package), HF's routing (`_moe_fields`), and
  Qwen3's per-head q/k norms as `qk_layernorm` (`HeadRMSNorm`). Expert parallelism
  (`expert_model_parallel_size`) splits whole experts over ranks and `expert_tensor_parallel_size`
  each expert's MLP; the training side is `verl.models.mcore.moe`.
- DeepSeek-V3: `MLATransformerConfig` and the layer spec per layer (dense first layers, then MoE
  layers with shared experts); what the family adds is in `verl.models.mcore.deepseek`.
- GLM-4.5 (`glm4_moe`): standard grouped-query attention (q/k/v bias, partial rotary, optional
  per-head q/k norms) with DeepSeek-V3's routing and layer pattern; see `verl.models.mcore.glm4_moe`.
- gpt-oss (`gpt_oss`): attention sinks, alternating sliding-window / full layers, YaRN, biases on
  every linear layer and the clamped SwiGLU, each a megatron config field; see
  `verl.models.mcore.gpt_oss` (rope scaling and sliding windows stay refused for the other families).
- The "local" layer spec (megatron's own modules) is used, with our `RMSNorm` (torch's, able to
  run sequence-parallel) for every norm: it runs without TransformerEngine or apex, so CPU and
  GPU build the same modules. With
  `context_parallel_size > 1` its core attention is `context_parallel.ContextParallelAttention`
  (megatron's local attention has no context parallelism). All fusions are off
  (they need those kernels), dropout is 0 as in HF's inference.
- The vocabulary is padded to a multiple of the tensor-parallel size (megatron shards the
  embedding and LM head by rows); padded rows are zero and the log-prob code masks their logits,
  so padding never changes a probability (`padded_vocab_size`).
- `calculate_per_token_loss=True` so megatron's schedules never rescale our losses: the actor
  already weights micro-batches itself (see `verl.workers.dp_training`), and
  `variable_seq_lengths=True` because micro-batches are trimmed to their longest row.
- With a virtual pipeline (vpp > 1) the interleaved schedule's p2p is per direction, not batched
  (`overlap_p2p_comm`): the batched form deadlocks on gloo during training.
- A value model (critic) is the same GPTModel whose LM head has one output, replicated on the
  tensor-parallel ranks (`build_gpt_model(..., value_head=True)`).
- Mixed precision (`megatron.dtype` bf16, the GPU default): the parameters stay float32 and the
  forward runs under `torch.autocast` in bf16 (`megatron_dtypes`, `compute_autocast`). The
  optimizer is a plain torch AdamW over the model's own parameters (see
  `verl.workers.actor.megatron_actor`), so bf16 parameters would also be its master weights: an
  update below bf16's 2^-8 relative spacing (lr 1e-6 on weights near 1e-2) rounds back to the old
  value and the weights never move. fp32 parameters give fp32 master weights, gradients
  accumulated and all-reduced in fp32 and fp32 Adam moments, as FSDP2's mixed-precision policy
  does for the FSDP backend and megatron's own optimizer does with its fp32 main parameters,
  while matmuls and attention run in bf16 (megatron's own "AMP O1": its residual add casts the
  residual stream to bf16, so the stages exchange bf16 activations, `pipeline_dtype`; softmax and
  norms accumulate in fp32). Frozen models (reference, reward) follow the same rule, so the
  reference computes exactly as the actor does at step 0.
"""

from __future__ import annotations

import contextlib

import torch

from verl.models.mcore.mtp import build_mtp_block_spec, install_postprocess
from verl.utils.device import default_compute_dtype, get_device_name

__all__ = [
    "RMSNorm",
    "build_gpt_model",
    "build_model_chunks",
    "compute_autocast",
    "hf_to_mcore_config",
    "megatron_dtypes",
    "padded_vocab_size",
    "pipeline_split",
    "rope_theta_of",
    "rotary_percent_of",
    "set_compute_dtype",
]

_SUPPORTED = ("qwen2", "llama", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
_MOE_TYPES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
# families routed as DeepSeek-V3 is (sigmoid scores, correction bias, shared experts, dense first layers)
_SIGMOID_TYPES = ("deepseek_v3", "glm4_moe")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
# where a model's chunks keep the dtype their forward autocasts to (None: no autocast)
_COMPUTE_DTYPE_ATTR = "_verl_compute_dtype"


def megatron_dtypes(name: str, for_training: bool) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None) for `megatron.dtype=name` (see the module docstring).

    `auto` is bf16 on CUDA and fp32 on CPU. A 16-bit dtype keeps fp32 parameters and autocasts the
    forward to it. fp16 is refused for a trained model: without loss scaling, which this backend does
    not implement, small gradients underflow to zero.
    """
    key = str(name).lower()
    if key == "auto":
        compute = default_compute_dtype()
    elif key in _DTYPES:
        compute = _DTYPES[key]
    else:
        raise ValueError(f"megatron.dtype={name!r} is not one of {['auto', *_DTYPES]}")
    if compute == torch.float32:
        return torch.float32, None
    if compute == torch.float16 and for_training:
        raise ValueError(
            "megatron.dtype=fp16 for a trained model: fp16 training needs loss scaling, which the megatron "
            "backend does not implement, so small gradients would underflow to zero; use bf16 (or fp32)"
        )
    return torch.float32, compute


def set_compute_dtype(model_chunks, dtype: torch.dtype | None) -> None:
    """Make `compute_autocast` run these chunks' forward in `dtype` (None: in their parameter dtype)."""
    for chunk in model_chunks:
        object.__setattr__(chunk, _COMPUTE_DTYPE_ATTR, dtype)


def compute_autocast(chunk):
    """The context a forward of `chunk` runs in: autocast to its compute dtype (`set_compute_dtype`),
    or nothing."""
    dtype = getattr(chunk, _COMPUTE_DTYPE_ATTR, None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=get_device_name(), dtype=dtype)


def _get(cfg, key, default=None):
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def rope_theta_of(hf_config) -> float:
    """RoPE base of an HF config (transformers 5 keeps it in `rope_parameters`); errors on rope scaling
    (except gpt-oss's YaRN, `verl.models.mcore.gpt_oss`)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if hf_config.model_type == "gpt_oss":
        from verl.models.mcore.gpt_oss import yarn_parameters

        yarn_parameters(hf_config)  # validates the scaling
    elif rope_type != "default":
        raise NotImplementedError(
            f"{hf_config.model_type} config has rope_type={rope_type!r}; the megatron backend implements plain RoPE "
            "only. Use actor.strategy=fsdp for this model"
        )
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def rotary_percent_of(hf_config) -> float:
    """The fraction of each head's dimensions that RoPE rotates: GLM-4.5's `partial_rotary_factor`
    (transformers 5 keeps it in `rope_parameters`), 1.0 for the other families."""
    if hf_config.model_type != "glm4_moe":
        return 1.0
    from verl.models.mcore.glm4_moe import partial_rotary_factor

    return partial_rotary_factor(hf_config)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Vocabulary rounded up to a multiple of the tensor-parallel size."""
    return -(-vocab_size // tp_size) * tp_size


def _has_qkv_bias(hf_config) -> bool:
    if hf_config.model_type == "gpt_oss":  # every linear layer has a bias: add_bias_linear (gpt_oss.py)
        return False
    if hf_config.model_type == "qwen2":
        return True
    if hf_config.model_type == "glm4_moe":  # its attention_bias is on q/k/v only, not on o_proj
        return bool(getattr(hf_config, "attention_bias", False))
    if getattr(hf_config, "attention_bias", False):
        raise NotImplementedError(
            f"{hf_config.model_type} config has attention_bias=True, which also adds an o_proj bias that megatron's "
            "local spec "
            "cannot hold without biasing every linear layer; use actor.strategy=fsdp for this model"
        )
    return False


def hf_to_mcore_config(
    hf_config, megatron_cfg=None, dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None
):
    """A megatron `TransformerConfig` equal to the HF Qwen2/Llama `hf_config`.

    `megatron_cfg` is the `actor.megatron` section (dict/DictConfig/None): tensor_model_parallel_size,
    pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, context_parallel_size,
    sequence_parallel. `dtype` is the parameter dtype (float32, bfloat16 or float16);
    `compute_dtype` the autocast dtype of mixed precision (None: compute in `dtype`), which is then
    the dtype of the activations the pipeline stages exchange (megatron's residual add casts the
    residual stream to the autocast output's dtype) and of megatron's 16-bit flags (softmax in fp32).
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _SUPPORTED:
        raise NotImplementedError(
            f"the megatron backend supports model_type in {list(_SUPPORTED)}, got {model_type!r}; "
            "use actor.strategy=fsdp for other architectures"
        )
    if getattr(hf_config, "mlp_bias", False):
        raise NotImplementedError("llama config has mlp_bias=True, which the megatron backend does not implement")
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("qwen2 config has use_sliding_window=True, which the megatron backend does not do")
    rope_theta_of(hf_config)  # validates rope scaling
    tp = int(_get(megatron_cfg, "tensor_model_parallel_size", 1))
    pp = int(_get(megatron_cfg, "pipeline_model_parallel_size", 1))
    vpp = _get(megatron_cfg, "virtual_pipeline_model_parallel_size", None)
    vpp = None if vpp in (None, 0, 1) else int(vpp)
    cp = int(_get(megatron_cfg, "context_parallel_size", 1))
    sequence_parallel = bool(_get(megatron_cfg, "sequence_parallel", False)) and tp > 1
    num_layers = hf_config.num_hidden_layers
    split = pipeline_split(num_layers, pp, vpp, _get(megatron_cfg, "override_transformer_config", None))
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp or groups % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} must divide both num_attention_heads={heads} and "
            f"num_key_value_heads={groups} (megatron splits attention by heads and query groups)"
        )
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    moe = _moe_fields(hf_config, megatron_cfg, tp, sequence_parallel)
    config_cls = TransformerConfig
    if model_type == "deepseek_v3":
        from verl.models.mcore.deepseek import deepseek_config_fields

        config_cls = MLATransformerConfig
        moe.update(deepseek_config_fields(hf_config))
        head_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    elif model_type == "glm4_moe":
        from verl.models.mcore.glm4_moe import glm4_moe_config_fields

        moe.update(glm4_moe_config_fields(hf_config, head_dim))
    fields = dict(
        num_layers=num_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=_has_qkv_bias(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        pipeline_dtype=compute_dtype or dtype,
        bf16=(compute_dtype or dtype) == torch.bfloat16,
        fp16=(compute_dtype or dtype) == torch.float16,
        use_cpu_initialization=True,
        variable_seq_lengths=True,
        calculate_per_token_loss=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        **split,
        # the interleaved schedule with batched p2p (megatron's default) deadlocks in training on
        # gloo (measured: pp=2 and pp=4 with vpp=2, variable sequence lengths); its per-direction
        # (overlapped) p2p path runs on gloo and NCCL alike
        overlap_p2p_comm=bool(vpp),
        batch_p2p_comm=not vpp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
    )
    fields.update(moe)
    if model_type == "gpt_oss":
        from verl.models.mcore.gpt_oss import gpt_oss_config_fields, set_yarn_fields

        fields.update(gpt_oss_config_fields(hf_config, lambda key, default: _get(megatron_cfg, key, default)))
        # megatron-core's config check refuses biased experts at etp > 1 (its fc2 bias would be added
        # once per expert-tensor rank); gpt_oss.expert_fc2_class adds it once, so the check is
        # passed at etp=1 and the size set after: the model reads the expert groups, not this field
        etp = fields["expert_tensor_parallel_size"]
        tf_config = config_cls(**dict(fields, expert_tensor_parallel_size=1))
        tf_config.expert_tensor_parallel_size = etp
        set_yarn_fields(tf_config, hf_config)
        return tf_config
    return config_cls(**fields)


PIPELINE_SPLIT_KEYS = (
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def pipeline_split(num_layers: int, pp: int, vpp: int | None, overrides=None) -> dict:
    """The TransformerConfig fields that place `num_layers` layers on `pp` stages (x `vpp` virtual
    stages): none for the even split, else megatron's uneven-split keys taken from
    `megatron.override_transformer_config` (upstream's DeepSeek-V3 scripts: 61 layers on 16 or 12
    stages). They go into the config's constructor, so megatron's own offsets
    (`get_transformer_layer_offset`, used by the layer specs and the weight converter alike)
    and checks see them; a split that does not add up is refused here with what to change."""
    overrides = overrides or {}
    if _get(overrides, "pipeline_model_parallel_layout", None) is not None:
        raise NotImplementedError(
            "megatron.override_transformer_config.pipeline_model_parallel_layout is not supported by this megatron "
            "backend; place the layers with num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage "
            "(or account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split) instead"
        )
    split = {key: _get(overrides, key, None) for key in PIPELINE_SPLIT_KEYS}
    split = {key: value for key, value in split.items() if value is not None and value is not False}
    stages = vpp or 1
    prefix = "megatron.override_transformer_config."
    if not split:
        if num_layers % (pp * stages):
            raise ValueError(
                f"the model's {num_layers} layers cannot be split evenly into pipeline_model_parallel_size={pp} x "
                f"virtual_pipeline_model_parallel_size={stages} stages; choose sizes whose product divides "
                f"{num_layers}, or set {prefix}num_layers_in_first_pipeline_stage / "
                "num_layers_in_last_pipeline_stage for an uneven split"
            )
        return {}
    given = ", ".join(f"{prefix}{key}={value}" for key, value in split.items())
    if pp == 1:
        raise ValueError(f"{given} places layers on pipeline stages, but pipeline_model_parallel_size=1; remove it")
    first = split.get("num_layers_in_first_pipeline_stage")
    last = split.get("num_layers_in_last_pipeline_stage")
    if first is not None or last is not None:
        if any(k.startswith("account_for") for k in split):
            raise ValueError(
                f"{given}: the first/last stage sizes and account_for_*_in_pipeline_split are two ways to place the "
                "layers (megatron refuses both at once); keep one of them"
            )
        ends = [n for n in (first, last) if n is not None]
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 or n % stages for n in ends):
            raise ValueError(
                f"{given}: each must be a positive integer, divisible by virtual_pipeline_model_parallel_size={stages}"
            )
        middle_layers, middle_stages = num_layers - sum(ends), pp - len(ends)
        if middle_layers < 0 or (middle_stages == 0) != (middle_layers == 0):
            raise ValueError(
                f"{given} with pipeline_model_parallel_size={pp}: the model's {num_layers} layers leave "
                f"{middle_layers} layers for {middle_stages} middle stages; every stage needs layers and every layer "
                "a stage, so change the sizes"
            )
        if middle_stages and middle_layers % (middle_stages * stages):
            raise ValueError(
                f"{given}: the {middle_layers} layers left for the {middle_stages} middle stages do not split evenly "
                f"(x virtual_pipeline_model_parallel_size={stages}); change the first/last stage sizes"
            )
        return split
    counted = num_layers + len(split)  # the embedding and/or the loss each counted as one layer
    if counted % (pp * stages):
        raise ValueError(
            f"{given}: the model's {num_layers} layers plus {len(split)} counted for the embedding/loss make {counted}, "
            f"which pipeline_model_parallel_size={pp} x virtual_pipeline_model_parallel_size={stages} must divide"
        )
    return split


def _moe_fields(hf_config, megatron_cfg, tp: int, sequence_parallel: bool) -> dict:
    """The TransformerConfig fields of a Qwen3-MoE model (qk norms, routed experts), or only the
    token dispatcher for a dense model (megatron refuses its default dispatcher without TE).

    Routing is HF's: softmax over the experts' logits, top-k, renormalised when `norm_topk_prob`
    (megatron's top-k-then-softmax, `moe_router_pre_softmax=False`, is the same function), else
    the plain top-k probabilities (`moe_router_pre_softmax=True`). The router runs in float32 as
    HF's softmax does. Dropless (no capacity factor), so a token's output never depends on the
    other tokens of the batch. Megatron's own auxiliary loss stays off: the actor adds HF's form
    of it (`verl.models.moe`), as the FSDP actor does.
    """
    if hf_config.model_type not in _MOE_TYPES:
        _refuse_expert_parallel(megatron_cfg, hf_config.model_type)
        return {"moe_token_dispatcher_type": "alltoall"}
    ep = int(_get(megatron_cfg, "expert_model_parallel_size", 1))
    etp = int(_get(megatron_cfg, "expert_tensor_parallel_size", tp))
    experts = hf_config.num_local_experts if hf_config.model_type in _SIGMOID_TYPES else hf_config.num_experts
    expert_size = expert_intermediate_size(hf_config)
    if getattr(hf_config, "mlp_only_layers", None) or int(getattr(hf_config, "decoder_sparse_step", 1) or 1) != 1:
        raise NotImplementedError(
            "qwen3_moe config has dense layers between the MoE layers (mlp_only_layers / decoder_sparse_step != 1), "
            "which the megatron backend does not build; use actor.strategy=fsdp for this model"
        )
    if tp > 1 and not sequence_parallel:
        raise ValueError(
            f"actor.megatron.tensor_model_parallel_size={tp} on a mixture-of-experts model needs "
            "actor.megatron.sequence_parallel=true: megatron's MoE layer refuses to train under tensor parallelism "
            "without it (each tensor rank would dispatch every token)"
        )
    if ep < 1 or experts % ep:
        raise ValueError(
            f"actor.megatron.expert_model_parallel_size={ep} must divide the model's num_experts={experts} "
            "(each expert-parallel rank holds num_experts / ep whole experts)"
        )
    if etp < 1 or expert_size % etp:
        raise ValueError(
            f"actor.megatron.expert_tensor_parallel_size={etp} must divide the model's "
            f"{'intermediate_size' if hf_config.model_type == 'gpt_oss' else 'moe_intermediate_size'}={expert_size}"
        )
    family = {"qk_layernorm": True}
    if hf_config.model_type in _SIGMOID_TYPES:  # sigmoid routing, shared experts, dense first layers
        from verl.models.mcore.deepseek import deepseek_moe_fields

        family = deepseek_moe_fields(hf_config)
    return {
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": expert_size,
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", False)),
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False,  # SequentialMLP: TE's and the grouped_gemm package's kernels are GPU-only
        "moe_token_dispatcher_type": "alltoall",
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        **family,  # last: a family's routing replaces the softmax defaults above
    }


def expert_intermediate_size(hf_config) -> int:
    """One routed expert's MLP size: `moe_intermediate_size`, which gpt-oss names `intermediate_size`."""
    if hf_config.model_type == "gpt_oss":
        return hf_config.intermediate_size
    return hf_config.moe_intermediate_size


def _refuse_expert_parallel(megatron_cfg, model_type) -> None:
    for key in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
        value = _get(megatron_cfg, key, None)
        if key == "expert_model_parallel_size" and value not in (None, 1):
            raise ValueError(
                f"actor.megatron.{key}={value} on a dense {model_type} model: expert parallelism splits the experts of "
                f"a mixture-of-experts model ({', '.join(_MOE_TYPES)}); set it to 1"
            )


def build_gpt_model(
    hf_config,
    tf_config,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    value_head: bool = False,
):
    """This rank's GPTModel stage (`pre_process`/`post_process` default to this pp rank's role).

    `value_head=True` replaces the LM head with a [1, hidden] linear layer with bias (not tensor-parallel),
    giving values [B, S, 1]; the embeddings are then never tied to it.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if pre_process is None:
        pre_process = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp = tf_config.tensor_model_parallel_size
    offset = get_transformer_layer_offset(tf_config, vp_stage=vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(tf_config, vp_stage=vp_stage))
    block = TransformerBlockSubmodules(layer_specs=[_layer_spec(tf_config, i) for i in layers], layer_norm=RMSNorm)
    # MTP layers only when the caller asks (tf_config.mtp_num_layers, see verl.models.mcore.mtp):
    # otherwise a checkpoint's MTP weights are ignored, as HF's models ignore them
    num_mtp_layers = 0 if value_head else (tf_config.mtp_num_layers or 0)
    mtp_spec = _layer_spec(tf_config, tf_config.num_layers - 1) if num_mtp_layers else None
    # None on a pipeline stage before the last: megatron builds the MTP layers (and their copy of the
    # embedding) on the last stage
    mtp_block = build_mtp_block_spec(tf_config, mtp_spec, RMSNorm, vp_stage) if num_mtp_layers else None
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=block,
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) and not value_head,
        position_embedding_type=_position_embedding_type(hf_config),
        rotary_base=rope_theta_of(hf_config),
        rotary_percent=rotary_percent_of(hf_config),
        vp_stage=vp_stage,
        mtp_block_spec=mtp_block,
    )
    if mtp_block is not None:
        install_postprocess(model, num_mtp_layers)
        if model.share_embeddings_and_output_weights and not pre_process:
            # the MTP stage's LM head is its embedding copy (GPTModel.shared_embedding_or_output_weight);
            # megatron-core 0.16.1 still allocates an output weight there, which nothing reads and its
            # checkpointing refuses: drop it, as megatron does on a stage that has the embedding itself
            model.output_layer.register_parameter("weight", None)
    if value_head and post_process:
        model.output_layer = _ValueHead(tf_config.hidden_size, tf_config.params_dtype, tf_config.sequence_parallel)
    if tf_config.softmax_type == "learnable":
        from verl.models.mcore.gpt_oss import mark_sinks_tensor_parallel

        mark_sinks_tensor_parallel(model)
    if tf_config.moe_router_score_function == "sigmoid":
        from verl.models.mcore.deepseek import attach_expert_bias

        attach_expert_bias(model)
    return model


def _position_embedding_type(hf_config) -> str:
    """GPTModel's rotary embedding: gpt-oss's YaRN (`verl.models.mcore.gpt_oss`), else plain RoPE
    (DeepSeek-V3's latent attention builds its own)."""
    if hf_config.model_type == "gpt_oss":
        from verl.models.mcore.gpt_oss import yarn_parameters

        return "rope" if yarn_parameters(hf_config) is None else "yarn"
    return "rope"


def _layer_spec(tf_config, layer: int):
    """The local spec of global layer `layer`: MoE or dense MLP, MLA or standard attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from verl.models.mcore.deepseek import is_moe_layer

    mla = bool(getattr(tf_config, "multi_latent_attention", False))
    spec = get_gpt_layer_local_spec(
        num_experts=tf_config.num_moe_experts if is_moe_layer(tf_config, layer) else None,
        moe_grouped_gemm=False,
        qk_layernorm=tf_config.qk_layernorm,
        multi_latent_attention=mla,
        normalization="RMSNorm",
    )
    layer_spec = spec.submodules
    layer_spec.input_layernorm = layer_spec.pre_mlp_layernorm = RMSNorm
    if tf_config.add_bias_linear and is_moe_layer(tf_config, layer):  # gpt-oss's biased experts
        from verl.models.mcore.gpt_oss import expert_fc2_class

        layer_spec.mlp.submodules.experts.submodules.linear_fc2 = expert_fc2_class()
    if mla:
        from verl.models.mcore.deepseek import use_local_mla

        use_local_mla(layer_spec.self_attention, RMSNorm)
        return spec
    if tf_config.qk_layernorm:
        attention = layer_spec.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    if tf_config.context_parallel_size > 1:  # megatron's local attention refuses it; see context_parallel.py
        from verl.models.mcore.context_parallel import ContextParallelAttention

        layer_spec.self_attention.submodules.core_attention = ContextParallelAttention
    return spec


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with megatron's norm constructor, usable under sequence parallelism.

    Megatron's local spec falls back to `WrappedTorchNorm`, which refuses sequence parallelism,
    and apex's fused norm has no RMSNorm; this one marks its weight `sequence_parallel` instead:
    each tensor-parallel rank then normalises its own slice of the sequence, and the weight's
    gradient is summed over the tensor-parallel group after the backward pass
    (`verl.workers.actor.megatron_actor.finalize_megatron_grads`), as megatron's DDP would do.
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        if normalization != "RMSNorm" or zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise NotImplementedError(f"this norm is a plain RMSNorm, not {normalization} (zero_centered_gamma off)")
        # in the parameter dtype, as TransformerEngine's and apex's norms are (a float32 weight on
        # bf16 activations would miss torch's fused kernel)
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # mixed precision: fp32 weight, bf16 activations; the fused kernel wants one dtype (it
        # accumulates in fp32 either way), and the cast is differentiable (the gradient reaches the
        # fp32 weight)
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return torch.nn.functional.rms_norm(x, self.normalized_shape, weight, self.eps)


class HeadRMSNorm(RMSNorm):
    """Qwen3's per-head query/key RMSNorm ([head_dim] weight, shared by every head).

    Each tensor-parallel rank normalises only its own heads, so the weight's gradient is a partial
    sum on each rank at tp > 1 (with or without sequence parallelism): it is marked like a
    sequence-parallel norm, whose gradient is summed over the tensor-parallel group after the
    backward pass (megatron's DDP does the same for `q_layernorm`/`k_layernorm`).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(config, hidden_size, eps=eps, **kwargs)
        self.weight.sequence_parallel = config.tensor_model_parallel_size > 1


class _ValueHead(torch.nn.Module):
    """HF's token-classification `score` ([1, hidden] weight and a bias), called like megatron's
    output layer: (output, bias). Replicated on the tensor-parallel ranks: under sequence
    parallelism it first gathers the whole sequence (its backward keeps each rank's own slice,
    since every rank computes the same values and loss)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None, **kwargs):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def build_model_chunks(hf_config, tf_config, value_head: bool = False) -> list:
    """This rank's model chunks: one GPTModel stage, or `vpp` of them with virtual pipelining."""
    vpp = tf_config.virtual_pipeline_model_parallel_size
    if vpp is None:
        return [build_gpt_model(hf_config, tf_config, value_head=value_head)]
    return [build_gpt_model(hf_config, tf_config, vp_stage=v, value_head=value_head) for v in range(vpp)]
