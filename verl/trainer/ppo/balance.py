"""Spreading a step's batch over the data-parallel ranks (`trainer.balance_batch`).

Every rank's update waits for the slowest, so the driver reorders the batch before the workers
cut it into equal contiguous parts: about the same tokens per rank, and each GRPO group (a
prompt's n samples) whole and contiguous on one rank, which lets the actor run each prompt once
per micro-batch (`actor.share_prompt_forward`) instead of once per rank it was scattered over.
Functions of the batch, the number of ranks and (for the second pass) the actor's settings; the
trainer decides when they run.
"""

from __future__ import annotations

import torch

from verl.protocol import DataProto
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions, log_seqlen_unbalance
from verl.workers.actor.ppo_actor import rows_with_advantage, skips_zero_advantage_rows


def balance_batch(batch: DataProto, world_size: int, work: list[int] | None = None) -> dict[str, float]:
    """Reorder `batch` in place so each of `world_size` ranks gets about the same work: tokens per
    row, or `work` per row when given. Returns the `global_seqlen/*` metrics (none with `work`)."""
    seqlens = batch.batch["attention_mask"].sum(-1).tolist()
    weights = seqlens if work is None else work
    groups = equal_groups(batch.non_tensor_batch.get("uid"), world_size)
    if groups is not None:
        group_lens = [sum(weights[i] for i in rows) for rows in groups]
        group_parts = get_seqlen_balanced_partitions(group_lens, k_partitions=world_size, equal_size=True)
        partitions = [[i for g in sorted(part) for i in groups[g]] for part in group_parts]
    elif work is not None:
        return {}  # rows are already balanced by tokens; without groups there is little to gain
    else:
        partitions = get_seqlen_balanced_partitions(seqlens, k_partitions=world_size, equal_size=True)
    batch.reorder(torch.tensor([i for part in partitions for i in part]))
    if work is not None:
        return {}
    return log_seqlen_unbalance(seqlen_list=seqlens, partitions=partitions, prefix="global_seqlen")


def balance_trained_rows(batch: DataProto, world_size: int, actor_cfg, rollout_n: int) -> None:
    """Before a one-mini-batch actor update that leaves zero-advantage rows out
    (`actor.skip_zero_advantage_rows`): balance the rows that will be trained, not all rows, since
    GRPO's all-alike groups (zero advantage) can gather on one rank. One mini-batch only, so the
    order changes no optimizer step; otherwise the batch is left as it is.

    actor_cfg: `actor_rollout_ref.actor`; rollout_n: samples per prompt (`rollout.n`), which turns
    the mini-batch's prompts into rows.
    """
    if not skips_zero_advantage_rows(actor_cfg) or actor_cfg.ppo_mini_batch_size * rollout_n < len(batch):
        return
    trained = rows_with_advantage(batch.batch["advantages"], batch.batch["response_mask"])
    if bool(trained.all()):
        return
    work = (batch.batch["attention_mask"].sum(-1) * trained).tolist()
    balance_batch(batch, world_size, work=work)
    order = split_groups_to_balance(batch, world_size, shares_prompts=bool(actor_cfg.get("share_prompt_forward", True)))
    if order is not None:
        batch.reorder(torch.tensor(order))


def split_groups_to_balance(batch: DataProto, world_size: int, shares_prompts: bool = True) -> list[int] | None:
    """A row order that evens the trained work across ranks by splitting GRPO groups, or None when
    whole groups are as even (the order `balance_trained_rows` leaves).

    Why: with whole groups the ranks' trained work differs by up to one group, and a step trains
    only ~20 of its 32 groups (the rest scored alike and are skipped), so an odd count leaves one
    rank a group ahead: 11 against 10 groups, ~10% more work, which the other rank then waits out
    at the gradient all-reduce (measured: benchmarks/rank_balance.py, docs/benchmarks.md). Putting
    part of one group on each side of a rank boundary evens it, at the price of that group's prompt
    forward running on both ranks (with `shares_prompts`, a rank runs each distinct prompt once).

    How: the trained rows, in the current (whole-group balanced) order, are cut into at most
    `world_size` consecutive pieces whose costliest is as cheap as possible (a binary search over
    the limit, each tried by greedy packing: exact for cuts of that order); the cost of a
    piece is its rows' response tokens plus one prompt per group it holds (with `shares_prompts`;
    else every row's prompt). Each rank then gets its piece plus untrained rows up to the equal row
    count the dispatch cuts. Returned only when it lowers the costliest rank's cost.

    Learning is unchanged: every row is trained exactly once in the same single mini-batch, and the
    loss normaliser and the gradient all-reduce are global, so only which rank computes a row (and
    fp32 summation order) differs. Assumes one mini-batch (as `balance_trained_rows` checks).
    """
    uids = batch.non_tensor_batch.get("uid")
    rows = len(batch)
    if world_size < 2 or uids is None or rows % world_size:
        return None
    per_rank = rows // world_size
    trained = rows_with_advantage(batch.batch["advantages"], batch.batch["response_mask"]).tolist()
    response = batch.batch["response_mask"].sum(-1).tolist()
    prompt_len = batch.batch["attention_mask"].shape[1] - batch.batch["response_mask"].shape[1]
    prompt = batch.batch["attention_mask"][:, :prompt_len].sum(-1).tolist()
    uids = uids.tolist()

    def cost(piece: list[int]) -> int:
        if not shares_prompts:
            return sum(response[i] + prompt[i] for i in piece)
        return sum(response[i] for i in piece) + sum(prompt[i] for i in {uids[i]: i for i in piece}.values())

    def pieces_within(limit: int) -> list[list[int]] | None:
        """Trained rows packed greedily into consecutive pieces of cost <= limit and <= per_rank
        rows; None if that takes more than world_size pieces (greedy packing is the fewest)."""
        pieces: list[list[int]] = [[]]
        seen: set = set()
        total = 0
        for i in train_rows:
            add = response[i] + (prompt[i] if not shares_prompts or uids[i] not in seen else 0)
            if pieces[-1] and (total + add > limit or len(pieces[-1]) == per_rank):
                pieces.append([])
                seen, total = set(), 0
                add = response[i] + prompt[i]
            if add > limit:
                return None
            pieces[-1].append(i)
            seen.add(uids[i])
            total += add
        return pieces if len(pieces) <= world_size else None

    train_rows = [i for i in range(rows) if trained[i]]
    now = max(cost([i for i in range(r * per_rank, (r + 1) * per_rank) if trained[i]]) for r in range(world_size))
    if not train_rows or pieces_within(now - 1) is None:
        return None
    lo, hi = 0, now - 1  # the least limit that packs into world_size pieces: binary search
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pieces_within(mid) is not None else (mid + 1, hi)
    pieces = pieces_within(lo)
    pieces += [[] for _ in range(world_size - len(pieces))]
    idle = iter(i for i in range(rows) if not trained[i])
    return [i for p in pieces for i in (*p, *(next(idle) for _ in range(per_rank - len(p))))]


def equal_groups(uids, world_size: int) -> list[list[int]] | None:
    """Row indices per uid (in order of first appearance) when every group has the same size and
    the number of groups divides evenly over `world_size` ranks; else None (balance rows instead)."""
    if uids is None or len(uids) == 0:
        return None
    index: dict = {}
    for row, uid in enumerate(uids.tolist()):
        index.setdefault(uid, []).append(row)
    groups = list(index.values())
    if len(groups) % world_size or len({len(g) for g in groups}) != 1 or len(groups) == len(uids):
        return None
    return groups
