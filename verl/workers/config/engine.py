"""Typed engine config sections, with upstream verl's names and defaults: `McoreEngineConfig` (the
`_target_` of every role's `megatron` section, engine/megatron.yaml) and `FSDPEngineConfig` (every
FSDP role's `fsdp_config`, engine/fsdp.yaml).

Each field carries its runtime default (the YAML holds the same value) and the `doc(...)` metadata the
validator and docgen read, so the section is declared once, here; `schema.py` composes it into the actor,
reference, critic and reward-model sections. Keys only some roles hold (the reward model has no optimizer)
are `optional`.

`EngineConfig` is the base both engines' sections share, with upstream's name: the keys every engine
reads the same way (offload, dtype, seed, forward-only) and upstream's batch keys (`use_dynamic_bsz`,
`max_token_len_per_gpu`, `micro_batch_size_per_gpu`, the `infer_*` pair, `use_fused_kernels`,
`use_remove_padding`), declared once here for FSDP, Megatron and VeOmni. The engine YAMLs do not hold
the batch keys (as upstream's do not): whoever drives the engine gives them a value. The SFT engine
trainer (`verl.trainer.sft_trainer`) fills them from its `data.*` and `model.*` keys; the PPO roles
read their own section's keys (`actor.use_dynamic_bsz`, `actor.ppo_micro_batch_size_per_gpu`, ...). Both
config checks refuse them under an engine section (`ROLE_BATCH_KEYS`) rather than hold a second value
that could disagree with the first. `TrainingWorkerConfig` bundles what one training engine is built from
(upstream's name and fields). `VeOmniEngineConfig` is upstream's section of an engine not in this
build: it constructs (and engine/veomni.yaml composes) as upstream's, with upstream's base batch keys,
and selecting the engine is refused (see its docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl.base_config import BaseConfig
from verl.workers.config._fields import _SPEED, ENGINE_DTYPES, IGNORED, MODEL_DTYPES, UNSUPPORTED, doc

__all__ = [
    "EngineConfig",
    "EngineRouterReplayConfig",
    "FSDPEngineConfig",
    "McoreEngineConfig",
    "McoreQATEngineConfig",
    "QATEngineConfig",
    "TrainingWorkerConfig",
    "VeOmniEngineConfig",
]

# Upstream's base-class batch keys: filled by whoever drives the engine (see the module docstring);
# mutable, as upstream's, so the driver sets them on a built section.
ROLE_BATCH_KEYS = (
    "use_dynamic_bsz",
    "max_token_len_per_gpu",
    "micro_batch_size_per_gpu",
    "infer_max_token_len_per_gpu",
    "infer_micro_batch_size_per_gpu",
    "use_fused_kernels",
    "use_remove_padding",
)
_BY_THE_DRIVER = (
    " Given by whoever drives the engine, not set here (refused): the SFT engine trainer fills it from data.* / "
    "model.*, the PPO roles read their own key."
)

# `TrainingWorkerConfig.model_type` values: the `EngineRegistry` model types
MODEL_TYPES = ("language_model", "value_model")


def _default_override_transformer_config() -> dict:
    # upstream's engine/megatron.yaml: recomputation off, the core-attention module listed for when it is on
    return {
        "recompute_granularity": None,
        "recompute_modules": ["core_attn"],
        "recompute_method": None,
        "recompute_num_layers": None,
        "attention_backend": "flash",
    }


@dataclass
class QATEngineConfig(BaseConfig):
    """Upstream's quantization-aware training of an engine (`fsdp_config.qat` / `megatron.qat`): fake-quantised
    weights (and activations) in training so that a quantised rollout sees what was trained. Not in this build:
    `enable` must stay false; the other keys are read only when it is on."""

    enable: bool = doc("Train with fake-quantised weights.", status=UNSUPPORTED, neutral=False, default=False)
    mode: str = doc(
        "Quantisation scheme (w4a16: 4-bit weights, 16-bit activations); read only with enable.", default="w4a16"
    )
    group_size: int = doc("Weights per quantisation group; read only with enable.", default=16)
    ignore_patterns: list[str] = doc(
        "Modules left unquantised; read only with enable.",
        default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"],
    )
    activation_observer: str | None = doc("Activation range observer; read only with enable.", default="static_minmax")
    quantization_config_path: str | None = doc("A quantisation config file; read only with enable.", default=None)


@dataclass
class McoreQATEngineConfig(QATEngineConfig):
    """`megatron.qat`: the same keys, with upstream's Megatron defaults."""

    ignore_patterns: list[str] = doc(
        "Modules left unquantised; read only with enable.", default_factory=lambda: ["lm_head", "*mlp.gate"]
    )
    activation_observer: str | None = doc("Activation range observer; read only with enable.", default=None)


