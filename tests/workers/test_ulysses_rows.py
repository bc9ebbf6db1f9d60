"""The sp group's row exchange on 2 real gloo ranks: `gather` equals concatenating every rank's chunk
(built independently on each rank from the same seed), bit for bit, for every dtype the batches
carry, uneven row counts included; `own` returns exactly the rows a rank was sent."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import run_distributed
from verl.protocol import DataProto
from verl.workers.ulysses_rows import UlyssesRows, gather_tensors


def _chunk(rank: int, rows: int) -> DataProto:
    g = torch.Generator().manual_seed(100 + rank)
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 50_000, (rows, 7), generator=g),
            "attention_mask": torch.rand(rows, 7, generator=g) > 0.3,
            "old_log_probs": torch.randn(rows, 5, generator=g, dtype=torch.float64),
            "advantages": torch.randn(rows, 5, generator=g).to(torch.bfloat16),
            "scores": torch.randn(rows, generator=g, dtype=torch.float16),
            "pixel": torch.randint(0, 255, (rows, 2, 3), generator=g, dtype=torch.uint8),
            "index": torch.arange(rows, dtype=torch.int32) + 1000 * rank,
        },
        non_tensors={"uid": np.array([f"r{rank}-{i}" for i in range(rows)], dtype=object)},
        meta_info={"temperature": 0.7},
    )


def _gather_equals_concat(rank, world_size, rows_per_rank):
    rows = UlyssesRows(world_size, "actor_rollout_ref.actor.ulysses_sequence_parallel_size")
    mine = _chunk(rank, rows_per_rank[rank])
    merged = rows.gather(mine)
    expected = DataProto.concat([_chunk(r, n) for r, n in enumerate(rows_per_rank)])
    assert len(merged) == sum(rows_per_rank)
    assert set(merged.batch.keys()) == set(expected.batch.keys())
    for key, value in expected.batch.items():
        got = merged.batch[key]
        assert got.dtype == value.dtype and got.shape == value.shape, (key, got.dtype, got.shape)
        assert torch.equal(got, value), key
    assert merged.non_tensor_batch["uid"].tolist() == expected.non_tensor_batch["uid"].tolist()
    assert merged.meta_info == {"temperature": 0.7}
    back = rows.own(merged)
    assert len(back) == rows_per_rank[rank]
    for key, value in mine.batch.items():
        assert torch.equal(back.batch[key], value), key
    assert back.non_tensor_batch["uid"].tolist() == mine.non_tensor_batch["uid"].tolist()


@pytest.mark.parametrize("rows_per_rank", [(3, 3), (4, 1), (0, 2)])
def test_gather_equals_the_concatenated_chunks_and_own_returns_the_rank_s_rows(rows_per_rank):
    run_distributed(_gather_equals_concat, 2, rows_per_rank)


def _mismatched_layouts(rank, world_size):
    group = dist.new_group([0, 1])
    tensors = {"x": torch.zeros(2, 3 + rank)}  # ranks disagree on the width
    with pytest.raises(RuntimeError, match="different batch layouts"):
        gather_tensors(tensors, 2, group)


def test_ranks_with_different_layouts_fail_instead_of_exchanging_garbage():
    run_distributed(_mismatched_layouts, 2)
