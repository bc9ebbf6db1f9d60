"""GRPO training throughput on CPU: our framework against TRL's `GRPOTrainer` (issue #9, part 1).

Both sides train the same model directory (default: the bundled `verl/assets/arith-tiny`) on the
same prompts (the arithmetic parquet of `verl.utils.dataset.arith.ensure_arith_data()`), with the
same batch (default 32 prompts x 8 completions = 256 per step), the same lengths (prompts of at most
32 tokens, completions of at most 8), temperature 1, the same reward (our rule
`default_compute_score("arith", ...)`), lr, weight decay, grad clip, no KL and exactly one
optimizer step per generated batch. Every hyper-parameter defaults to its current value in
`verl/trainer/config/arith_demo.yaml` (the bundled demo config) and is passed explicitly to both sides.

- ours: `python -m verl.trainer.main_ppo` as a subprocess: Ray driver, `--workers` (default 2)
  FSDP2 worker processes over gloo with one torch thread each, our built-in rollout engine.
  Per step: `timing_s/step` and `response_length/mean` from the file logger's metrics.jsonl
  (validation and checkpointing off).
- TRL: `GRPOTrainer` in this process (`use_cpu=True`, fp32, `use_vllm=False`, `beta=0`, gradient
  checkpointing off, `num_iterations=1`), generation with transformers' `generate()`, and
  `torch.set_num_threads(--workers)` so both use the same cores. Batch knobs:
  `per_device_train_batch_size` = `--trl-micro-batch` completions (default the whole 256),
  `gradient_accumulation_steps` = `steps_per_generation` = 256 / micro-batch, so each generated
  batch is exactly one optimizer step (`global_step`). Per step: the time from one `on_step_end`
  to the next (a `TrainerCallback`), and the completion tokens the reward function was given.

Figures: the median seconds per step and the median completion tokens per second (tokens of the
step / seconds of the step) over the timed steps of all rounds, each round `--warmup` untimed
steps and `--steps` timed ones per side (start-up, model loading and the warm-up steps are
excluded). The machine's speed drifts when something else runs (TRL's step time varied by ~30%
between runs on a shared machine), so the sides alternate in `--rounds` rounds in ABBA order
(ours, TRL, TRL, ours, ...): a load that rises or falls steadily during the run then weighs on both
sides alike. The per-round ratios are printed; their spread says how much the load moved. Completion tokens count each
completion up to and including its EOS, on both sides. The ratio is ours / TRL in tokens/s (the
issue's goal: at least 3x). The two sides sample different completions, so their lengths differ a
little; tokens/s corrects for that, seconds/step does not.

Run:
    python benchmarks/grpo_vs_trl.py                 # 2 rounds of 2 warm-up + 10 timed steps each
    python benchmarks/grpo_vs_trl.py --rounds 1      # one run per side, as before
    python benchmarks/grpo_vs_trl.py --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from grpo_common import (
    GRPOSetup,
    add_setup_args,
    make_step_clock_class,
    make_trl_trainer,
    ours_completion_tokens,
    run_ours,
    setup_from_args,
    step_records,
)

from verl.utils.machine import bench_headline


def measure_ours(setup: GRPOSetup, warmup: int, steps: int) -> dict:
    result = run_ours(setup, total_steps=warmup + steps)
    timed = step_records(result.records)[warmup:]
    if len(timed) < steps:
        raise SystemExit(f"main_ppo logged {len(timed) + warmup} steps, expected {warmup + steps}")
    seconds = [r["data"]["timing_s/step"] for r in timed]
    tokens = [ours_completion_tokens(r, setup) for r in timed]
    gen = statistics.median(r["data"].get("timing_s/gen", 0.0) for r in timed)
    update = statistics.median(r["data"].get("timing_s/update_actor", 0.0) for r in timed)
    print(f"ours: {result.wall_s:.1f} s wall for {warmup + steps} steps including start-up", flush=True)
    print(f"ours phases (median s): gen={gen:.3f} update_actor={update:.3f}", flush=True)
    return {"seconds": seconds, "tokens": tokens}


def measure_trl(setup: GRPOSetup, warmup: int, steps: int, train_rows: list[dict], micro_batch: int | None) -> dict:
    import torch

    torch.set_num_threads(setup.workers)
    clock = make_step_clock_class()()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        trainer, reward = make_trl_trainer(
            setup, train_rows, out, max_steps=warmup + steps, callbacks=[clock], micro_batch_size=micro_batch
        )
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    if len(clock.step_seconds) != warmup + steps or len(reward.tokens_per_call) != warmup + steps:
        raise SystemExit(
            f"TRL ran {len(clock.step_seconds)} optimizer steps over {len(reward.tokens_per_call)} generated "
            f"batches; expected {warmup + steps} of each (one optimizer step per batch)"
        )
    print(f"TRL: {wall:.1f} s in train() for {warmup + steps} steps, torch threads {torch.get_num_threads()}")
    return {"seconds": clock.step_seconds[warmup:], "tokens": [float(t) for t in reward.tokens_per_call[warmup:]]}


def abba_order(rounds: int) -> list[tuple[str, str]]:
    """The side order of each round: ours first in even rounds, TRL first in odd ones."""
    return [("ours", "TRL") if i % 2 == 0 else ("TRL", "ours") for i in range(rounds)]


def pooled(rounds: list[dict[str, dict]], side: str) -> dict:
    """One side's timed steps of every round, in one list per measure."""
    return {key: [x for r in rounds for x in r[side][key]] for key in ("seconds", "tokens")}


