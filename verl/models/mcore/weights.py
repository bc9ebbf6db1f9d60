"""Weight conversion between HF Qwen2/Llama checkpoints and megatron-core GPTModel shards.

Two directions, both exact (pure reshapes, concatenations and slices; no arithmetic):
- `hf_to_mcore_state_dict`: the megatron parameters one (tp_rank, pp_rank, vp_stage) holds, cut
  from a full HF state dict. Every rank reads the HF checkpoint itself at start-up and keeps only
  its shard; nothing is communicated.
- `mcore_to_hf_named_tensors`: a generator of (HF name, full tensor) for the rollout engine's
  `update_weights` and the model merger. Each tensor is all-gathered over the tensor-parallel
  group on the pipeline stage that owns it, then broadcast over the pipeline group, so every rank
  sees the same stream and at most one full layer weight exists at a time. Shapes follow from the
  HF config, so no metadata is exchanged.

Megatron's layouts (local spec):
- `linear_qkv` fuses q, k and v per query group: for each of the G groups, the group's
  `heads/G` query heads, then its key head, then its value head (each `head_dim` rows). Tensor
  parallelism splits the fused rows into contiguous chunks, i.e. by whole groups.
- `linear_fc1` fuses [gate; up] per tensor-parallel rank: rank r holds gate's r-th row chunk
  followed by up's r-th row chunk (not a split of the concatenation).
- Embedding and LM head are split by vocabulary rows (padded to a multiple of tp; padded rows
  are zero and are dropped on the way back). With tied embeddings and pp > 1, the last stage keeps
  its own copy of the embedding as the LM head (megatron keeps the copies equal by all-reducing
  their gradients); the way back yields only `model.embed_tokens.weight` then, as HF saves it.
- Qwen3-MoE experts: HF's 3-D `experts.gate_up_proj` / `experts.down_proj` are split by whole
  experts over the expert-parallel ranks (`local_experts.j` is global expert ep_rank * E/ep + j)
  and each expert's MLP over the expert-tensor ranks like a dense MLP; the router is replicated.
- DeepSeek-V3: latent attention (`verl.models.mcore.deepseek`), the router's correction bias
  (a buffer, replicated), shared experts split like a dense MLP, dense MLPs in the first layers.
- gpt-oss (`verl.models.mcore.gpt_oss`): the attention sinks (`core_attention.softmax_offset`, split
  by heads like q), q/k/v and o_proj biases (o_proj's whole on every tensor rank), the router's bias,
  and experts whose HF `gate_up_proj` [E, H, 2I] interleaves gate and up columns, with biases.
- Layer names are local to a stage (`decoder.layers.0` on every stage); the global layer index
  comes from megatron's layer offset for (pp_rank, vp_stage).
- With LoRA adapters (`verl.models.mcore.lora`) the way back yields each adapted weight merged
  with its adapter: the rollout engine and HF exports see one plain model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from verl.models.mcore.config import padded_vocab_size
from verl.models.mcore.deepseek import deepseek_attention_to_hf, deepseek_attention_to_mcore, is_moe_layer
from verl.models.mcore.gpt_oss import experts_to_hf as gpt_oss_experts_to_hf
from verl.models.mcore.gpt_oss import experts_to_mcore as gpt_oss_experts_to_mcore
from verl.models.mcore.lora import export_parameters

__all__ = ["hf_to_mcore_state_dict", "load_hf_state_dict", "mcore_to_hf_named_tensors", "layer_owners"]

_LAYER_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
# Qwen3's per-head query/key norms (megatron: qk_layernorm)
_QK_NORMS = {"q_layernorm.weight": "q_norm.weight", "k_layernorm.weight": "k_norm.weight"}


def _layer_range(tf_config, pp_rank: int, vp_stage: int | None) -> range:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(tf_config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(tf_config, vp_stage=vp_stage, pp_rank=pp_rank))


def _stage_roles(tf_config, pp_rank: int, vp_stage: int | None) -> tuple[bool, bool]:
    """(pre_process, post_process) of one model chunk."""
    pp = tf_config.pipeline_model_parallel_size
    vpp = tf_config.virtual_pipeline_model_parallel_size or 1
    first = pp_rank == 0 and (vp_stage or 0) == 0
    last = pp_rank == pp - 1 and (vp_stage or 0) == vpp - 1
    return first, last


def layer_owners(tf_config) -> dict[int, tuple[int, int | None, int]]:
    """Global layer index -> (pp_rank, vp_stage, local index in that chunk's decoder)."""
    owners = {}
    vpp = tf_config.virtual_pipeline_model_parallel_size
    for pp_rank in range(tf_config.pipeline_model_parallel_size):
        for vp_stage in range(vpp) if vpp else [None]:
            for local, layer in enumerate(_layer_range(tf_config, pp_rank, vp_stage)):
                owners[layer] = (pp_rank, vp_stage, local)
    return owners


def _shape(hf_config):
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, groups, head_dim


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config) -> torch.Tensor:
    """HF q/k/v (weights [out, H] or biases [out]) -> megatron's group-major fused rows."""
    heads, groups, head_dim = _shape(hf_config)
    tail = q.shape[1:]
    q = q.reshape(groups, heads // groups * head_dim, *tail)
    k = k.reshape(groups, head_dim, *tail)
    v = v.reshape(groups, head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(fused: torch.Tensor, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, groups, head_dim = _shape(hf_config)
    tail = fused.shape[1:]
    per_group = fused.reshape(groups, (heads // groups + 2) * head_dim, *tail)
    q, k, v = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _vocab_rows(weight: torch.Tensor, tp_size: int) -> torch.Tensor:
    """[V, H] -> [V_padded, H] with zero rows appended."""
    padded = padded_vocab_size(weight.shape[0], tp_size)
    if padded == weight.shape[0]:
        return weight
    return torch.cat([weight, weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])])


def hf_to_mcore_state_dict(
    hf_state_dict: dict[str, torch.Tensor],
    hf_config,
    tf_config,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    vp_stage: int | None = None,
    value_head: bool = False,
    ep_rank: int = 0,
    etp_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """The megatron GPTModel parameters (name -> tensor) of one (tp_rank, pp_rank, vp_stage) chunk;
    for a mixture-of-experts model, of expert-parallel rank `ep_rank` and expert-tensor rank `etp_rank`.

    `hf_state_dict` is the full HF state dict (model.* names; `lm_head.weight` optional when the
    embeddings are tied). With `value_head`, `score.weight` (HF token-classification head, [1, H])
    and `score.bias` become the value head, when present.
    """
    if tf_config.tensor_model_parallel_size != tp_size or tf_config.pipeline_model_parallel_size != pp_size:
        raise ValueError(
            f"tf_config was built for tp={tf_config.tensor_model_parallel_size}, "
            f"pp={tf_config.pipeline_model_parallel_size}, not tp={tp_size}, pp={pp_size}"
        )

    def shard(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.chunk(tp_size, dim=dim)[tp_rank].clone()

    def hf(name: str) -> torch.Tensor:
        if name not in hf_state_dict:
            raise KeyError(f"the HF checkpoint has no {name!r}; is it a Qwen2/Llama causal LM?")
        return hf_state_dict[name]

    out: dict[str, torch.Tensor] = {}
    pre_process, post_process = _stage_roles(tf_config, pp_rank, vp_stage)
    # the last stage's MTP layers (verl.models.mcore.mtp) read the embedding there: its own copy
    mtp_stage = post_process and bool(tf_config.mtp_num_layers) and not value_head
    if pre_process or mtp_stage:
        out["embedding.word_embeddings.weight"] = shard(_vocab_rows(hf("model.embed_tokens.weight"), tp_size))
    for local, layer in enumerate(_layer_range(tf_config, pp_rank, vp_stage)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for mcore_name, hf_name in _LAYER_NORMS.items():
            out[dst + mcore_name] = hf(src + hf_name).clone()
        attn = src + "self_attn."
        mlp = src + "mlp."
        if tf_config.multi_latent_attention:
            out.update(deepseek_attention_to_mcore(hf, attn, dst + "self_attention.", hf_config, shard))
        else:
            out.update(_attention_to_mcore(hf, attn, dst + "self_attention.", hf_config, tf_config, shard))
        if is_moe_layer(tf_config, layer):
            if hf_config.model_type == "gpt_oss":
                out.update(gpt_oss_experts_to_mcore(hf, mlp, dst + "mlp.", tf_config, ep_rank, etp_rank))
                continue
            out.update(_experts_to_mcore(hf, mlp, dst + "mlp.", tf_config, ep_rank, etp_rank, shard))
            continue
        gate, up = shard(hf(mlp + "gate_proj.weight")), shard(hf(mlp + "up_proj.weight"))
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[dst + "mlp.linear_fc2.weight"] = shard(hf(mlp + "down_proj.weight"), dim=1)
    if post_process:
        out["decoder.final_layernorm.weight"] = hf("model.norm.weight").clone()
        if value_head:
            for suffix in ("weight", "bias"):
                if f"score.{suffix}" in hf_state_dict:
                    out[f"output_layer.{suffix}"] = hf_state_dict[f"score.{suffix}"].clone()
        elif not hf_config.tie_word_embeddings:
            out["output_layer.weight"] = shard(_vocab_rows(hf("lm_head.weight"), tp_size))
        elif not pre_process and not mtp_stage:  # the last stage's own copy of the tied embedding
            out["output_layer.weight"] = shard(_vocab_rows(hf("model.embed_tokens.weight"), tp_size))
    return out


def _attention_to_mcore(hf, src: str, dst: str, hf_config, tf_config, shard) -> dict[str, torch.Tensor]:
    """One layer's standard attention for this tensor rank: fused q/k/v (and its bias), the output
    projection by columns, Qwen3's q/k norms."""
    out = {}
    qkv = _fuse_qkv(hf(src + "q_proj.weight"), hf(src + "k_proj.weight"), hf(src + "v_proj.weight"), hf_config)
    out[dst + "linear_qkv.weight"] = shard(qkv)
    if tf_config.add_qkv_bias or tf_config.add_bias_linear:
        bias = _fuse_qkv(hf(src + "q_proj.bias"), hf(src + "k_proj.bias"), hf(src + "v_proj.bias"), hf_config)
        out[dst + "linear_qkv.bias"] = shard(bias)
    out[dst + "linear_proj.weight"] = shard(hf(src + "o_proj.weight"), dim=1)
    if tf_config.add_bias_linear:  # added once after the row-parallel reduction: whole on every rank
        out[dst + "linear_proj.bias"] = hf(src + "o_proj.bias").clone()
    if tf_config.softmax_type == "learnable":  # gpt-oss's attention sinks, one per head: split as the heads
        out[dst + "core_attention.softmax_offset"] = shard(hf(src + "sinks"))
    if tf_config.qk_layernorm:
        for mcore_name, hf_name in _QK_NORMS.items():
            out[dst + mcore_name] = hf(src + hf_name).clone()
    return out


def _experts_to_mcore(hf, src: str, dst: str, tf_config, ep_rank: int, etp_rank: int, shard) -> dict[str, torch.Tensor]:
    """One MoE layer: the router (replicated) and this (ep_rank, etp_rank)'s experts; DeepSeek-V3's
    router bias (replicated) and shared experts (split over the tensor group like a dense MLP).

    HF (transformers 5) keeps the experts as 3-D tensors, `experts.gate_up_proj` [E, 2I, H] (gate
    rows, then up rows) and `experts.down_proj` [E, H, I]. Megatron's SequentialMLP holds experts
    `ep_rank * E/ep ...` as `local_experts.j`, each an MLP split over the expert-tensor group like a
    dense MLP is over the tensor group (fc1 = [gate shard; up shard], fc2 by columns).
    """
    experts, ep, etp = (
        tf_config.num_moe_experts,
        tf_config.expert_model_parallel_size,
        tf_config.expert_tensor_parallel_size,
    )
    local = experts // ep
    gate_up, down = hf(src + "experts.gate_up_proj"), hf(src + "experts.down_proj")
    out = {dst + "router.weight": hf(src + "gate.weight").clone()}
    if tf_config.moe_router_score_function == "sigmoid":
        out[dst + "router.expert_bias"] = hf(src + "gate.e_score_correction_bias").clone()
    if tf_config.moe_shared_expert_intermediate_size:
        shared = src + "shared_experts."
        gate, up = shard(hf(shared + "gate_proj.weight")), shard(hf(shared + "up_proj.weight"))
        out[dst + "shared_experts.linear_fc1.weight"] = torch.cat([gate, up])
        out[dst + "shared_experts.linear_fc2.weight"] = shard(hf(shared + "down_proj.weight"), dim=1)
    for j in range(local):
        gate, up = gate_up[ep_rank * local + j].chunk(2)
        name = f"{dst}experts.local_experts.{j}."
        out[name + "linear_fc1.weight"] = torch.cat([gate.chunk(etp)[etp_rank], up.chunk(etp)[etp_rank]]).clone()
        out[name + "linear_fc2.weight"] = down[ep_rank * local + j].chunk(etp, dim=1)[etp_rank].clone()
    return out


def load_hf_state_dict(model_chunks, hf_state_dict: dict[str, torch.Tensor], hf_config, value_head: bool = False):
    """Copy a full HF state dict into this rank's model chunks (ranks from megatron's parallel state).

    Every parameter must be covered (except a value head absent from a causal-LM checkpoint, which
    keeps its initialisation, and the MTP layers, which `mtp_weights.load_mtp_state_dict` loads);
    an unexpected name is an error.
    """
    from megatron.core import parallel_state as mpu

    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    pp_rank, pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
    for chunk_index, chunk in enumerate(model_chunks):
        tf_config = chunk.config
        vp_stage = chunk_index if tf_config.virtual_pipeline_model_parallel_size else None
        shards = hf_to_mcore_state_dict(
            hf_state_dict,
            hf_config,
            tf_config,
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
            vp_stage,
            value_head,
            ep_rank=mpu.get_expert_model_parallel_rank(),
            etp_rank=mpu.get_expert_tensor_parallel_rank(),
        )
        params = dict(chunk.named_parameters())
        params.update({n: b for n, b in chunk.named_buffers() if n.endswith("router.expert_bias")})
        unexpected = sorted(set(shards) - set(params))
        missing = sorted(
            set(params) - set(shards) - ({"output_layer.weight", "output_layer.bias"} if value_head else set())
        )
        missing = [name for name in missing if not name.startswith("mtp.")]  # verl.models.mcore.mtp_weights
        if unexpected or missing:
            raise RuntimeError(f"HF -> megatron conversion mismatch: unexpected {unexpected}, missing {missing}")
        with torch.no_grad():
            for name, tensor in shards.items():
                if params[name].shape != tensor.shape:
                    raise RuntimeError(
                        f"{name}: converted shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor)


def _hf_names_and_shapes(hf_config, value_head: bool):
    """(hf_name, shape, kind, global layer or None) in the order they are streamed."""
    hidden, vocab = hf_config.hidden_size, hf_config.vocab_size
    yield "model.embed_tokens.weight", (vocab, hidden), "embedding", None
    for layer in range(hf_config.num_hidden_layers):
        yield f"model.layers.{layer}.", None, "layer", layer
    yield "model.norm.weight", (hidden,), "final_norm", None
    if value_head:
        yield "score.weight", (1, hidden), "value_head", None
        yield "score.bias", (1,), "value_head", None
    elif not hf_config.tie_word_embeddings:
        yield "lm_head.weight", (vocab, hidden), "lm_head", None


def _tp_gather(local: torch.Tensor, dim: int) -> list[torch.Tensor]:
    from megatron.core import parallel_state as mpu

    tp_size = mpu.get_tensor_model_parallel_world_size()
    if tp_size == 1:
        return [local]
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return parts


def _from_owner(tensor: torch.Tensor | None, owner_pp_rank: int, shape, dtype, device) -> torch.Tensor:
    """Broadcast `tensor` (present on the owning pipeline stage) to every stage."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    group = mpu.get_pipeline_model_parallel_group()
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(tensor, src=dist.get_global_rank(group, owner_pp_rank), group=group)
    return tensor


def mcore_to_hf_named_tensors(model_chunks, hf_config, value_head: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, one tensor at a time, on every rank.

    A collective: every rank of the model-parallel group must iterate the generator to the end
    (or, equivalently, in step). Padded vocabulary rows are removed.
    """
    from megatron.core import parallel_state as mpu

    tf_config = model_chunks[0].config
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    pp_size = tf_config.pipeline_model_parallel_size
    vpp = tf_config.virtual_pipeline_model_parallel_size
    # adapted weights (LoRA) read as their merge with the adapters: what the rollout and HF exports get
    params = [export_parameters(chunk) for chunk in model_chunks]
    # DeepSeek-V3's router bias is a buffer (not trained), exported like a parameter
    buffers = [{n: b for n, b in chunk.named_buffers() if n.endswith("router.expert_bias")} for chunk in model_chunks]
    sample = next(iter(params[0].values()))
    dtype, device = sample.dtype, sample.device
    owners = layer_owners(tf_config)
    heads, groups, head_dim = _shape(hf_config)
    hidden, vocab = hf_config.hidden_size, hf_config.vocab_size

    def emit(name, local_fn, owner, shape, tensor_dtype=None):
        """Gather on the owner stage (local_fn runs only there), then broadcast along the pipeline;
        `tensor_dtype` for a tensor not in the parameters' dtype (the float32 router bias)."""
        full = local_fn() if pp_rank == owner else None
        return name, _from_owner(full, owner, shape, tensor_dtype or dtype, device)

    def vocab_weight(param):
        return lambda: torch.cat(_tp_gather(param.detach(), 0))[:vocab]

    for name, shape, kind, layer in _hf_names_and_shapes(hf_config, value_head):
        if kind == "embedding":
            param = params[0].get("embedding.word_embeddings.weight") if pp_rank == 0 else None
            yield emit(name, vocab_weight(param), 0, shape)
        elif kind in ("final_norm", "lm_head", "value_head"):
            mcore = {"final_norm": "decoder.final_layernorm.weight"}.get(kind, "output_layer." + name.split(".")[-1])
            param = params[-1].get(mcore) if pp_rank == pp_size - 1 else None
            if kind == "lm_head":
                yield emit(name, vocab_weight(param), pp_size - 1, shape)
            else:
                yield emit(name, lambda p=param: p.detach().clone(), pp_size - 1, shape)
        else:
            owner, vp_stage, local = owners[layer]
            chunk_params = params[vp_stage or 0] if vpp else params[0]
            chunk_buffers = buffers[vp_stage or 0] if vpp else buffers[0]
            src = f"decoder.layers.{local}."

            def local_param(suffix, src=src, chunk_params=chunk_params, chunk_buffers=chunk_buffers):
                name = src + suffix
                return (chunk_buffers[name] if name in chunk_buffers else chunk_params[name]).detach()

            dst = name
            for mcore_name, hf_name in _LAYER_NORMS.items():
                yield emit(dst + hf_name, lambda m=mcore_name: local_param(m).clone(), owner, (hidden,))
            if tf_config.multi_latent_attention:
                yield from deepseek_attention_to_hf(dst, local_param, emit, owner, hf_config, _tp_gather)
                yield from _mlp_to_hf(dst, layer, local_param, emit, owner, hf_config, tf_config)
                continue
            qkv_rows = (heads + 2 * groups) * head_dim
            fused = emit(
                None,
                lambda: torch.cat(_tp_gather(local_param("self_attention.linear_qkv.weight"), 0)),
                owner,
                (qkv_rows, hidden),
            )[1]
            for proj, tensor in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(fused, hf_config)):
                yield f"{dst}self_attn.{proj}.weight", tensor.clone()
            if tf_config.add_qkv_bias or tf_config.add_bias_linear:
                fused = emit(
                    None,
                    lambda: torch.cat(_tp_gather(local_param("self_attention.linear_qkv.bias"), 0)),
                    owner,
                    (qkv_rows,),
                )[1]
                for proj, tensor in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(fused, hf_config)):
                    yield f"{dst}self_attn.{proj}.bias", tensor.clone()
            yield emit(
                f"{dst}self_attn.o_proj.weight",
                lambda: torch.cat(_tp_gather(local_param("self_attention.linear_proj.weight"), 1), dim=1),
                owner,
                (hidden, heads * head_dim),
            )
            if tf_config.add_bias_linear:
                yield emit(
                    f"{dst}self_attn.o_proj.bias",
                    lambda: local_param("self_attention.linear_proj.bias").clone(),
                    owner,
                    (hidden,),
                )
            if tf_config.softmax_type == "learnable":
                yield emit(
                    f"{dst}self_attn.sinks",
                    lambda: torch.cat(_tp_gather(local_param("self_attention.core_attention.softmax_offset"), 0)),
                    owner,
                    (heads,),
                )

            if tf_config.qk_layernorm:
                for mcore_name, hf_name in _QK_NORMS.items():
                    yield emit(
                        f"{dst}self_attn.{hf_name}",
                        lambda m=mcore_name: local_param("self_attention." + m).clone(),
                        owner,
                        (head_dim,),
                    )
            yield from _mlp_to_hf(dst, layer, local_param, emit, owner, hf_config, tf_config)


def _mlp_to_hf(dst: str, layer: int, local_param, emit, owner: int, hf_config, tf_config):
    """One layer's MLP as HF names it: routed experts (and shared ones) or a dense MLP."""
    if is_moe_layer(tf_config, layer):
        yield from _experts_to_hf(dst, local_param, emit, owner, hf_config, tf_config)
        shared = tf_config.moe_shared_expert_intermediate_size
        if shared:
            mlp = "mlp.shared_experts."
            yield from _dense_mlp_to_hf(dst + mlp, mlp, local_param, emit, owner, hf_config.hidden_size, shared)
        return
    inter = hf_config.intermediate_size
    yield from _dense_mlp_to_hf(dst + "mlp.", "mlp.", local_param, emit, owner, hf_config.hidden_size, inter)


def _dense_mlp_to_hf(dst: str, src: str, local_param, emit, owner: int, hidden: int, inter: int):
    """A tensor-parallel gated MLP (`src` linear_fc1/linear_fc2; model size `hidden`, MLP size
    `inter`) as HF's gate/up/down projections."""

    def gate_up():
        parts = [p.chunk(2) for p in _tp_gather(local_param(src + "linear_fc1.weight"), 0)]
        return torch.cat([torch.cat([g for g, _ in parts]), torch.cat([u for _, u in parts])])

    fc1 = emit(None, gate_up, owner, (2 * inter, hidden))[1]
    gate, up = fc1.chunk(2)
    yield f"{dst}gate_proj.weight", gate.clone()
    yield f"{dst}up_proj.weight", up.clone()
    yield emit(
        f"{dst}down_proj.weight",
        lambda: torch.cat(_tp_gather(local_param(src + "linear_fc2.weight"), 1), dim=1),
        owner,
        (hidden, inter),
    )


def _experts_to_hf(dst: str, local_param, emit, owner: int, hf_config, tf_config):
    """One MoE layer's router and experts as HF names them (see `_experts_to_mcore`): each expert
    gathered over the expert-tensor group, the local experts stacked and gathered over the
    expert-parallel group, then sent along the pipeline from the owning stage."""
    from megatron.core import parallel_state as mpu

    experts, ep = tf_config.num_moe_experts, tf_config.expert_model_parallel_size

    def ep_gather(local: torch.Tensor) -> torch.Tensor:
        if ep == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(ep)]
        dist.all_gather(parts, local.contiguous(), group=mpu.get_expert_model_parallel_group())
        return torch.cat(parts)

    def etp_gather(local: torch.Tensor, dim: int) -> list[torch.Tensor]:
        group = mpu.get_expert_tensor_parallel_group()
        size = dist.get_world_size(group) if group is not None else 1
        if size == 1:
            return [local]
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return parts

    if hf_config.model_type == "gpt_oss":
        yield from gpt_oss_experts_to_hf(dst, local_param, emit, owner, hf_config, tf_config, ep_gather, etp_gather)
        return
    hidden, inter = hf_config.hidden_size, hf_config.moe_intermediate_size
    yield emit(f"{dst}mlp.gate.weight", lambda: local_param("mlp.router.weight").clone(), owner, (experts, hidden))
    if tf_config.moe_router_score_function == "sigmoid":
        yield emit(
            f"{dst}mlp.gate.e_score_correction_bias",
            lambda: local_param("mlp.router.expert_bias").to(torch.float32, copy=True),
            owner,
            (experts,),
            torch.float32,  # megatron keeps the bias in float32 whatever the parameters' dtype
        )

    def local_experts(suffix: str) -> list[torch.Tensor]:
        return [local_param(f"mlp.experts.local_experts.{j}.{suffix}") for j in range(experts // ep)]

    def gate_up():
        rows = []
        for fc1 in local_experts("linear_fc1.weight"):
            parts = [p.chunk(2) for p in etp_gather(fc1, 0)]
            rows.append(torch.cat([torch.cat([g for g, _ in parts]), torch.cat([u for _, u in parts])]))
        return ep_gather(torch.stack(rows))

    def down():
        return ep_gather(
            torch.stack([torch.cat(etp_gather(fc2, 1), dim=1) for fc2 in local_experts("linear_fc2.weight")])
        )

    yield emit(f"{dst}mlp.experts.gate_up_proj", gate_up, owner, (experts, 2 * inter, hidden))
    yield emit(f"{dst}mlp.experts.down_proj", down, owner, (experts, hidden, inter))
