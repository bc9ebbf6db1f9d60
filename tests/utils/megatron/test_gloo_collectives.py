"""The uneven first-dimension all-gather that megatron's MoE token dispatcher needs at expert-tensor
parallel > 1 (gloo refuses megatron's own): on 3 gloo ranks with split sizes 3, 0, 5 it equals a
float64 reference built by hand, directly and through megatron's autograd functions once
`initialize_model_parallel` has installed it; their uneven reduce-scatter (gloo's own, the gather's
backward) equals its reference too; the same check fails for a gather that cuts the pieces at the
wrong offsets."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed

SIZES = [3, 0, 5]  # rows per rank; the middle rank sends and receives nothing
OFFSETS = [0, 3, 3]  # where each rank's rows start in the concatenation, by hand
HIDDEN = 4


def _piece(rank: int) -> torch.Tensor:
    """Rank `rank`'s rows for the gather: [SIZES[rank], HIDDEN], values unique to (rank, row, column)."""
    rows = torch.arange(SIZES[rank], dtype=torch.float64)[:, None]
    return 100.0 * (rank + 1) + 10.0 * rows + torch.arange(HIDDEN, dtype=torch.float64)


def _full(rank: int) -> torch.Tensor:
    """Rank `rank`'s whole input to the reduce-scatter: [sum(SIZES), HIDDEN]."""
    rows = torch.arange(sum(SIZES), dtype=torch.float64)[:, None]
    return (rank + 1) * (rows + 1) + 0.5 * rank * torch.arange(HIDDEN, dtype=torch.float64)


def _check_gather(gather, rank, group) -> None:
    """`gather` (a function of (tensor, sizes, group)) against the hand-made reference on this rank."""
    gathered = gather(_piece(rank), SIZES, group)
    want = torch.cat([_piece(0), _piece(1), _piece(2)])
    assert gathered.shape == (8, HIDDEN)
    torch.testing.assert_close(gathered, want, atol=0, rtol=0)
    # row 4 of the concatenation is rank 2's second row (rank 1 sends none)
    assert gathered[4, 0].item() == 310.0


def _wrong_offsets_gather(input_, sizes, group):
    """A mutant: every rank's rows gathered padded to the largest piece, then read back-to-back from
    the padded buffer (the padding's offsets ignored)."""
    import torch.distributed as dist

    largest, world, rank = max(sizes), dist.get_world_size(group), dist.get_rank(group)
    padded = input_.new_zeros((largest, *input_.shape[1:]))
    padded[: sizes[rank]] = input_
    gathered = input_.new_empty((world * largest, *input_.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return gathered[: sum(sizes)]


def _check_uneven_collectives(rank, world_size):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import mappings

    from verl.utils.megatron.gloo_collectives import all_gather_uneven
    from verl.utils.megatron.parallel_state import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = mpu.get_tensor_model_parallel_group()
    _check_gather(all_gather_uneven, rank, group)

    # megatron's autograd functions now take uneven sizes on gloo: the gather's backward
    # reduce-scatters the gradient (gloo's own uneven reduce-scatter), the reduce-scatter's backward
    # gathers it
    weight = [_full(r) * 0.25 for r in range(world_size)]  # rank r's loss is sum(output * weight[r])
    x = _piece(rank).requires_grad_(True)
    out = mappings.gather_from_sequence_parallel_region(x, group=group, output_split_sizes=SIZES)
    torch.testing.assert_close(out.detach(), torch.cat([_piece(r) for r in range(world_size)]), atol=0, rtol=0)
    (out * weight[rank]).sum().backward()
    want_grad = sum(weight)[OFFSETS[rank] : OFFSETS[rank] + SIZES[rank]]
    torch.testing.assert_close(x.grad, want_grad, atol=0, rtol=0)

    y = _full(rank).requires_grad_(True)
    mine = mappings.reduce_scatter_to_sequence_parallel_region(y, group=group, input_split_sizes=SIZES)
    total = sum(_full(r) for r in range(world_size))
    torch.testing.assert_close(mine.detach(), total[OFFSETS[rank] : OFFSETS[rank] + SIZES[rank]], atol=0, rtol=0)
    (mine * _piece(rank)).sum().backward()  # each row's gradient is the piece of the rank that kept it
    torch.testing.assert_close(y.grad, torch.cat([_piece(r) for r in range(world_size)]), atol=0, rtol=0)

    # split sizes that do not match the group: an error on every rank, before any collective
    with pytest.raises(ValueError, match=r"split sizes \[3, 5\] give it"):
        all_gather_uneven(_piece(rank), [3, 5], group)

    # the reference is strict enough to catch pieces cut at the wrong offsets
    with pytest.raises(AssertionError):
        _check_gather(_wrong_offsets_gather, rank, group)


def test_uneven_all_gather_and_reduce_scatter_equal_a_hand_made_reference_on_gloo():
    run_distributed(_check_uneven_collectives, 3)