@dataclass
class EngineRouterReplayConfig(BaseConfig):
    """`megatron.router_replay`: upstream's engine-level copy of the role's `router_replay` (which drives it here)."""

    mode: str = doc(
        "Routing replay mode of the engine; the role's router_replay.mode is the switch here, so this must stay "
        "disabled.",
        status=UNSUPPORTED,
        neutral="disabled",
        default="disabled",
    )
    record_file: str | None = doc(
        "Write recorded routing decisions to a file.", status=UNSUPPORTED, neutral=None, default=None
    )
    replay_file: str | None = doc(
        "Replay routing decisions from a file.", status=UNSUPPORTED, neutral=None, default=None
    )


_PAD_DOC = (
    "Pad each micro-batch's packed tokens to a multiple of pad_to_length_bucket (fewer distinct shapes for "
    "compiled kernels). Padding tokens do not change the results"
)


def _default_wrap_policy() -> dict:
    # engine/fsdp.yaml: wrap every module (upstream's dataclass default is {}, its YAML says this)
    return {"min_num_params": 0}


@dataclass
class EngineConfig(BaseConfig):
    """The keys every training engine's section has (the base of `FSDPEngineConfig`, `McoreEngineConfig` and
    `VeOmniEngineConfig`).

    Each subclass may re-declare a key with its own wording and status (a Megatron model on CPU has no
    host to offload to), so the base's defaults are upstream's and its docs are the general meaning.
    """

    _mutable_fields = BaseConfig._mutable_fields | set(ROLE_BATCH_KEYS)

    param_offload: bool = doc("Keep parameters on the host between uses (saves device memory).", default=False)
    optimizer_offload: bool = doc("Keep optimizer state on the host between updates.", default=False)
    grad_offload: bool = doc("Keep gradients on the host between updates.", optional=True, default=False)
    forward_only: bool = doc("Build the model for forward passes only (the reference policy).", default=False)
    dtype: str = doc("Compute dtype of the engine's model.", choices=ENGINE_DTYPES, default="bfloat16")
    seed: int = doc("Seed of the engine's random number generators.", default=42)
    use_dynamic_bsz: bool = doc(
        "Pack training and inference micro-batches by token count (max_token_len_per_gpu) instead of a fixed "
        "number of sequences." + _BY_THE_DRIVER,
        optional=True,
        default=True,
    )
    max_token_len_per_gpu: int | None = doc(
        "Token budget of one training micro-batch on one rank (with use_dynamic_bsz)." + _BY_THE_DRIVER,
        optional=True,
        default=None,
    )
    micro_batch_size_per_gpu: int | None = doc(
        "Sequences per training micro-batch on one rank (without use_dynamic_bsz)." + _BY_THE_DRIVER,
        optional=True,
        default=None,
    )
    infer_max_token_len_per_gpu: int | None = doc(
        "Token budget of one forward-only micro-batch (null: max_token_len_per_gpu)." + _BY_THE_DRIVER,
        optional=True,
        default=None,
    )
    infer_micro_batch_size_per_gpu: int | None = doc(
        "Sequences per forward-only micro-batch (null: micro_batch_size_per_gpu)." + _BY_THE_DRIVER,
        optional=True,
        default=None,
    )
    use_fused_kernels: bool = doc(
        "Log-probs from the hidden states in chunks, without the full [tokens, vocab] logits (same values)."
        + _BY_THE_DRIVER,
        optional=True,
        default=False,
    )
    use_remove_padding: bool = doc(
        "Pack the sequences of a micro-batch without padding (same values; speed and memory)." + _BY_THE_DRIVER,
        optional=True,
        default=True,
    )


