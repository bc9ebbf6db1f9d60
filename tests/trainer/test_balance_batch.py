"""`trainer.balance_batch`: equal tokens per data-parallel rank, and GRPO groups kept whole.

Keeping a prompt's samples on one rank, next to each other, lets the actor run each prompt once
per micro-batch (`actor.share_prompt_forward`)."""

from __future__ import annotations

import numpy as np
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.balance import balance_batch, balance_trained_rows


def _batch(uids: list[str], lengths: list[int], width: int = 12) -> DataProto:
    mask = torch.zeros(len(uids), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return DataProto.from_dict(
        tensors={"attention_mask": mask, "row": torch.arange(len(uids))},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def _balance(batch: DataProto, world_size: int) -> dict:
    return balance_batch(batch, world_size)


def test_groups_stay_whole_and_contiguous_on_one_rank_and_tokens_balance():
    rng = np.random.default_rng(0)
    n, num_groups, world = 4, 8, 2
    uids = [f"g{g}" for g in range(num_groups) for _ in range(n)]
    order = rng.permutation(len(uids))  # groups interleaved, as after a reorder
    uids = [uids[i] for i in order]
    lengths = [int(x) for x in rng.integers(2, 12, size=len(uids))]
    batch = _batch(uids, lengths)
    _balance(batch, world)
    assert sorted(batch.batch["row"].tolist()) == list(range(len(uids)))  # a permutation
    got = batch.non_tensor_batch["uid"].tolist()
    halves = [got[: len(got) // 2], got[len(got) // 2 :]]
    assert not set(halves[0]) & set(halves[1])  # no group split across ranks
    for half in halves:
        assert len(set(half)) == num_groups // world
        runs = [u for i, u in enumerate(half) if i == 0 or half[i - 1] != u]
        assert len(runs) == len(set(half))  # each group's rows are adjacent
    tokens = [sum(lengths[r] for r in batch.batch["row"][k * 16 : (k + 1) * 16].tolist()) for k in range(2)]
    group_tokens = {u: sum(lengths[i] for i, v in enumerate(uids) if v == u) for u in set(uids)}
    # the greedy split of 8 group totals is at worst one group's tokens apart
    assert abs(tokens[0] - tokens[1]) <= max(group_tokens.values())


def test_rows_are_balanced_one_by_one_when_groups_differ_in_size():
    uids = ["a", "a", "a", "a", "b", "b"]  # groups of 4 and 2 cannot go whole to 2 equal ranks
    lengths = [10, 1, 1, 1, 10, 1]
    batch = _batch(uids, lengths)
    _balance(batch, 2)
    rows = batch.batch["row"].tolist()
    assert sorted(rows) == list(range(6))
    assert sorted(lengths[r] for r in rows[:3]) == [1, 1, 10] == sorted(lengths[r] for r in rows[3:])


def _balance_trained_rows(batch: DataProto, world_size: int = 2, **actor) -> None:
    """8 prompts per mini-batch, 4 samples each (`rollout.n`)."""
    section = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "policy_loss": {"loss_mode": "vanilla"}}
    actor_cfg = OmegaConf.create({**section, **actor})
    balance_trained_rows(batch, world_size, actor_cfg, rollout_n=4)


def _zero_groups_first(num_groups: int = 8, n: int = 4) -> DataProto:
    """Groups of `n` equal-length rows; the first half of the groups scored all alike (advantage 0)."""
    uids = [f"g{g}" for g in range(num_groups) for _ in range(n)]
    batch = _batch(uids, [6] * len(uids))
    advantages = torch.ones(len(uids), 3)
    advantages[: num_groups // 2 * n] = 0.0
    batch.batch["advantages"] = advantages
    batch.batch["response_mask"] = torch.ones(len(uids), 3, dtype=torch.long)
    return batch


def _trained_rows_per_rank(batch: DataProto) -> list[int]:
    trained = (batch.batch["advantages"] != 0).any(-1)
    half = len(batch) // 2
    return [int(trained[:half].sum()), int(trained[half:].sum())]


def test_before_an_update_that_skips_zero_advantage_rows_the_trained_groups_are_spread_over_the_ranks():
    """8 groups of 4 on 2 ranks, the 4 all-alike (zero-advantage) groups first: as they come (and
    balanced by tokens alone: every row has the same length) one rank would train nothing while the
    other trains 4 groups. Balanced by trained tokens each rank trains 2."""
    batch = _zero_groups_first()
    assert _trained_rows_per_rank(batch) == [0, 16]
    _balance_trained_rows(batch)
    assert _trained_rows_per_rank(batch) == [8, 8]
    got = batch.non_tensor_batch["uid"].tolist()
    assert not set(got[:16]) & set(got[16:])  # groups still whole


def test_the_order_is_left_alone_when_the_actor_trains_every_row():
    for actor in ({"entropy_coeff": 0.01}, {"use_kl_loss": True}, {"skip_zero_advantage_rows": False}):
        batch = _zero_groups_first()
        _balance_trained_rows(batch, **actor)
        assert _trained_rows_per_rank(batch) == [0, 16], actor
    batch = _zero_groups_first()
    _balance_trained_rows(batch, ppo_mini_batch_size=4)  # two optimizer steps
    assert _trained_rows_per_rank(batch) == [0, 16]
