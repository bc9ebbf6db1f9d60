"""verl.utils.process_groups: blocks of consecutive ranks, on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import run_distributed
from verl.utils.process_groups import consecutive_rank_group


def _blocks_of_two(rank: int, world_size: int) -> None:
    group, local = consecutive_rank_group(2, "x.size")
    assert local == rank % 2
    assert dist.get_process_group_ranks(group) == [rank - rank % 2, rank - rank % 2 + 1]
    # a collective over the group sums only the block's ranks: 0+1 and 2+3
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=group)
    assert value.item() == (1.0 if rank < 2 else 5.0)
    with pytest.raises(ValueError, match=r"^x.size=3 does not divide the 4 workers; use a divisor of 4$"):
        consecutive_rank_group(3, "x.size")


def test_four_ranks_form_two_blocks_of_consecutive_ranks():
    run_distributed(_blocks_of_two, 4)


def test_size_one_needs_no_group_and_larger_sizes_need_torch_distributed():
    assert consecutive_rank_group(1, "x.size") == (None, 0)
    with pytest.raises(ValueError, match="x.size=0 must be at least 1"):
        consecutive_rank_group(0, "x.size")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="x.size=2 needs the workers' torch.distributed group"):
        consecutive_rank_group(2, "x.size")
