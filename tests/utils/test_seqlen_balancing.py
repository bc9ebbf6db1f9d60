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