@dataclass
class FSDPEngineConfig(EngineConfig):
    """FSDP engine of one model (optimizer keys have no effect for forward-only models)."""

    # as upstream's: a role's older spelling of the Ulysses size may be copied in after construction
    _mutable_fields = EngineConfig._mutable_fields | {"ulysses_sequence_parallel_size"}

    wrap_policy: dict = doc(
        "Auto-wrap policy, e.g. {min_num_params: 0} or {transformer_layer_cls_to_wrap: [...]}.",
        default_factory=_default_wrap_policy,
    )
    param_offload: bool = doc("Keep parameters on CPU between uses (saves device memory).", default=False)
    optimizer_offload: bool = doc("Keep optimizer state on CPU between updates.", default=False)
    grad_offload: bool = doc(
        "Keep gradients on the host between updates; FSDP2 offloads gradients only together with the parameters "
        "and optimizer state: use offload_policy.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    offload_policy: bool = doc(
        "FSDP2 CPUOffloadPolicy during training (params, grads and optimizer on CPU).", default=False
    )
    reshard_after_forward: bool | int = doc(
        "FSDP2: free gathered parameters after forward (True, False or a group size).",
        default=True,
    )
    fsdp_size: int = doc(
        "Ranks per FSDP shard group (-1: all ranks, i.e. plain FSDP; a model under 16M parameters is then "
        "replicated instead: as plain per-rank replicas with one gradient all-reduce per step when FSDP2 would "
        "not cast or offload it, else as with 1). 1 replicates the model on every rank under FSDP2 (HSDP).",
        default=-1,
    )
    forward_prefetch: bool = doc(
        "FSDP1's explicit forward prefetch (upstream passes it to FSDP1 only). FSDP2, the only FSDP here, already "
        f"overlaps the next layer's all-gather with the current layer's forward. {_SPEED}.",
        status=IGNORED,
        default=False,
    )
    model_dtype: str = doc("Dtype the trained (master) weights are kept in.", choices=MODEL_DTYPES, default="fp32")
    use_orig_params: bool = doc(
        "FSDP1's flat-parameter switch; FSDP2 (the only FSDP here) always keeps the original parameters.",
        status=IGNORED,
        default=False,
    )
    seed: int = doc("Seed of the random number generators when full_determinism is on.", default=42)
    full_determinism: bool = doc(
        "Deterministic kernels (torch.use_deterministic_algorithms) and RNGs seeded with `seed` in every worker "
        "(slower; for bitwise-reproducible runs).",
        default=False,
    )
    ulysses_sequence_parallel_size: int = doc(
        "Ulysses sequence-parallel group size of the role (upstream's newer spelling of the role's own key: either "
        "one alone sets it, both > 1 must agree; see docs/sequence_parallel.md). The SFT engine trainer refuses > 1.",
        default=1,
    )
    entropy_from_logits_with_chunking: bool = doc(f"Entropy in chunks. {_SPEED}.", status=IGNORED, default=False)
    entropy_from_logits_chunk_size: int = doc(
        f"Rows per chunk of the chunked entropy (follows the role's key). {_SPEED}: the entropy here is chunked "
        "by memory size (about 256 MiB of float32 logits per chunk).",
        status=IGNORED,
        default=2048,
    )
    pad_to_length: bool = doc(f"{_PAD_DOC}. {_SPEED}.", status=IGNORED, default=False)
    pad_to_length_bucket: int = doc(f"Bucket of pad_to_length. {_SPEED}.", status=IGNORED, default=1024)
    qat: QATEngineConfig = doc("Quantization-aware training (not in this build).", default_factory=QATEngineConfig)
    use_torch_compile: bool = doc(
        "torch.compile inside upstream's newer engine workers; here the role's use_torch_compile is the switch "
        f"(upstream's default workers read that one too). {_SPEED}.",
        status=IGNORED,
        default=True,
    )
    entropy_checkpointing: bool = doc(f"Recompute entropy in backward. {_SPEED}.", status=IGNORED, default=False)
    forward_only: bool = doc(
        "Set by the composition for forward-only roles (the reference policy); a role's own needs decide here.",
        status=IGNORED,
        default=False,
    )
    strategy: str = doc(
        "The engine's backend (follows the role's strategy: fsdp and fsdp2 both mean FSDP2 here).",
        choices=("fsdp", "fsdp2"),
        default="fsdp",
    )
    dtype: str = doc(
        "Compute (parameter) dtype of the mixed-precision policy when `mixed_precision` is null: bfloat16 is "
        "upstream's default; auto (ours): bfloat16 on GPU, the weights' own dtype on CPU.",
        choices=ENGINE_DTYPES,
        default="bfloat16",
    )
    mixed_precision: dict | None = doc(
        "{param_dtype, reduce_dtype, buffer_dtype}; null: param_dtype from `dtype`, fp32 gradient reduction.",
        optional=True,
        default=None,
    )


