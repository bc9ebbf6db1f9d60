"""Upstream's megatron model helpers (`verl.utils.megatron_utils`) for hand-built megatron models.

Upstream's recipes (GKD) build their actor with `get_model` (a model-provider function, wrapped
in megatron's `Float16Module` and `DistributedDataParallel`), step it with megatron's optimizer
(`verl.utils.megatron.optimizer`) and gather tensor-parallel shards back to full weights with
`default_tp_concat_fn`. verl's own megatron engine (`verl.workers.engine.megatron`) builds plain
chunks instead (`verl.models.mcore.build_model_chunks`, which also serves as a model provider
here) and converts weights with `verl.models.mcore.mcore_to_hf_named_tensors`.

Importing this module imports megatron-core.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from megatron.core import ModelParallelConfig, tensor_parallel
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_attr_wrapped_model

from verl.utils import device as dev
from verl.utils.megatron.tensor_parallel import get_tensor_parallel_partition_dim

__all__ = [
    "ALL_MODULE_WRAPPER_CLASSNAMES",
    "default_tp_concat_fn",
    "get_model",
    "get_model_config",
    "mcore_model_parallel_config",
    "unwrap_model",
]

ALL_MODULE_WRAPPER_CLASSNAMES = (DDP, Float16Module)


def get_model_config(model):
    """The `config` (megatron's TransformerConfig) of `model`, looked up through its wrappers."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def unwrap_model(model, module_instances=ALL_MODULE_WRAPPER_CLASSNAMES):
    """`model` (or each chunk of a list) without its `module_instances` wrappers (DDP, Float16Module)."""
    chunks = model if isinstance(model, list) else [model]
    unwrapped = []
    for chunk in chunks:
        while isinstance(chunk, module_instances):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped if isinstance(model, list) else unwrapped[0]


def _build_chunks(model_provider_func, model_type) -> list:
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    if mpu.get_pipeline_model_parallel_world_size() > 1 and vpp is not None:
        if model_type == ModelType.encoder_and_decoder:
            raise ValueError("get_model: the interleaved pipeline schedule does not support encoder-and-decoder models")
        takes_vp_stage = "vp_stage" in inspect.signature(mpu.is_pipeline_first_stage).parameters
        chunks = []
        for stage in range(vpp):
            mpu.set_virtual_pipeline_model_parallel_rank(stage)
            where = {"ignore_virtual": False, "vp_stage": stage} if takes_vp_stage else {}
            chunks.append(
                model_provider_func(
                    pre_process=mpu.is_pipeline_first_stage(**where),
                    post_process=mpu.is_pipeline_last_stage(**where),
                    vp_stage=stage,
                )
            )
        mpu.set_virtual_pipeline_model_parallel_rank(0)
    else:
        if model_type == ModelType.encoder_and_decoder:
            raise ValueError("get_model: encoder-and-decoder models are not supported (as upstream's)")
        chunks = [
            model_provider_func(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
        ]
    for chunk in chunks:
        chunk.model_type = model_type
    return chunks


def get_model(
    model_provider_func,
    model_type=ModelType.encoder_or_decoder,
    wrap_with_ddp: bool = True,
    use_distributed_optimizer: bool = True,
    transformer_config=None,
    override_ddp_config: dict | None = None,
) -> list:
    """This rank's model chunks from `model_provider_func(pre_process=, post_process=[, vp_stage=])`,
    one per virtual pipeline stage, ready for megatron's optimizer.

    Each chunk gets megatron's default tensor-parallel attributes on every parameter, moves to this
    rank's device (unless `transformer_config.use_cpu_initialization`), is wrapped in
    `Float16Module` when its config says fp16/bf16 (fp8 is switched off), and with `wrap_with_ddp`
    in megatron's DDP (fp32 gradient reduction, no overlap, `use_distributed_optimizer`,
    `override_ddp_config` on top) with its parameters broadcast from the data-parallel source rank.
    Only the first chunk's DDP uses gradient buckets, as upstream."""
    chunks = _build_chunks(model_provider_func, model_type)
    for chunk in chunks:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if mpu.get_data_parallel_rank() == 0:
        num_params = sum(p.nelement() for chunk in chunks for p in chunk.parameters())
        print(
            f" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({mpu.get_tensor_model_parallel_rank()}, {mpu.get_pipeline_model_parallel_rank()}): {num_params}",
            flush=True,
        )
    if transformer_config is None or not transformer_config.use_cpu_initialization:
        for chunk in chunks:
            chunk.to(dev.get_device())
    config = get_model_config(chunks[0])
    config.fp8 = None
    tf_config = chunks[0].config
    if config.fp16 or config.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    if not wrap_with_ddp:
        return chunks
    ddp_settings = {"use_distributed_optimizer": use_distributed_optimizer, "grad_reduce_in_fp32": True}
    ddp_settings["overlap_grad_reduce"] = False
    ddp_settings.update(override_ddp_config or {})
    ddp_config = DistributedDataParallelConfig(**ddp_settings)
    wrapped = [
        DDP(config=tf_config, module=chunk, disable_bucketing=index > 0, ddp_config=ddp_config)
        for index, chunk in enumerate(chunks)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def mcore_model_parallel_config(sequence_parallel: bool, params_dtype: torch.dtype) -> ModelParallelConfig:
    """Deprecated upstream: a bf16 `ModelParallelConfig` with this process's megatron layout.
    Build a model's config with `verl.models.mcore.hf_to_mcore_config` instead."""
    warnings.warn(
        "mcore_model_parallel_config is deprecated (as upstream's); use verl.models.mcore.hf_to_mcore_config",
        DeprecationWarning,
        stacklevel=2,
    )
    return ModelParallelConfig(
        tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=mpu.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=mpu.get_context_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=True,
        fp16=False,
        timers=None,
    )


def _matches(layer_name_mapping: dict, key: str, name: str) -> bool:
    pattern = layer_name_mapping.get(key)
    return pattern is not None and pattern in name


def _merge_qkv(name, shards, model_config, hf_config, split: bool):
    """Per query group, megatron's fused rows are [q heads of the group; k; v] and each tensor-parallel
    shard holds whole groups: regroup all shards' q, k and v rows."""
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    if "vision_model" in name:
        heads = kv_heads = hf_config.vision_config.num_heads
    if heads % kv_heads:
        raise ValueError(f"{name}: {heads} attention heads are not a multiple of {kv_heads} key/value heads")
    q_per_kv = heads // kv_heads
    rows = shards[0].shape[0]
    if rows % (q_per_kv + 2):
        raise ValueError(f"param '{name}' shape '{tuple(shards[0].shape)}' dim0 is not divisible by {q_per_kv + 2}")
    groups_per_shard = kv_heads // len(shards)
    head_rows = rows // groups_per_shard // (q_per_kv + 2)
    q, k, v = [], [], []
    for shard in shards:
        for group in shard.chunk(groups_per_shard):
            q_rows, k_rows, v_rows = group.split([q_per_kv * head_rows, head_rows, head_rows])
            q.append(q_rows)
            k.append(k_rows)
            v.append(v_rows)
    q, k, v = torch.cat(q), torch.cat(k), torch.cat(v)
    return [q, k, v] if split else torch.cat((q, k, v))


def default_tp_concat_fn(
    layer_name_mapping: dict,
    name: str,
    train_params,
    infer_params,
    model_config,
    hf_config=None,
    convert_qkv_gate_up_by_simple_split: bool = False,
):
    """The full tensor of parameter `name` from its tensor-parallel shards `infer_params` (rank order).

    - fused q/k/v (`layer_name_mapping["qkv_layer_name"]` in `name`, not a layer norm): the rows
      regrouped to [all q; all k; all v] (`model_config` gives the head counts; a vision tower's
      come from `hf_config.vision_config.num_heads`);
    - fused gate/up (`layer_name_mapping["gate_proj_layer_name"]`, not a norm nor the vision
      projection): each shard is [gate part; up part], giving [all gate; all up];
    - MoE `mlp.experts.linear_fc2.weight`: concatenated along dim 1;
    - anything else: along the partition dim megatron recorded on `train_params`.
    With `convert_qkv_gate_up_by_simple_split` the fused cases return the parts as a list
    ([q, k, v] or [gate, up]) instead of their concatenation."""
    split = convert_qkv_gate_up_by_simple_split
    if _matches(layer_name_mapping, "qkv_layer_name", name) and "layer_norm" not in name:
        return _merge_qkv(name, infer_params, model_config, hf_config, split)
    if (
        _matches(layer_name_mapping, "gate_proj_layer_name", name)
        and "layer_norm" not in name
        and "vision_model.projection" not in name
    ):
        halves = [shard.chunk(2) for shard in infer_params]
        gate = torch.cat([h[0] for h in halves])
        up = torch.cat([h[1] for h in halves])
        return [gate, up] if split else torch.cat((gate, up))
    if "mlp.experts.linear_fc2.weight" in name:
        return torch.cat(infer_params, dim=1)
    return torch.cat(infer_params, dim=get_tensor_parallel_partition_dim(train_params))