def summarize(side: dict) -> tuple[float, float, float]:
    """(median s/step, median completion tok/s, mean completion tokens per step)."""
    rates = [t / s for t, s in zip(side["tokens"], side["seconds"])]
    return statistics.median(side["seconds"]), statistics.median(rates), statistics.mean(side["tokens"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default: 2)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds, ABBA order (default: 2: ours, TRL, TRL, ours)"
    )
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="TRL per_device_train_batch_size in completions (default: the whole batch in one forward)",
    )
    add_setup_args(parser)
    args = parser.parse_args(argv)
    setup = setup_from_args(args)
    if setup.mini_batch_size != setup.batch_size:
        parser.error("this benchmark compares one optimizer step per batch: --mini-batch-size must equal --batch-size")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1 and --warmup at least 0")

    from verl.utils.dataset.arith import ensure_arith_data, load_rows

    train_path, _ = ensure_arith_data()
    train_rows = load_rows(train_path)
    print(f"setup: {setup}", flush=True)
    measure = {
        "ours": lambda: measure_ours(setup, args.warmup, args.steps),
        "TRL": lambda: measure_trl(setup, args.warmup, args.steps, train_rows, args.trl_micro_batch),
    }
    rounds: list[dict[str, dict]] = []
    for order in abba_order(args.rounds):
        rounds.append({side: measure[side]() for side in order})
    ours, trl = pooled(rounds, "ours"), pooled(rounds, "TRL")
    round_ratios = [summarize(r["ours"])[1] / summarize(r["TRL"])[1] for r in rounds]
    print("per-round ratios (tok/s): " + " ".join(f"{x:.2f}" for x in round_ratios))

    rows = {"ours": summarize(ours), "TRL": summarize(trl)}
    print(f"\n{'':6}{'s/step':>10}{'tok/s':>10}{'tokens/step':>13}   per-step seconds")
    for name, side in (("ours", ours), ("TRL", trl)):
        s, rate, tokens = rows[name]
        print(f"{name:6}{s:10.3f}{rate:10.0f}{tokens:13.0f}   " + " ".join(f"{x:.2f}" for x in side["seconds"]))
    (ours_s, ours_rate, _), (trl_s, trl_rate, _) = rows["ours"], rows["TRL"]
    print(
        bench_headline(
            "grpo_vs_trl",
            f"ours_tok_s={ours_rate:.0f} trl_tok_s={trl_rate:.0f} ratio={ours_rate / trl_rate:.2f} "
            f"ours_s_per_step={ours_s:.3f} trl_s_per_step={trl_s:.3f} rounds={len(rounds)} "
            f"round_ratio_min={min(round_ratios):.2f} round_ratio_max={max(round_ratios):.2f}",
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