def freeze_moe_router(override_mcore_model_config) -> bool:
    """`megatron.override_mcore_model_config` read as upstream's `make_megatron_module` reads it: the one
    option it holds is `moe_config.freeze_moe_router` (default false). Any other key is refused, since
    upstream reads none (nothing set there is silently dropped)."""
    section = dict(override_mcore_model_config or {})
    unknown = sorted(set(section) - {"moe_config"})
    moe = section.get("moe_config") or {}
    if not unknown and hasattr(moe, "items"):
        unknown = [f"moe_config.{k}" for k in sorted(set(moe) - {"freeze_moe_router"})]
    elif not unknown:
        unknown = [f"moe_config={moe!r}"]
    if unknown:
        raise ValueError(
            f"megatron.override_mcore_model_config has {', '.join(map(str, unknown))}: the only option it holds is "
            "moe_config.freeze_moe_router (true/false), as upstream; set TransformerConfig fields through "
            "megatron.override_transformer_config and HF config values through model.override_config"
        )
    freeze = moe.get("freeze_moe_router", False)
    if not isinstance(freeze, bool):
        raise ValueError(
            f"megatron.override_mcore_model_config.moe_config.freeze_moe_router={freeze!r} must be true or false"
        )
    return freeze


@dataclass
class McoreEngineConfig(EngineConfig):
    """Megatron-core parallelism of one model (read when its `strategy` is megatron; docs/megatron.md)."""

    # as upstream's: corrected after construction (off without tensor parallelism)
    _mutable_fields = EngineConfig._mutable_fields | {"sequence_parallel"}

    strategy: str = doc(
        "The engine's backend (upstream's dataclass field; the YAML leaves it out).",
        choices=("megatron",),
        optional=True,
        default="megatron",
    )

    param_offload: bool = doc(
        "Keep parameters on the host between uses (saves device memory; no-op on CPU).", default=False
    )
    grad_offload: bool = doc(
        "Keep gradients on the host between updates.", status=IGNORED, optional=True, default=False
    )
    optimizer_offload: bool = doc(
        "Keep the Adam moments on the host between updates (no-op on CPU).", optional=True, default=False
    )
    tensor_model_parallel_size: int = doc(
        "Ranks one layer's weights are split over (attention heads, MLP, vocab).", default=1
    )
    expert_model_parallel_size: int = doc(
        "Ranks a mixture-of-experts layer's experts are split over (each holds num_experts / ep whole experts; "
        "tokens reach them by an all-to-all). Carved out of the data x context-parallel ranks. "
        "See docs/megatron.md, 'Mixture of experts'.",
        default=1,
    )
    expert_tensor_parallel_size: int | None = doc(
        "Ranks each expert's MLP is split over (null: tensor_model_parallel_size).", default=None
    )
    pipeline_model_parallel_size: int = doc("Pipeline stages the layers are split into.", default=1)
    virtual_pipeline_model_parallel_size: int | None = doc(
        "Interleaved pipeline chunks (virtual stages) per pipeline stage; needs pipeline_model_parallel_size >= 2 "
        "and at least that many micro-batches per rank. null: no interleaving.",
        default=None,
    )
    context_parallel_size: int = doc(
        "Ranks one sequence is split over (each holds 2 of its 2 x cp load-balanced chunks; keys and values "
        "are all-gathered in attention). Must divide the world size together with the tensor and pipeline sizes.",
        default=1,
    )
    sequence_parallel: bool = doc(
        "Split activations outside attention/MLP along the sequence over the tensor-parallel ranks (memory only, "
        "same results); needs tensor_model_parallel_size > 1 (with 1 the built section holds false, as upstream's). "
        "Runs without TransformerEngine or apex.",
        default=True,
    )
    use_distributed_optimizer: bool = doc(
        "Split the Adam state over data-parallel ranks by whole parameters (ZeRO stage 1; memory only, same results).",
        default=True,
    )
    use_dist_checkpointing: bool = doc(
        "Start from a Megatron dist checkpoint (made once with `python -m verl.models.mcore.converter`) instead of "
        "the HF weights: each rank reads only its shards. Not for the reward model.",
        default=False,
    )
    dist_checkpointing_path: str | None = doc(
        "That checkpoint's directory (or a verl megatron checkpoint's actor/critic directory).", default=None
    )
    dist_checkpointing_prefix: str = doc("Key prefix inside that checkpoint.", default="")
    dynamic_context_parallel: bool = doc(
        "Megatron's dynamic context parallelism (per-batch context-parallel sizes). Not in this build.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    max_seqlen_per_dp_cp_rank: int | None = doc(
        "Token budget per rank of dynamic context parallelism (read only with it).",
        status=UNSUPPORTED,
        neutral=None,
        optional=True,
        default=None,
    )
    dist_ckpt_optim_fully_reshardable: bool = doc(
        "Save the distributed optimizer's state resharding-ready in dist checkpoints. verl's Megatron checkpoints "
        "here are per-rank files, not Megatron dist checkpoints.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    distrib_optim_fully_reshardable_mem_efficient: bool = doc(
        "Memory-saving variant of dist_ckpt_optim_fully_reshardable.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    entropy_from_logits_with_chunking: bool = doc(
        f"Entropy in chunks (follows the role's key). {_SPEED}.", status=IGNORED, optional=True, default=False
    )
    entropy_from_logits_chunk_size: int = doc(
        f"Rows per chunk of the chunked entropy (follows the role's key). {_SPEED}: the entropy here is chunked "
        "by memory size (about 256 MiB of float32 logits per chunk).",
        status=IGNORED,
        optional=True,
        default=2048,
    )
    seed: int = doc("Seed of Megatron's model-parallel random streams.", default=42)
    override_ddp_config: dict = doc(
        "Megatron DistributedDataParallelConfig fields (bucket sizes, overlap). "
        "Speed or memory only here: gradients are reduced by verl's own data-parallel step.",
        status=IGNORED,
        optional=True,
        default_factory=dict,
    )
    override_transformer_config: dict = doc(
        "TransformerConfig fields set on top of those derived from the HF config (e.g. recompute_granularity; "
        "recompute_* and attention_backend are speed or memory knobs).",
        default_factory=_default_override_transformer_config,
    )
    override_mcore_model_config: dict = doc(
        "Model-building options, as upstream's make_megatron_module reads them: only "
        "moe_config.freeze_moe_router (true: the mixture-of-experts routers' weights, and biases, get no gradient "
        "and no optimizer state; refused on a dense model). Any other key is an error.",
        optional=True,
        default_factory=dict,
    )
    use_mbridge: bool = doc(
        "Convert HF weights with the mbridge package; here verl's own converter (verl.models.mcore) builds the same "
        "Megatron weights either way.",
        status=IGNORED,
        default=True,
    )
    vanilla_mbridge: bool = doc("mbridge's implementation switch (see use_mbridge).", status=IGNORED, default=False)
    use_remove_padding: bool = doc(
        f"Pack sequences without padding (upstream's engine YAML holds it). {_SPEED}.", status=IGNORED, default=True
    )
    pad_bshd_to_minibatch_max: bool = doc(
        f"Pad unpacked (bshd) micro-batches to the mini-batch's longest sequence. {_SPEED}.",
        status=IGNORED,
        optional=True,
        default=True,
    )
    pad_to_length: bool = doc(f"{_PAD_DOC}. {_SPEED}.", status=IGNORED, optional=True, default=False)
    pad_to_length_bucket: int = doc(f"Bucket of pad_to_length. {_SPEED}.", status=IGNORED, optional=True, default=512)
    use_megatron_fsdp: bool = doc(
        "Megatron-FSDP instead of Megatron's data-parallel wrapper. Not in this build.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    router_replay: EngineRouterReplayConfig = doc(
        "Engine-level routing replay (the role's router_replay is the switch here).",
        optional=True,
        default_factory=EngineRouterReplayConfig,
    )
    qat: McoreQATEngineConfig = doc(
        "Quantization-aware training (not in this build).", optional=True, default_factory=McoreQATEngineConfig
    )
    forward_only: bool = doc("Build the model for inference only.", status=IGNORED, optional=True, default=False)
    dtype: str = doc(
        "Compute dtype of the Megatron model (mixed precision: parameters, gradients and Adam state stay fp32, "
        "the forward runs under autocast in this dtype; fp16 only for frozen models). auto (ours): bfloat16 on GPU, "
        "float32 on CPU.",
        choices=ENGINE_DTYPES,
        default="bfloat16",
    )

    def __post_init__(self):
        freeze_moe_router(self.override_mcore_model_config)  # checks its keys
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"megatron.{key}={value!r} must be a positive integer: it counts the ranks one model copy is "
                    "split over; set it to 1 (no split) or more"
                )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and self.pipeline_model_parallel_size < 2:
            raise ValueError(
                f"megatron.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size >= 2 (got "
                f"{self.pipeline_model_parallel_size}): interleaving splits each pipeline stage further; set "
                "virtual_pipeline_model_parallel_size=null or use a pipeline"
            )
        if self.tensor_model_parallel_size == 1:
            # nothing to split activations over; upstream's section says so too (its readers and ours gate on tp > 1)
            self.sequence_parallel = False


