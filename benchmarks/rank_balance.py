"""How evenly the default GRPO step's actor update is split over the 2 data-parallel ranks (issue #31).

The gradient all-reduce at the end of the update waits for the slower rank; a sampling profile of
the default run put that wait at ~12% of a worker's update. This measures how much of it the
batch split itself causes, without Ray and without the other rank's process competing for cores:

1. Real batches: `--steps` batches of the bundled task as the default run makes them (32 prompts x
   8 samples from the bundled model through the built-in engine, 8 new tokens at most, the arith
   reward, GRPO advantages), reordered as the driver does (`verl.trainer.ppo.balance`: by tokens,
   then by trained tokens with whole GRPO groups per rank) and cut into the 2 ranks' equal
   contiguous parts, as the DP_COMPUTE_PROTO dispatch cuts them.
2. Per rank: the GRPO groups it trains (groups whose samples all scored alike have zero advantage
   and are skipped by `skip_zero_advantage_rows`), its trained rows and tokens, and the median CPU
   time of `update_policy` on its part (CPU time: robust to other processes' load; one thread).
3. The same for an alternative evaluated and not kept (`split_groups_to_balance` below: one group
   cut between the ranks when whole groups leave one rank a group ahead). All four parts of a
   step are timed in one loop, alternated `--repeats` times, so load changes weigh on both alike.

Printed per step and variant: trained groups, rows, tokens and CPU ms per rank and the imbalance
(slower / faster - 1). Last line: `bench rank_balance: imbalance_whole=... imbalance_split=...
slowest_rank_ms_whole=... slowest_rank_ms_split=... groups_diff_median=... cpu=...` (medians over
the steps).

    python benchmarks/rank_balance.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch

from verl.utils.machine import bench_headline

RANKS = 2


def make_batches(steps: int, seed: int):
    """`steps` generated, scored GRPO batches of the bundled task (DataProto, driver order)."""
    from transformers import AutoTokenizer

    from verl.algorithms.advantages import compute_grpo_outcome_advantage
    from verl.models import bundled_model_path
    from verl.protocol import DataProto
    from verl.utils.dataset.arith import make_arith_rows
    from verl.utils.model import compute_position_id_with_mask
    from verl.utils.reward_score.arith import compute_score
    from verl.workers.rollout.native.engine import GenerationEngine
    from verl.workers.rollout.sampling import SamplingParams

    path = bundled_model_path("arith-tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    engine = GenerationEngine.from_model(path, device="cpu", dtype=torch.float32)
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    rows, _ = make_arith_rows(num_train=32 * steps, num_test=0, seed=seed)
    torch.manual_seed(seed)
    batches = []
    for step in range(steps):
        part = rows[32 * step : 32 * (step + 1)]
        texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in part]
        enc = tokenizer(texts, return_tensors="pt", padding="max_length", max_length=32, add_special_tokens=False)
        prompts, prompt_mask = enc.input_ids.repeat_interleave(8, 0), enc.attention_mask.repeat_interleave(8, 0)
        with torch.inference_mode():
            out = engine.generate(
                prompts,
                prompt_mask,
                8,
                sampling,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        responses, response_mask = out.responses.clone(), out.response_mask.clone().long()
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        truth = [r["reward_model"]["ground_truth"] for r in part for _ in range(8)]
        scores = torch.tensor([compute_score(t, g) for t, g in zip(texts, truth)], dtype=torch.float32)
        rewards = torch.zeros(responses.shape, dtype=torch.float32)
        last = (response_mask.sum(-1) - 1).clamp(min=0)
        rewards[torch.arange(len(last)), last] = scores
        uids = np.array([f"{step}-{i // 8}" for i in range(len(responses))], dtype=object)
        advantages, _ = compute_grpo_outcome_advantage(rewards, response_mask, uids)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        tensors = {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "response_mask": response_mask,
            "old_log_probs": torch.zeros(responses.shape),
            "advantages": advantages,
        }
        batches.append(DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids}, meta_info={"temperature": 1.0}))
    return batches


def rank_parts(batch, split: bool):
    """The driver's reordering (`balance_batch`, then by trained tokens as `balance_trained_rows`
    does: whole GRPO groups per rank), with `split` then `split_groups_to_balance`; the ranks'
    equal contiguous parts."""
    from verl.trainer.ppo.balance import balance_batch
    from verl.workers.actor.ppo_actor import rows_with_advantage

    batch = copy.deepcopy(batch)
    balance_batch(batch, RANKS)
    trained = rows_with_advantage(batch.batch["advantages"], batch.batch["response_mask"])
    balance_batch(batch, RANKS, work=(batch.batch["attention_mask"].sum(-1) * trained).tolist())
    order = split_groups_to_balance(batch, RANKS) if split else None
    if order is not None:
        batch.reorder(torch.tensor(order))
    return batch.chunk(RANKS)


def split_groups_to_balance(batch, world_size: int, shares_prompts: bool = True) -> list[int] | None:
    """The alternative evaluated here and not kept: a row order that evens the trained work across
    ranks by cutting one GRPO group between them, or None when whole groups are as even.

    The trained rows (in the whole-group balanced order) are cut into at most `world_size`
    consecutive pieces whose costliest is least (binary search over the limit, greedy packing);
    a piece costs its rows' response tokens plus one prompt per group it holds (`shares_prompts`:
    the shared-prompt forward runs each distinct prompt once per rank). Each rank gets its piece
    plus untrained rows up to the equal row count. Learning would be unchanged (every row trained
    once in the one mini-batch, global normalisers): it only moves rows between ranks.
    """
    from verl.workers.actor.ppo_actor import rows_with_advantage

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


def describe(part) -> tuple[int, int, int]:
    """(trained groups, trained rows, trained tokens) of one rank's part."""
    from verl.workers.actor.ppo_actor import rows_with_advantage

    trained = rows_with_advantage(part.batch["advantages"], part.batch["response_mask"])
    uids = {u for u, t in zip(part.non_tensor_batch["uid"], trained.tolist()) if t}
    tokens = int(part.batch["attention_mask"][trained].sum())
    return len(uids), int(trained.sum()), tokens


