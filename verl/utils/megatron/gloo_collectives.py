"""Uneven all-gather and reduce-scatter along the first dimension for gloo, where megatron-core
needs them for mixture-of-experts layers split over expert-tensor ranks.

With `expert_tensor_parallel_size > 1` and expert parallelism (e.g. tp=2, ep=2, etp=2 on 4 ranks),
megatron-core 0.16's all-to-all token dispatcher gathers the tokens each expert-tensor rank routed
to this rank's experts (`gather_from_sequence_parallel_region(..., output_split_sizes=...)`) and,
after the experts, reduce-scatters the results back in the same uneven pieces
(`reduce_scatter_to_sequence_parallel_region(..., input_split_sizes=...)`). Those helpers call
`torch.distributed.all_gather` with a list of tensors of different sizes and
`torch.distributed.reduce_scatter` with a list input: NCCL takes both, gloo refuses the first
("ProcessGroupGloo::allgather: invalid tensor size") and has no list reduce-scatter. The backward
of each is the other, so training needs both.

Design decisions:
- The same collectives from what gloo has: each piece is padded to the largest one, the padded
  pieces go through gloo's even `all_gather_into_tensor` / `reduce_scatter_tensor`, and the pieces
  are cut back out. The arithmetic is megatron's (a copy for the gather, one sum per element for the
  reduce-scatter); only the bytes moved grow, from `sum(sizes)` to `world x max(sizes)` rows.
- Installed by `install_gloo_uneven_collectives()`, which rebinds megatron's two module-level helpers
  in `megatron.core.tensor_parallel.mappings` (its autograd Functions look them up by name, so
  forward and backward both use them). `initialize_model_parallel` installs it only when the
  default process group is gloo; even on gloo a call without split sizes, or on a group of
  another backend, goes to megatron's own helper unchanged.
- All ranks of the group hold the same split sizes (megatron gathers the token counts first), so
  an all-zero split skips the collective on every rank alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_gather_uneven", "install_gloo_uneven_collectives", "reduce_scatter_uneven"]


def _as_ints(sizes) -> list[int]:
    return [int(n) for n in sizes]


def all_gather_uneven(input_: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """Concatenate along dim 0 every rank's `input_`, rank r's holding `sizes[r]` rows.

    input_: [sizes[rank], *rest] -> [sum(sizes), *rest], in rank order; `sizes` equal on every rank.
    """
    sizes = _as_ints(sizes)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or input_.shape[0] != sizes[rank]:
        raise ValueError(
            f"all_gather_uneven: rank {rank} holds {input_.shape[0]} rows but the split sizes {sizes} give it "
            f"{sizes[rank] if rank < len(sizes) else 'none'} over a group of {world} ranks"
        )
    rest = tuple(input_.shape[1:])
    largest = max(sizes)
    if largest == 0:
        return input_.new_empty((0, *rest))
    padded = input_.new_zeros((largest, *rest))
    padded[: sizes[rank]] = input_
    gathered = input_.new_empty((world * largest, *rest))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return torch.cat([gathered[r * largest : r * largest + n] for r, n in enumerate(sizes)])


def reduce_scatter_uneven(input_: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """Sum `input_` over the ranks and keep this rank's piece: rows [offset_r, offset_r + sizes[r]).

    input_: [sum(sizes), *rest] on every rank -> [sizes[rank], *rest]; `sizes` equal on every rank.
    """
    sizes = _as_ints(sizes)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or input_.shape[0] != sum(sizes):
        raise ValueError(
            f"reduce_scatter_uneven: {input_.shape[0]} rows cannot be split into {sizes} over a group of {world} ranks"
        )
    rest = tuple(input_.shape[1:])
    largest = max(sizes)
    if largest == 0:
        return input_.new_empty((0, *rest))
    padded = input_.new_zeros((world, largest, *rest))
    for r, piece in enumerate(torch.split(input_, sizes)):
        padded[r, : sizes[r]] = piece
    mine = input_.new_empty((largest, *rest))
    dist.reduce_scatter_tensor(mine, padded.reshape(world * largest, *rest), group=group)
    return mine[: sizes[rank]]


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def install_gloo_uneven_collectives() -> None:
    """Route megatron's uneven first-dimension all-gather and reduce-scatter on gloo groups through
    the padded forms above (see the module docstring). Idempotent."""
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings._gather_along_first_dim, "_verl_gloo_uneven", False):
        return
    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return all_gather_uneven(input_.contiguous(), output_split_sizes, group)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        return reduce_scatter_uneven(input_.contiguous(), input_split_sizes, group)

    gather_along_first_dim._verl_gloo_uneven = True
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