@dataclass
class VeOmniEngineConfig(EngineConfig):
    """Upstream's VeOmni engine section (engine/veomni.yaml), with its fields and dataclass defaults.

    It builds and is checked like upstream's, so code that constructs or imports it, or composes
    engine/veomni.yaml, runs; the VeOmni engine itself is not in this build (no VeOmni package), so a
    role whose strategy is `veomni` is refused by the config check, and `EngineRegistry` refuses the
    backend, each in one line naming the strategies that exist.

    The dataclass defaults are upstream's; the YAML sets some of them differently (data_parallel_mode
    fsdp2, mixed_precision, enable_full_shard, forward_prefetch on, use_torch_compile off), as
    upstream's does.
    """

    wrap_policy: dict = doc("FSDP auto-wrap policy.", default_factory=dict)
    offload_policy: bool = doc("Offload the policy model's parameters.", default=False)
    reshard_after_forward: bool = doc("Reshard parameters after the forward pass.", default=True)
    forward_prefetch: bool = doc("Prefetch the next forward's parameters.", default=False)
    use_orig_params: bool = doc("FSDP1 use_orig_params.", default=False)
    entropy_from_logits_with_chunking: bool = doc("Chunked entropy computation.", default=False)
    use_torch_compile: bool = doc("torch.compile the model.", default=True)
    entropy_checkpointing: bool = doc("Recompute entropy in backward.", default=False)
    strategy: str = doc("The engine's backend; only veomni.", choices=("veomni",), default="veomni")
    data_parallel_size: int = doc("FSDP group size.", default=1)
    data_parallel_replicate_size: int = doc("Data-parallel replicas.", default=1)
    data_parallel_shard_size: int = doc("Data-parallel shard degree.", default=1)
    tensor_parallel_size: int = doc("Tensor-parallel size.", default=1)
    expert_parallel_size: int = doc("Expert-parallel size.", default=1)
    pipeline_parallel_size: int = doc("Pipeline-parallel size.", default=1)
    context_parallel_size: int = doc("Ring-attention context-parallel size.", default=1)
    ulysses_parallel_size: int = doc("Ulysses sequence-parallel size.", default=1)
    data_parallel_mode: str = doc(
        "ddp, fsdp1 or fsdp2 (upstream's dataclass default is fsdp, its YAML's fsdp2).", default="fsdp"
    )
    seed: int = doc("Seed of the engine's random number generators.", default=42)
    full_determinism: bool = doc("Fully deterministic kernels (slow; for debugging).", default=False)
    mixed_precision: bool = doc("Mixed-precision training.", default=False)
    init_device: str = doc("Where weights are initialised: cpu (rank 0), cuda, meta or npu.", default="meta")
    enable_full_shard: bool = doc("Fully shard (ZeRO-3).", default=False)
    ckpt_manager: str = doc("Checkpoint manager: dcp.", choices=("dcp",), default="dcp")
    load_checkpoint_path: str | None = doc("Checkpoint to load.", default=None)
    enable_fsdp_offload: bool = doc("FSDP1 CPU offload.", default=False)
    enable_reentrant: bool = doc("Reentrant gradient checkpointing.", default=False)
    attn_implementation: str = doc("Attention implementation (VeOmni's names).", default="flash_attention_2")
    moe_implementation: str = doc("MoE implementation: eager or fused.", default="fused")
    force_use_huggingface: bool = doc("Load the model with Hugging Face's classes.", default=False)
    activation_gpu_limit: float = doc("GB of activations kept on the GPU with activation offload.", default=0.0)
    basic_modules: list[str] | None = doc("VeOmni's basic modules.", default_factory=list)

    def __post_init__(self):
        if self.strategy != "veomni":
            raise ValueError(
                f"VeOmniEngineConfig.strategy={self.strategy!r}: a VeOmni engine section's strategy is veomni; "
                "for another backend use FSDPEngineConfig (fsdp, fsdp2) or McoreEngineConfig (megatron)"
            )


