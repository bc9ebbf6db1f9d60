"""`split_groups_to_balance`: when whole GRPO groups leave one rank a trained group ahead, a group is
cut between the ranks (hand-worked orders), and the update is the same either way (two gloo ranks,
float64: the weights after one optimizer step agree with the whole-group order's to rounding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import VOCAB, make_tiny_causal_lm, one_thread, ppo_tensors, run_distributed
from verl.protocol import DataProto
from verl.trainer.ppo.balance import balance_trained_rows, split_groups_to_balance
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


def test_balance_trained_rows_ends_with_the_split_order():
    batch = _groups([True, True, True, False])  # 3 trained groups, 2 ranks
    cfg = OmegaConf.create({"ppo_mini_batch_size": 4, "policy_loss": {"loss_mode": "vanilla"}})
    balance_trained_rows(batch, 2, cfg, rollout_n=4)
    trained = rows_with_advantage(batch.batch["advantages"], batch.batch["response_mask"])
    assert trained.view(2, 8).sum(-1).tolist() == [6, 6]


# ----------------------------------------------------------------- the update is the same either way

GROUPS, N = 6, 4  # 3 of the 6 groups trained: whole groups put 2 on one rank, 1 on the other


def _grpo_batch() -> DataProto:
    g = torch.Generator().manual_seed(3)
    prompt_len, response_len, rows = 6, 5, GROUPS * N
    prompt_lengths = torch.randint(3, prompt_len + 1, (GROUPS,), generator=g).repeat_interleave(N)
    prompts = torch.zeros(GROUPS, prompt_len, dtype=torch.long)
    for i in range(GROUPS):
        prompts[i, prompt_len - int(prompt_lengths[i * N]) :] = torch.randint(
            3, VOCAB, (int(prompt_lengths[i * N]),), generator=g
        )
    prompts = prompts.repeat_interleave(N, 0)
    prompt_mask = (prompts != 0).long()
    response_lengths = torch.randint(1, response_len + 1, (rows,), generator=g)
    response_mask = (torch.arange(response_len)[None] < response_lengths[:, None]).long()
    responses = torch.randint(3, VOCAB, (rows, response_len), generator=g) * response_mask
    tensors = ppo_tensors(prompts, responses, torch.cat([prompt_mask, response_mask], 1), response_mask)
    trained_groups = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]).repeat_interleave(N)
    tensors["advantages"] = (
        torch.randn(rows, 1, generator=g, dtype=torch.float64) * trained_groups[:, None] * response_mask
    )
    tensors["old_log_probs"] = torch.zeros(rows, response_len, dtype=torch.float64)
    uids = np.array([f"g{i // N}" for i in range(rows)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids}, meta_info={"temperature": 1.0})


def _update_weights(rank: int, world_size: int, order: list[int]) -> dict:
    from verl.workers.actor import DataParallelPPOActor
    from verl.workers.dp_training import replicate_over_ranks

    model = replicate_over_ranks(make_tiny_causal_lm(seed=0, dtype=torch.float64))
    config = {
        "ppo_mini_batch_size": GROUPS * N // world_size,
        "ppo_micro_batch_size_per_gpu": GROUPS * N // world_size,
        "ppo_epochs": 1,
        "grad_clip": 1e9,  # no clipping: the step is the gradient's own
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
    }
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))
    batch = _grpo_batch()
    batch.reorder(torch.tensor(order))
    actor.update_policy(batch.chunk(world_size)[rank])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _both_orders_give_the_same_weights(rank: int, world_size: int, whole: list[int], split: list[int]) -> None:
    a = _update_weights(rank, world_size, whole)
    b = _update_weights(rank, world_size, split)
    start = make_tiny_causal_lm(seed=0, dtype=torch.float64).state_dict()
    changed = max(float((a[k] - start[k]).abs().max()) for k in a)
    assert changed > 1e-4, f"the update did not move the weights ({changed})"
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-12, f"rank {rank}: weights after the whole-group and the split order differ by {worst}"


@pytest.mark.usefixtures(one_thread.__name__)
def test_the_split_order_gives_the_same_update_as_whole_groups():
    batch = _grpo_batch()
    # whole groups as balance_trained_rows leaves them: g0, g2 | g4 trained (2 against 1)
    whole = [i for g in (0, 1, 2, 3, 4, 5) for i in range(g * N, (g + 1) * N)]
    batch.reorder(torch.tensor(whole))
    split = split_groups_to_balance(batch, 2)
    assert split is not None, "the batch was meant to need a split"
    split_rows = [whole[i] for i in split]
    original = _grpo_batch()
    trained = rows_with_advantage(original.batch["advantages"], original.batch["response_mask"])
    assert [int(trained[whole[:12]].sum()), int(trained[whole[12:]].sum())] == [8, 4]
    assert [int(trained[split_rows[:12]].sum()), int(trained[split_rows[12:]].sum())] == [6, 6]
    run_distributed(_both_orders_give_the_same_weights, 2, whole, split_rows)
