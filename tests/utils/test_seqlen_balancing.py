import random

import pytest
import torch
from tensordict import TensorDict

from verl.utils.seqlen_balancing import (
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    greedy_partition,
    karmarkar_karp,
    rearrange_micro_batches,
)


def part_sums(seqlens, partitions):
    return [sum(seqlens[i] for i in p) for p in partitions]


def test_karmarkar_karp_on_a_hand_worked_example():
    # differencing 8,7,6,5,4: (8,7)->1, (6,5)->1, (4,1)->3, (3,1)->2: final sums 16 and 14
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(part_sums([8, 7, 6, 5, 4], parts)) == [14, 16]


@pytest.mark.parametrize("equal_size", [False, True])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_partitions_cover_every_index_once_and_are_balanced(k, equal_size):
    rng = random.Random(k)
    for _ in range(20):
        n = k * rng.randint(1, 6)
        seqlens = [rng.randint(1, 500) for _ in range(n)]
        parts = get_seqlen_balanced_partitions(seqlens, k, equal_size=equal_size)
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert all(p == sorted(p) and p for p in parts)
        if equal_size:
            assert {len(p) for p in parts} == {n // k}
        sums = part_sums(seqlens, parts)
        # largest differencing never leaves two parts further apart than the longest item
        assert max(sums) - min(sums) <= max(seqlens)


def test_balancing_beats_contiguous_chunks_on_sorted_lengths():
    seqlens = [1000, 900, 800, 700, 100, 90, 80, 70]
    parts = get_seqlen_balanced_partitions(seqlens, 2, equal_size=True)
    sums = part_sums(seqlens, parts)
    assert max(sums) - min(sums) <= 100  # contiguous halves differ by 3060
    greedy = greedy_partition(seqlens, 2, equal_size=True)
    assert sorted(len(p) for p in greedy) == [4, 4]


def test_too_few_items_for_the_parts_is_an_error():
    with pytest.raises(ValueError, match="non-empty"):
        get_seqlen_balanced_partitions([3, 4], 3, equal_size=False)
    with pytest.raises(ValueError, match="equal size"):
        get_seqlen_balanced_partitions([3, 4, 5], 2, equal_size=True)


def test_reverse_idx_inverts_the_permutation():
    order = [3, 0, 4, 1, 2]
    x = torch.arange(5) * 10
    assert torch.equal(x[order][get_reverse_idx(order)], x)


def _batch(lengths, width=12):
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return TensorDict({"attention_mask": mask, "idx": torch.arange(len(lengths))}, batch_size=[len(lengths)])


def test_micro_batches_respect_the_token_budget_and_restore_order():
    lengths = [12, 3, 7, 9, 2, 11, 5, 6]
    micro_batches, partitions = rearrange_micro_batches(_batch(lengths), max_token_len=16)
    assert all(int(mb["attention_mask"].sum()) <= 16 for mb in micro_batches)
    assert len(micro_batches) == 4  # 55 tokens need ceil(55/16) = 4 parts, and 4 balanced parts fit
    order = [i for p in partitions for i in p]
    restored = torch.cat([mb["idx"] for mb in micro_batches])[get_reverse_idx(order)]
    assert torch.equal(restored, torch.arange(8))


def test_budget_grows_the_count_when_the_even_split_does_not_fit():
    # 3 x 10 tokens under a budget of 15: ceil(30/15) = 2 parts cannot hold them (20 + 10)
    micro_batches, _ = rearrange_micro_batches(_batch([10, 10, 10]), max_token_len=15)
    assert len(micro_batches) == 3


def test_sequence_longer_than_the_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        rearrange_micro_batches(_batch([12, 3]), max_token_len=10)


# ---------------------------------------------------------------- upstream's group and DataProto entry points


def test_ceildiv_and_roundup():
    from verl.utils.seqlen_balancing import ceildiv, roundup_divisible

    assert [ceildiv(a, 3) for a in (0, 1, 3, 4, 7)] == [0, 1, 1, 2, 3]
    assert roundup_divisible(5, 4) == 8 and roundup_divisible(8, 4) == 8


def test_group_balanced_partitions_keep_uid_groups_together():
    from verl.utils.seqlen_balancing import calculate_workload, get_group_balanced_partitions

    # four prompts x two samples; group workloads (24576 s + s^2 summed): A=2 long, B,C short, D long
    seqlens = [100, 100, 10, 10, 10, 10, 90, 90]
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    parts = get_group_balanced_partitions(seqlens, uids, k_partitions=2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    for part in parts:
        assert {uids[i] for i in part} in ({"a", "b"}, {"a", "c"}, {"d", "b"}, {"d", "c"})
    loads = [sum(int(calculate_workload(seqlens[i])) for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) == abs(2 * (24576 * 100 + 100**2) - 2 * (24576 * 90 + 90**2))
    with pytest.raises(ValueError, match="must be contiguous"):
        get_group_balanced_partitions([1, 1, 1], ["a", "b", "a"], 1)
    with pytest.raises(ValueError, match="3 uid groups cannot be split into 2"):
        get_group_balanced_partitions([1, 1, 1], ["a", "b", "c"], 2)


def test_prepare_and_restore_dynamic_batch_round_trip():
    import numpy as np

    from verl.protocol import DataProto
    from verl.utils.seqlen_balancing import prepare_dynamic_batch, restore_dynamic_batch

    lengths = [5, 1, 4, 2, 3, 6, 2, 1]
    mask = torch.zeros(8, 6, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    data = DataProto.from_dict(
        tensors={"attention_mask": mask, "x": torch.arange(8.0)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(8)], dtype=object)},
        meta_info={"temperature": 1.0},
    )
    micro, idx = prepare_dynamic_batch(data, max_token_len=6)
    assert all(int(m.batch["attention_mask"].sum()) <= 6 for m in micro)
    for m, rows in zip(micro, idx):
        assert m.batch["x"].tolist() == [float(r) for r in rows] and m.non_tensor_batch["uid"].tolist() == [
            f"u{r}" for r in rows
        ]
        assert m.meta_info == {"temperature": 1.0}
    outputs = torch.cat([m.batch["x"] * 10 for m in micro])
    assert restore_dynamic_batch(outputs, idx).tolist() == [10.0 * i for i in range(8)]
    plain, plain_idx = prepare_dynamic_batch(data, max_token_len=6, use_dynamic_bsz_balance=False)
    plain_sums = [int(m.batch["attention_mask"].sum()) for m in plain]
    assert len(plain) == 4 and plain_sums == sorted(plain_sums, reverse=True)  # heaviest first
    # balanced order: the lightest at both ends, the heaviest in the middle (ranks 0..3 -> 2, 0, 1, 3)
    assert idx == [plain_idx[2], plain_idx[0], plain_idx[1], plain_idx[3]]


def test_num_batches_divided_by_rounds_the_micro_batch_count_up():
    batch = TensorDict({"attention_mask": torch.ones(6, 4, dtype=torch.long)}, batch_size=[6])
    micro, _ = rearrange_micro_batches(batch, max_token_len=12)
    assert len(micro) == 2
    micro, parts = rearrange_micro_batches(batch, max_token_len=12, num_batches_divided_by=3)
    assert len(micro) == 3 and sorted(i for p in parts for i in p) == list(range(6))


def test_restore_dynamic_batch_reorders_nested_rows():
    from verl.utils.seqlen_balancing import restore_dynamic_batch

    rows = [torch.arange(n, dtype=torch.float32) for n in (3, 1, 2)]  # micro-batch order: rows 2, 0, 1
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    out = restore_dynamic_batch(nested, [[2], [0, 1]])
    assert [r.tolist() for r in out.unbind()] == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0]]