def rank_ms(parts, repeats: int) -> list[float]:
    """Median CPU ms of one update of each part (one thread: the process's CPU time is the update's),
    the parts alternated in this process."""
    from transformers import AutoModelForCausalLM
    from update_layouts import MODEL, make_actor

    actor = make_actor(AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="sdpa"), len(parts[0]))
    seconds = [[] for _ in parts]
    for r in range(repeats + 1):
        for i, part in enumerate(parts if r % 2 else parts[::-1]):
            index = i if r % 2 else len(parts) - 1 - i
            start = time.process_time()  # CPU time: on a loaded machine wall time mostly measures the wait
            actor.update_policy(part)
            if r:  # the first round warms up
                seconds[index].append(time.process_time() - start)
    return [statistics.median(s) * 1e3 for s in seconds]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="batches generated and measured")
    parser.add_argument("--repeats", type=int, default=8, help="timed updates per rank part")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    imbalances, diffs, waits = {False: [], True: []}, [], {False: [], True: []}
    for step, batch in enumerate(make_batches(args.steps, args.seed)):
        variants = {split: rank_parts(batch, split) for split in (False, True)}
        # all four parts timed in one alternating loop, so a load change weighs on both variants alike
        ms_all = rank_ms([*variants[False], *variants[True]], args.repeats)
        for split in (False, True):
            parts, ms = variants[split], ms_all[RANKS * split : RANKS * (split + 1)]
            info = [describe(p) for p in parts]
            imbalances[split].append(max(ms) / min(ms) - 1)
            waits[split].append(max(ms))
            if not split:
                diffs.append(abs(info[0][0] - info[1][0]))
            cells = "  ".join(
                f"rank {r}: {g} groups {rows} rows {tok} tok {t:.1f} ms"
                for r, ((g, rows, tok), t) in enumerate(zip(info, ms))
            )
            label = "split" if split else "whole"
            print(f"step {step} {label}: {cells}  imbalance {100 * imbalances[split][-1]:.1f}%", flush=True)
    fields = (
        f"imbalance_whole={statistics.median(imbalances[False]):.3f} imbalance_split={statistics.median(imbalances[True]):.3f} "
        f"slowest_rank_ms_whole={statistics.median(waits[False]):.1f} slowest_rank_ms_split={statistics.median(waits[True]):.1f} "
        f"groups_diff_median={statistics.median(diffs):.1f}"
    )
    print(bench_headline("rank_balance", fields))


if __name__ == "__main__":
    main()
