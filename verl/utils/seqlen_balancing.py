"""Balanced partitioning of sequences by length, and token-budget micro-batches.

Two users:

* the trainer reorders a global batch so that every data-parallel rank receives about the same
  number of tokens (`get_seqlen_balanced_partitions(..., equal_size=True)`, each rank also keeps
  the same number of samples);
* the actor and critic cut a mini-batch into micro-batches holding at most
  `ppo_max_token_len_per_gpu` tokens each (`rearrange_micro_batches`, the `use_dynamic_bsz` path).

Partitioning uses the Karmarkar-Karp largest-differencing method: every item starts as a
k-partition of its own, and the two partitions with the largest spread are merged repeatedly,
pairing the heaviest part of one with the lightest part of the other. It is within a few tokens
of optimal on the length distributions RL produces and runs in O(n log n). A greedy
(longest-first into the lightest part) partitioner is provided as the simple alternative.

Sample groups: `get_group_balanced_partitions` keeps the samples of one prompt (same uid,
contiguous) on one rank, balancing the groups by an attention-aware workload estimate
(`calculate_workload`), for trainers that share a prompt's prefix across its samples.

`prepare_dynamic_batch` / `restore_dynamic_batch` are the DataProto-level form of the token-budget
split (upstream's entry points): the micro-batches as DataProtos plus the indices that put the
per-micro-batch outputs back in the input order.

Token budget: upstream uses `ceil(total / budget)` micro-batches, which can overshoot the budget
when the partition is not perfectly even. Here the count starts there and grows until the
balanced partition fits the budget, so a micro-batch exceeds it only when one sequence alone
does (which is an error: raise the budget). Every rank of the data-parallel group then uses the
largest count of any rank, because FSDP runs one collective per forward and all ranks must run
the same number of forwards. That agreement is a host-side collective: its tensor lives where the
group reduces it (`verl.utils.device.collective_device`: the CPU on the workers' gloo or
`cpu:gloo,cuda:nccl` group, the device on an NCCL-only one).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from itertools import chain

import torch

from verl.utils.device import collective_device

__all__ = [
    "calculate_workload",
    "ceildiv",
    "get_group_balanced_partitions",
    "get_reverse_idx",
    "get_seqlen_balanced_partitions",
    "greedy_partition",
    "karmarkar_karp",
    "log_seqlen_unbalance",
    "prepare_dynamic_batch",
    "rearrange_micro_batches",
    "restore_dynamic_batch",
    "roundup_divisible",
]


class _State:
    """A k-way partition under construction: parts sorted heaviest first."""

    __slots__ = ("parts", "sums")

    def __init__(self, parts: list[list[int]], sums: list[int]):
        order = sorted(range(len(parts)), key=lambda i: (-sums[i], min(parts[i], default=-1)))
        self.parts = [parts[i] for i in order]
        self.sums = [sums[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: _State) -> _State:
        # heaviest part of self with the lightest of other, and so on
        k = len(self.parts)
        parts = [self.parts[i] + other.parts[k - 1 - i] for i in range(k)]
        sums = [self.sums[i] + other.sums[k - 1 - i] for i in range(k)]
        return _State(parts, sums)


def karmarkar_karp(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split item indices into `k_partitions` parts with nearly equal length sums.

    With `equal_size`, every part gets exactly `len(seqlen_list) / k_partitions` items: the
    initial states are groups of k consecutive items in length order, one item per part, so every
    merge keeps the part sizes equal.
    """
    n = len(seqlen_list)
    order = sorted(range(n), key=lambda i: (seqlen_list[i], i))
    states: list[_State] = []
    if equal_size:
        if n % k_partitions != 0:
            raise ValueError(f"{n} items cannot be split into {k_partitions} parts of equal size")
        for start in range(0, n, k_partitions):
            group = order[start : start + k_partitions]
            states.append(_State([[i] for i in group], [seqlen_list[i] for i in group]))
    else:
        for i in order:
            parts = [[i]] + [[] for _ in range(k_partitions - 1)]
            states.append(_State(parts, [seqlen_list[i]] + [0] * (k_partitions - 1)))
    # max-heap on spread; the counter keeps ordering deterministic for ties
    heap = [(-s.spread, c, s) for c, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, counter, merged))
        counter += 1
    final = heap[0][2] if heap else _State([[] for _ in range(k_partitions)], [0] * k_partitions)
    return [sorted(p) for p in final.parts]


