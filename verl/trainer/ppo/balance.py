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
