"""`trainer.balance_batch`: equal tokens per data-parallel rank, and GRPO groups kept whole.

Keeping a prompt's samples on one rank, next to each other, lets the actor run each prompt once
per micro-batch (`actor.share_prompt_forward`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, _StepState


def _batch(uids: list[str], lengths: list[int], width: int = 12) -> DataProto:
    mask = torch.zeros(len(uids), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return DataProto.from_dict(
        tensors={"attention_mask": mask, "row": torch.arange(len(uids))},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def _balance(batch: DataProto, world_size: int) -> dict:
    trainer = SimpleNamespace(actor_rollout_wg=SimpleNamespace(world_size=world_size))
    state = _StepState()
    RayPPOTrainer._balance_batch(trainer, batch, state)
    return state.metrics


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