def greedy_partition(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Longest item first into the currently lightest part (that still has room when `equal_size`)."""
    n = len(seqlen_list)
    if equal_size and n % k_partitions != 0:
        raise ValueError(f"{n} items cannot be split into {k_partitions} parts of equal size")
    capacity = n // k_partitions if equal_size else n
    parts: list[list[int]] = [[] for _ in range(k_partitions)]
    sums = [0] * k_partitions
    for i in sorted(range(n), key=lambda i: (-seqlen_list[i], i)):
        j = min((j for j in range(k_partitions) if len(parts[j]) < capacity), key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += seqlen_list[i]
    return [sorted(p) for p in parts]


def get_seqlen_balanced_partitions(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp partition of item indices into `k_partitions` non-empty parts.

    Returns a list of `k_partitions` sorted index lists covering every item exactly once.
    """
    if k_partitions < 1:
        raise ValueError(f"k_partitions must be at least 1, got {k_partitions}")
    if len(seqlen_list) < k_partitions:
        raise ValueError(
            f"cannot split {len(seqlen_list)} sequences into {k_partitions} non-empty parts; "
            "every part needs at least one sequence"
        )
    partitions = karmarkar_karp(seqlen_list, k_partitions, equal_size)
    assert all(partitions), "Karmarkar-Karp produced an empty part although n >= k"
    assert sorted(i for p in partitions for i in p) == list(range(len(seqlen_list)))
    return partitions


def log_seqlen_unbalance(seqlen_list: Sequence[int], partitions: list[list[int]], prefix: str) -> dict[str, float]:
    """Token-count spread before (consecutive chunks) and after balancing, as metrics."""
    k = len(partitions)
    n = len(seqlen_list)
    chunk = math.ceil(n / k)
    before = [sum(seqlen_list[i : i + chunk]) for i in range(0, n, chunk)]
    after = [sum(seqlen_list[i] for i in p) for p in partitions]
    return {
        f"{prefix}/min": float(min(before)),
        f"{prefix}/max": float(max(before)),
        f"{prefix}/minmax_diff": float(max(before) - min(before)),
        f"{prefix}/balanced_min": float(min(after)),
        f"{prefix}/balanced_max": float(max(after)),
        f"{prefix}/mean": float(sum(after) / k),
    }


def num_micro_batches_for_budget(seqlens: list[int], max_token_len: int) -> int:
    """Fewest balanced parts whose every part fits the budget."""
    k = max(1, math.ceil(sum(seqlens) / max_token_len))
    while k < len(seqlens):
        parts = karmarkar_karp(seqlens, k, equal_size=False)
        if max(sum(seqlens[i] for i in p) for p in parts) <= max_token_len:
            return k
        k += 1
    return len(seqlens)


def rearrange_micro_batches(
    batch,
    max_token_len: int,
    dp_group=None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    num_batches_divided_by: int | None = None,
):
    """Cut `batch` (a TensorDict with `attention_mask`) into token-budget micro-batches.

    Args:
        batch: TensorDict with leading batch dimension and an `attention_mask` [B, L], or
            `input_ids` as a jagged nested tensor [B, j] (a packed batch; each row's length counts).
        max_token_len: budget of non-pad tokens per micro-batch on this rank.
        dp_group: process group whose ranks must use the same number of micro-batches (default:
            the world group when torch.distributed is initialised).
        same_micro_num_in_dp: agree on the largest count across `dp_group` (needed under FSDP).
        min_num_micro_batch: use at least this many micro-batches.
        num_batches_divided_by: round the count up to a multiple of this (megatron's virtual
            pipeline stages need a multiple of their number).

    Returns:
        (micro_batches, partitions): the list of TensorDicts and, for each, the indices into
        `batch` it holds. `get_reverse_idx` of the concatenated indices restores the input order.
    """
    ids = batch.get("input_ids", None)
    jagged = ids is not None and ids.is_nested
    # a packed (no-padding) batch: each row's own length; a padded one: its real tokens
    seqlens = ids.offsets().diff().tolist() if jagged else batch["attention_mask"].sum(dim=-1).tolist()
    longest = max(seqlens)
    if longest > max_token_len:
        raise ValueError(
            f"a sequence has {longest} tokens but the micro-batch token budget is {max_token_len}; "
            "raise ppo_max_token_len_per_gpu (or log_prob_max_token_len_per_gpu) to at least the longest "
            "prompt + response length"
        )
    num_micro = num_micro_batches_for_budget(seqlens, max_token_len)
    if min_num_micro_batch is not None:
        num_micro = max(num_micro, min_num_micro_batch)
    if same_micro_num_in_dp and torch.distributed.is_available() and torch.distributed.is_initialized():
        # the batch is split on the host; the count goes where the group can reduce it (gloo: no
        # device round trip; an NCCL-only group: this rank's device)
        count = torch.tensor([num_micro], dtype=torch.int64, device=collective_device(dp_group))
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=dp_group)
        num_micro = int(count.item())
    if num_batches_divided_by is not None:
        num_micro = roundup_divisible(num_micro, num_batches_divided_by)
    if num_micro > len(seqlens):
        raise ValueError(
            f"this rank holds {len(seqlens)} sequences but the data-parallel group needs {num_micro} "
            "micro-batches (another rank has more or longer sequences); every rank must receive the same "
            "number of samples, and the token budget must allow at least one sequence per micro-batch"
        )
    partitions = get_seqlen_balanced_partitions(seqlens, num_micro, equal_size=False)
    # longest micro-batches first: peak memory shows up on the first step, not the last
    partitions.sort(key=lambda p: (-sum(seqlens[i] for i in p), p[0]))
    if jagged:
        from verl.utils.tensordict_utils import index_select_tensor_dict

        micro_batches = [index_select_tensor_dict(batch, p) for p in partitions]
    else:
        micro_batches = [batch[torch.tensor(p, dtype=torch.long)] for p in partitions]
    return micro_batches, partitions


