"""An uneven all-gather along the first dimension for gloo, which megatron-core needs for
mixture-of-experts layers whose experts are split over expert-tensor ranks.

With `expert_tensor_parallel_size > 1` (e.g. tp=2, ep=2, etp=2 on 4 ranks, or any etp > tp),
megatron-core 0.16's all-to-all token dispatcher gathers the tokens each expert-tensor rank routed
to this rank's experts (`gather_from_sequence_parallel_region(..., output_split_sizes=...)`, in
`dispatch_postprocess`) and, after the experts, reduce-scatters the results back in the same uneven
pieces (`reduce_scatter_to_sequence_parallel_region(..., input_split_sizes=...)`); the backward of
each is the other. The gather calls `torch.distributed.all_gather` with output tensors of different
sizes, which gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected
(12, 256), got (13, 256))"); torch 2.13's gloo `reduce_scatter` takes the uneven list (checked
against a hand-made sum in the tests), so only the gather is replaced.

Design decisions:
- Built from what gloo has: one broadcast from each rank of the group, of its rows, into that
  rank's slice of the output. The result is a copy of each rank's rows in rank order, as megatron's
  gather; only the real rows travel, with no extra copy, in `world` collectives instead of one (the
  expert-tensor group is small). Two other forms were measured on 2 ranks
  (`benchmarks/gloo_uneven_collectives.py`; docs/benchmarks.md): each piece padded to the largest
  for gloo's even `all_gather_into_tensor` was the slowest in every run, and one uneven
  `all_to_all_single` (the rows repeated `world` times in memory) slower in two runs of three.
- Installed by `install_gloo_uneven_all_gather()`, which rebinds megatron's module-level
  `_gather_along_first_dim` in `megatron.core.tensor_parallel.mappings` (its autograd Functions
  look it up by name, so forward and backward both use it). `initialize_model_parallel` installs
  it only when the default process group is gloo; even then a call without split sizes, or on a
  group of another backend, goes to megatron's own helper unchanged.
- All ranks of the group hold the same split sizes (megatron gathers the token counts first), so
  an all-zero split skips the collective on every rank alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_gather_uneven", "install_gloo_uneven_all_gather"]


def _as_ints(sizes) -> list[int]:
    return [int(n) for n in sizes]


def all_gather_uneven(input_: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """Concatenate along dim 0 every rank's `input_`, rank r's holding `sizes[r]` rows.

    input_: [sizes[rank], *rest] -> [sum(sizes), *rest], in rank order; `sizes` equal on every rank.
    One broadcast per rank with rows to send, each straight into its slice of the output.
    """
    sizes = _as_ints(sizes)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or input_.shape[0] != sizes[rank]:
        raise ValueError(
            f"all_gather_uneven: rank {rank} holds {input_.shape[0]} rows but the split sizes {sizes} give it "
            f"{sizes[rank] if rank < len(sizes) else 'none'} over a group of {world} ranks"
        )
    output = input_.new_empty((sum(sizes), *input_.shape[1:]))
    pieces = torch.split(output, sizes)  # views of `output` along dim 0, so each is contiguous
    pieces[rank].copy_(input_)
    for source, piece in enumerate(pieces):
        if sizes[source]:
            dist.broadcast(piece, src=dist.get_global_rank(group, source), group=group)
    return output


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def install_gloo_uneven_all_gather() -> None:
    """Route megatron's uneven first-dimension all-gather on gloo groups through `all_gather_uneven`
    (see the module docstring). Idempotent."""
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim
    if getattr(gather, "_verl_gloo_uneven", False):
        return

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return all_gather_uneven(input_.contiguous(), output_split_sizes, group)

    gather_along_first_dim._verl_gloo_uneven = True
    mappings._gather_along_first_dim = gather_along_first_dim
