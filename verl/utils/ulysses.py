"""Ulysses sequence parallelism: the all-to-all that trades a sequence split for a head split.

Each of the `sp` ranks of a sequence-parallel group holds a slice of every sequence with all
attention heads; attention needs the whole sequence, so an all-to-all turns [.., S/sp, H, D]
into [.., S, H/sp, D] before attention and back afterwards. Its backward is the inverse
all-to-all, so gradients flow through it unchanged in value.

gloo (torch >= 2.13) implements `all_to_all_single` on CPU, so no emulation through
all-gather is needed.

Not yet here (work in progress, issue #27 item 1): pad-and-slice of packed inputs, the
gather of outputs, the attention patch and the dp x sp mesh in the workers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.size(scatter_dim) % world:
        raise ValueError(
            f"dimension {scatter_dim} of size {x.size(scatter_dim)} is not divisible by the "
            f"sequence-parallel size {world}; the number of attention heads must be a multiple of "
            "ulysses_sequence_parallel_size"
        )
    # Chunks along scatter_dim go to the ranks in order; received chunks are stacked in rank
    # order along gather_dim, which restores the global sequence order.
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Split `x` along `scatter_dim` across the group's ranks and concatenate what each rank
    receives along `gather_dim` (autograd-aware: the backward is the inverse all-to-all)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)