def get_reverse_idx(idx_map: Sequence[int]) -> list[int]:
    """Inverse permutation: `x[idx_map][get_reverse_idx(idx_map)] == x`."""
    reverse = [0] * len(idx_map)
    for position, original in enumerate(idx_map):
        reverse[original] = position
    return reverse


def ceildiv(a: int, b: int) -> int:
    """The smallest integer >= a / b."""
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    """The smallest multiple of b that is >= a."""
    return ceildiv(a, b) * b


def calculate_workload(seqlen_list: torch.Tensor) -> torch.Tensor:
    """Relative cost of sequences of these lengths (a tensor or an int) in a dense transformer:
    24576 * s + s^2, i.e. 12 h^2 s (projections) + 2 h s^2 (attention) with h = 4096, divided by 2h
    (upstream's estimate)."""
    return 24576 * seqlen_list + seqlen_list**2


def get_group_balanced_partitions(seqlen_list: Sequence[int], uid_list: Sequence, k_partitions: int) -> list[list[int]]:
    """`k_partitions` sorted index lists in which the samples of each uid group stay together.

    Samples of one uid must be contiguous (as `DataProto.repeat(n, interleave=True)` leaves them). The
    groups are balanced by their summed `calculate_workload`, each partition getting the same number of
    groups (Karmarkar-Karp with equal sizes), so the group count must divide by `k_partitions`.
    """
    if len(seqlen_list) != len(uid_list):
        raise ValueError(f"{len(seqlen_list)} lengths but {len(uid_list)} uids; give one uid per sample")
    groups: list[list[int]] = []
    for i, uid in enumerate(uid_list):
        if groups and uid_list[groups[-1][0]] == uid:
            groups[-1].append(i)
        else:
            groups.append([i])
    seen = [uid_list[g[0]] for g in groups]
    if len(set(map(str, seen))) != len(seen):
        raise ValueError(
            "get_group_balanced_partitions: the samples of a uid must be contiguous; sort them by uid first"
        )
    if len(groups) < k_partitions or len(groups) % k_partitions:
        raise ValueError(
            f"{len(groups)} uid groups cannot be split into {k_partitions} partitions of equal group count; use a "
            f"number of prompts divisible by {k_partitions}"
        )
    workloads = [sum(int(calculate_workload(int(seqlen_list[i]))) for i in g) for g in groups]
    group_parts = get_seqlen_balanced_partitions(workloads, k_partitions, equal_size=True)
    return [sorted(i for g in part for i in groups[g]) for part in group_parts]


def prepare_dynamic_batch(
    data,
    max_token_len: int,
    dp_group=None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
):
    """Cut a DataProto into token-budget micro-batches: `(micro_batches, batch_idx_list)`.

    The split is `rearrange_micro_batches` (heaviest micro-batch first). With
    `use_dynamic_bsz_balance` the order is rearranged so the lightest micro-batches sit at both ends
    (heaviest in the middle), which shortens pipeline-parallel warm-up and cool-down bubbles, as
    upstream orders them. Each micro-batch carries its rows' non-tensor columns and a shallow copy
    of `meta_info`; `restore_dynamic_batch(outputs, batch_idx_list)` puts outputs back in input order.
    """
    from verl.protocol import DataProto

    batches, partitions = rearrange_micro_batches(
        data.batch,
        max_token_len=max_token_len,
        dp_group=dp_group,
        same_micro_num_in_dp=same_micro_num_in_dp,
        min_num_micro_batch=min_num_micro_batch,
        num_batches_divided_by=num_batches_divided_by,
    )
    order = list(range(len(partitions)))
    if use_dynamic_bsz_balance:
        order = order[::2][::-1] + order[1::2]
    micro_batches = []
    for i in order:
        idx = partitions[i]
        non_tensors = {key: value[idx] for key, value in data.non_tensor_batch.items()}
        micro_batches.append(DataProto.from_dict(dict(batches[i].items()), non_tensors, meta_info=dict(data.meta_info)))
    return micro_batches, [partitions[i] for i in order]


def restore_dynamic_batch(data: torch.Tensor, batch_idx_list: list[list[int]]) -> torch.Tensor:
    """The rows of `data` (the concatenated micro-batch outputs, in `batch_idx_list` order) back in
    the original order; nested (jagged) tensors are reordered row by row."""
    indices = list(chain.from_iterable(batch_idx_list))
    if len(indices) != data.shape[0]:
        raise ValueError(f"restore_dynamic_batch: {data.shape[0]} rows but the index lists cover {len(indices)}")
    reverse = torch.tensor(get_reverse_idx(indices), dtype=torch.long)
    if data.is_nested:
        rows = data.unbind()
        from verl.utils.tensordict_utils import jagged_from_rows

        return jagged_from_rows([rows[i] for i in reverse.tolist()], getattr(data, "_ragged_idx", 1))
    return data[reverse.to(data.device)]
