"""Typed engine config sections, with upstream verl's names and defaults (`verl.workers.config.McoreEngineConfig`,
the `_target_` of every role's `megatron` section, composed from engine/megatron.yaml).

Each field carries its runtime default (the YAML holds the same value) and the `doc(...)` metadata the
validator and docgen read, so the section is declared once, here; `schema.py` composes it into the actor,
reference, critic and reward-model sections. Keys only some roles hold (the reward model has no optimizer)
are `optional`. Upstream's base `EngineConfig` keys that its newer engine workers read (micro-batch sizes,
`use_dynamic_bsz`, ...) are not fields here: the role sections hold them, and the YAML does not repeat them.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.workers.config._fields import _SPEED, ENGINE_DTYPES, IGNORED, UNSUPPORTED, doc

__all__ = ["McoreEngineConfig"]


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
class McoreEngineConfig(BaseConfig):
    """Megatron-core parallelism of one model (read when its `strategy` is megatron; docs/megatron.md)."""

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
        "Expert parallelism (mixture-of-experts).", status=UNSUPPORTED, neutral=1, default=1
    )
    expert_tensor_parallel_size: int | None = doc(
        "Tensor parallelism inside experts (mixture-of-experts).", status=UNSUPPORTED, neutral=(None, 1), default=None
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
        "same results); needs tensor_model_parallel_size > 1 (ignored otherwise). Runs without TransformerEngine or "
        "apex.",
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
        "GPTModel constructor overrides.", status=UNSUPPORTED, neutral={}, optional=True, default_factory=dict
    )
    use_mbridge: bool = doc(
        "Convert HF weights with the mbridge package; here verl's own converter (verl.models.mcore) builds the same "
        "Megatron weights either way.",
        status=IGNORED,
        default=True,
    )
    vanilla_mbridge: bool = doc("mbridge's implementation switch (see use_mbridge).", status=IGNORED, default=True)
    use_remove_padding: bool = doc(f"Pack sequences without padding. {_SPEED}.", status=IGNORED, default=True)
    forward_only: bool = doc("Build the model for inference only.", status=IGNORED, optional=True, default=False)
    dtype: str = doc(
        "Compute dtype of the Megatron model (mixed precision: parameters, gradients and Adam state stay fp32, "
        "the forward runs under autocast in this dtype; fp16 only for frozen models). auto (ours): bfloat16 on GPU, "
        "float32 on CPU.",
        choices=ENGINE_DTYPES,
        default="bfloat16",
    )

    def __post_init__(self):
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
