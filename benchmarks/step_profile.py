"""Where one GRPO step of the default run goes on CPU (issue #31).

Two views of the same work:

1. The phases of a real run (`--steps`, default 20; 0 skips it): `python -m
   verl.trainer.main_ppo --config-name=arith_demo` (2 worker processes, one thread each) through
   `grpo_common.run_ours`, medians over the steps after the first 5 of `timing_s/step`, `gen`
   (with the engine's own `generate_sequences` and the weight sync inside it), `update_actor`
   (with the worker's own `perf/update_actor_s`), `reward`, and the rest of the step (fetching and
   tokenising the prompts, balancing, advantages, the driver's DataProto work). What `gen` and
   `update_actor` hold beyond the worker's own time is the Ray round trip and the driver's
   DataProto work around the call.
2. One worker's share of the step in this process, on one thread as each worker runs it:
   generation (16 prompts x 8 samples left-padded to 32 tokens as the dataset pads them, at most 8
   new tokens, EOS on; per step as the hybrid engine runs it: wake, weight sync, generate, sleep)
   and one actor update (`update_layouts.grpo_batch`: 16 groups x 8 responses of 3-4 tokens,
   token-mean loss, fused AdamW). Median milliseconds of each, then torch.profiler's top operators
   by self CPU time over `--profile-iters` of each.

    python benchmarks/step_profile.py                  # both parts
    python benchmarks/step_profile.py --steps 0        # the in-process part only

Last line: `bench step_profile: step_s=... gen_s=... engine_s=... update_s=... worker_update_s=...
reward_s=... rest_s=... local_gen_ms=... local_update_ms=... cpu=... load1=...`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verl.utils.machine import bench_headline

RUN_KEYS = ("step", "gen", "generate_sequences", "update_weights", "update_actor", "reward", "adv", "old_log_prob")


def run_phases(steps: int) -> dict[str, float]:
    """Medians (seconds) of the phases of a `steps`-step default run, the first 5 steps left out."""
    from grpo_common import GRPOSetup, run_ours, step_records

    result = run_ours(GRPOSetup(), total_steps=steps)
    records = [r["data"] for r in step_records(result.records)][5:]
    if not records:
        raise SystemExit(f"the run logged {len(result.records)} records; --steps must be above 5")
    out = {key: statistics.median(r.get(f"timing_s/{key}", 0.0) for r in records) for key in RUN_KEYS}
    out["worker_update"] = statistics.median(r["perf/update_actor_s"] for r in records)
    inner = ("gen", "update_actor", "reward", "adv", "old_log_prob")
    out["rest"] = statistics.median(
        r["timing_s/step"] - sum(r.get(f"timing_s/{k}", 0.0) for k in inner) for r in records
    )
    return out


def local_generation():
    """A callable running one worker's generation of one step, as the hybrid engine does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.models import bundled_model_path
    from verl.utils.dataset.arith import make_arith_rows
    from verl.workers.rollout.native.engine import GenerationEngine
    from verl.workers.rollout.sampling import SamplingParams

    path = bundled_model_path("arith-tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    rows, _ = make_arith_rows(num_train=16, num_test=0, seed=1)
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tokenizer(texts, return_tensors="pt", padding="max_length", max_length=32, add_special_tokens=False)
    input_ids, attention_mask = enc.input_ids.repeat_interleave(8, 0), enc.attention_mask.repeat_interleave(8, 0)
    params = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    engine = GenerationEngine.from_model(path, device="cpu", dtype=torch.float32)
    sampling = SamplingParams(do_sample=True, temperature=1.0)

    def step():
        engine.wake_up()
        engine.update_weights(params.items())
        with torch.inference_mode():
            engine.generate(
                input_ids,
                attention_mask,
                8,
                sampling,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        engine.sleep()

    return step


def local_update():
    """A callable running one worker's actor update of one step."""
    from transformers import AutoModelForCausalLM
    from update_layouts import MODEL, grpo_batch, make_actor

    data = grpo_batch(16, 8, seed=0)
    actor = make_actor(AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="sdpa"), len(data))
    return lambda: actor.update_policy(data)


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def print_top_ops(name: str, fn, iters: int, rows: int) -> None:
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(iters):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{name}: top operators by self CPU time over {iters} runs ({total / iters / 1e3:.1f} ms per run profiled)")
    for e in events[:rows]:
        share = 100 * e.self_cpu_time_total / total
        per_run = e.self_cpu_time_total / iters / 1e3
        print(f"  {share:5.1f}%  {per_run:7.2f} ms  {e.count // iters:5d} calls  {e.key}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="steps of the default run (0: skip it; default 20)")
    parser.add_argument("--repeats", type=int, default=30, help="timed repetitions of each local part (default 30)")
    parser.add_argument("--profile-iters", type=int, default=5, help="profiled repetitions of each (default 5)")
    parser.add_argument("--rows", type=int, default=15, help="operators printed per profile (default 15)")
    args = parser.parse_args(argv)
    if args.steps and args.steps <= 5:
        parser.error("--steps must be 0 or above 5 (the first 5 steps are left out)")

    fields = []
    if args.steps:
        phases = run_phases(args.steps)
        print("default run, median s per step: " + " ".join(f"{k}={v:.4f}" for k, v in phases.items()), flush=True)
        fields += [
            f"step_s={phases['step']:.3f}",
            f"gen_s={phases['gen']:.3f}",
            f"engine_s={phases['generate_sequences']:.3f}",
            f"update_s={phases['update_actor']:.3f}",
            f"worker_update_s={phases['worker_update']:.3f}",
            f"reward_s={phases['reward']:.4f}",
            f"rest_s={phases['rest']:.4f}",
        ]

    torch.set_num_threads(1)  # what each worker process runs with
    parts = {"gen": local_generation(), "update": local_update()}
    for name, fn in parts.items():
        ms = median_ms(fn, warmup=3, repeats=args.repeats)
        print(f"local {name}: {ms:.1f} ms (median of {args.repeats}, one thread)", flush=True)
        fields.append(f"local_{name}_ms={ms:.1f}")
    for name, fn in parts.items():
        print_top_ops(f"local {name}", fn, args.profile_iters, args.rows)
    print(bench_headline("step_profile", " ".join(fields)))


if __name__ == "__main__":
    main()
