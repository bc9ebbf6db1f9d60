"""Context parallelism without TransformerEngine: one sequence split over `context_parallel_size` ranks.

Megatron's own (local) attention refuses `context_parallel_size > 1`; only TransformerEngine's
ring attention implements it, and TransformerEngine is GPU-only. This module gives the local
layer spec a core attention that does, so the same model runs context-parallel on CPU (gloo)
and on GPUs without TransformerEngine.

Design decisions:
- Layout: megatron's load-balanced one (`verl.utils.megatron.sequence_layout`). The sequence (padded to a multiple of `2 * cp`) is cut
  into `2 * cp` equal chunks and rank r holds chunks r and `2cp - 1 - r`, so every rank gets the
  same share of the causal mask's work. It is the layout megatron's rotary embedding assumes
  (`get_pos_emb_on_this_cp_rank`), so the model's rotary positions need no change.
- Attention: all-gather of keys and values over the context-parallel group (the all-gather form
  of context parallelism; Llama 3's training used it), then each rank attends its own queries to
  the whole sequence under a causal mask on global positions (torch's scaled_dot_product_attention,
  which picks a memory-efficient kernel where one exists). Keys and values are the small
  tensors under grouped-query attention (they are gathered before the heads are repeated), and
  activation memory for queries, MLPs and logits is still split `cp` ways. A ring (p2p) exchange
  would overlap communication with compute on a GPU; on CPU it would only add steps.
- Autograd: the gather's backward sums each rank's columns of the gradient over the group (one
  reduce-scatter, which gloo and NCCL both have). Every
  context-parallel rank computes the loss on the gathered per-token values, so each rank's
  gradients are `cp` times its share; averaging them over the data x context group (megatron's
  `get_data_parallel_group(with_context_parallel=True)`) gives the exact gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

from verl.utils.megatron.sequence_layout import own_chunks, split_sequence

__all__ = [
    "ContextParallelAttention",
    "context_parallel_group",
    "gather_sequence",
    "split_sequence",
]


def context_parallel_group():
    """(group, size, rank) of megatron's context-parallel group; (None, 1, 0) when not split."""
    from megatron.core import parallel_state as mpu

    size = mpu.get_context_parallel_world_size()
    if size == 1:
        return None, 1, 0
    return mpu.get_context_parallel_group(), size, mpu.get_context_parallel_rank()


def global_positions(local_length: int, size: int, rank: int, device=None) -> torch.Tensor:
    """Positions in the whole sequence of this rank's `local_length` columns."""
    return split_sequence(torch.arange(local_length * size, device=device), 0, size, rank)


def _reassemble(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Rank-ordered local parts (each chunks r, 2cp-1-r) -> the sequence in order."""
    size = len(parts)
    chunks = [None] * (2 * size)
    for rank, part in enumerate(parts):
        first, second = own_chunks(size, rank)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group):
        ctx.dim, ctx.group = dim, group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return _reassemble(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        group, dim = ctx.group, ctx.dim
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        # every rank's columns, stacked in rank order; each rank receives the sum of its own
        stacked = torch.stack([split_sequence(grad, dim, size, r) for r in range(size)])
        mine = torch.empty(stacked[rank].numel(), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(mine, stacked.reshape(-1), group=group)  # flat: gloo wants a concatenation
        return mine.view(stacked.shape[1:]), None, None


def gather_sequence(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The whole sequence along `dim` from every rank's part (autograd-aware; identity without a group)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return _GatherSequence.apply(tensor, dim, group)


class ContextParallelAttention(MegatronModule):
    """Causal core attention over a context-parallel sequence (see the module docstring).

    Takes megatron's core-attention arguments: query [sq, b, np, hn], key and value [sq, b, ng, hn]
    for this rank's sq = S / cp columns; returns the context [sq, b, np * hv] (hv: the value head
    size, which multi-head latent attention makes differ from hn). Causal self-attention only,
    without packed sequences or attention bias, like megatron's local `DotProductAttention` it
    stands in for; at cp=1 it is also the core attention of `verl.models.mcore.deepseek`'s MLA.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.utils import divide

        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal or attention_type != "self":
            raise NotImplementedError(
                f"context-parallel attention implements causal self-attention only, got {attn_mask_type} "
                f"{attention_type}"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError(
                f"context-parallel attention has no attention dropout (got {dropout}); set it to 0"
            )
        from megatron.core import parallel_state as mpu

        tp = mpu.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        # multi-head latent attention passes its query/key and value head sizes (they differ)
        self.head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        if config.apply_query_key_layer_scaling:
            raise NotImplementedError("context-parallel attention does not implement apply_query_key_layer_scaling")

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("context-parallel attention takes neither packed sequences nor attention bias")
        group, size, rank = context_parallel_group()
        key = gather_sequence(key, 0, group)
        value = gather_sequence(value, 0, group)
        local, batch = query.shape[0], query.shape[1]
        q_pos = global_positions(local, size, rank, device=query.device)
        k_pos = torch.arange(key.shape[0], device=query.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [sq, S]
        # [s, b, n, d] -> [b, n, s, d]; grouped-query heads are expanded inside the kernel
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=self.softmax_scale, enable_gqa=self.heads != self.groups
        )  # [b, n, sq, d]
        return context.permute(2, 0, 1, 3).reshape(local, batch, self.heads * value.shape[-1])