@dataclass
class TrainingWorkerConfig(BaseConfig):
    """What one training engine is built from: the model, its engine section, optimizer, checkpoint
    contents and profiler (upstream's `TrainingWorkerConfig`; `verl.workers.engine.EngineRegistry.new`
    takes the same pieces). Built in code, not from the YAML: a role worker assembles it from its
    sections, so it is not part of the config tree.
    """

    model_type: str = doc("The EngineRegistry model type: language_model or value_model.", default="language_model")
    model_config: Any = doc("The model section (HFModelConfig, or the critic's model).", default=None)
    engine_config: EngineConfig | None = doc(
        "The engine section (FSDPEngineConfig or McoreEngineConfig).", default=None
    )
    optimizer_config: Any = doc(
        "The optimizer section (OptimizerConfig); None for a forward-only engine.", default=None
    )
    checkpoint_config: Any = doc("The role's checkpoint section (CheckpointConfig).", default=None)
    profiler_config: Any = doc("The role's profiler section.", default=None)
    auto_select_engine_optim_fn: Callable | None = doc(
        "Upstream's hook choosing the engine and optimizer sections from (model config, device name) when "
        "engine_config is None; `TrainingWorker` calls it.",
        default=None,
    )

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"TrainingWorkerConfig.model_type={self.model_type!r} is not an engine model type; use one of: "
                f"{', '.join(MODEL_TYPES)}"
            )
        if self.engine_config is not None and not isinstance(self.engine_config, EngineConfig):
            raise TypeError(
                f"TrainingWorkerConfig.engine_config is a {type(self.engine_config).__name__}; pass an EngineConfig "
                "(FSDPEngineConfig or McoreEngineConfig), e.g. omega_conf_to_dataclass(actor.fsdp_config)"
            )
