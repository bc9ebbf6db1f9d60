"""benchmarks/rank_balance.py's evaluated alternative, `split_groups_to_balance`: when whole GRPO
groups leave one rank a trained group ahead, a group is cut between the ranks (hand-worked orders),
so the benchmark compares what it says it compares."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.rank_balance import split_groups_to_balance
from verl.protocol import DataProto
from verl.workers.actor.ppo_actor import rows_with_advantage


def _groups(trained: list[bool], n: int = 4, prompt_len: int = 10, response_len: int = 2) -> DataProto:
    """One group of `n` rows per entry of `trained` (uids a, b, c, ...), every prompt `prompt_len`
    tokens and every response `response_len`, in this order; a row's `row` is its index."""
    uids = [chr(ord("a") + g) for g in range(len(trained)) for _ in range(n)]
    rows = len(uids)
    attention_mask = torch.ones(rows, prompt_len + 3, dtype=torch.long)
    attention_mask[:, prompt_len + response_len :] = 0
    response_mask = attention_mask[:, prompt_len:]
    advantages = torch.tensor([1.0 if t else 0.0 for t in trained for _ in range(n)])[:, None] * response_mask
    return DataProto.from_dict(
        tensors={
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "advantages": advantages,
            "row": torch.arange(rows),
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def test_a_group_is_cut_between_the_ranks_when_whole_groups_leave_one_rank_a_group_ahead():
    """Rank 0 holds a (trained) and d (not trained), rank 1 holds b and c (trained): whole groups
    cost 10 + 4 x 2 = 18 against 36 (a prompt once per group with shared prompts, plus response
    tokens). Cut after a's 4 rows and 2 of b's: 18 + 10 + 2 x 2 = 32 on each side (b's prompt on
    both); 1 of b's rows gives 30 / 34, 3 give 34 / 30, so 2 it is."""
    batch = _groups([True, True, True, False])
    order = [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]  # a, d | b, c
    batch.reorder(torch.tensor(order))
    got = split_groups_to_balance(batch, 2)
    # positions in the current order: a = 0-3, d = 4-7, b = 8-11, c = 12-15
    assert got == [0, 1, 2, 3, 8, 9, 4, 5, 10, 11, 12, 13, 14, 15, 6, 7]
    batch.reorder(torch.tensor(got))
    assert batch.non_tensor_batch["uid"].tolist() == list("aaaabbdd" + "bbccccdd")


def test_without_shared_prompts_every_row_costs_its_prompt_and_the_cut_is_by_rows():
    batch = _groups([True, True, True, False])
    batch.reorder(torch.tensor([0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]))
    got = split_groups_to_balance(batch, 2, shares_prompts=False)
    assert got == [0, 1, 2, 3, 8, 9, 4, 5, 10, 11, 12, 13, 14, 15, 6, 7]  # 6 trained rows each: 72 = 72


def test_even_whole_groups_are_left_alone():
    batch = _groups([True, False, False, True])  # a, b | c, d: one trained group per rank
    assert split_groups_to_balance(batch, 2) is None
    assert split_groups_to_balance(batch, 1) is None


def test_four_ranks_get_even_pieces_and_equal_row_counts():
    trained = [True] * 5 + [False] * 3  # 5 trained groups of 4 over 4 ranks of 8 rows
    batch = _groups(trained)
    got = split_groups_to_balance(batch, 4)
    assert got is not None and sorted(got) == list(range(32))
    batch.reorder(torch.tensor(got))
    per_rank = rows_with_advantage(batch.batch["advantages"], batch.batch["response_mask"]).view(4, 8).sum(-1)
    assert per_rank.tolist() == [5, 5, 5, 5]  # 20 trained rows, 5 per rank (rows cost alike)
