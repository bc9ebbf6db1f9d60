"""Minutes of GRPO training to a held-out accuracy: our framework against TRL's `GRPOTrainer` (issue #9, part 2).

Both sides start from the bundled SFT model (`verl/assets/arith-tiny`, ~25% greedy accuracy) and
train on the arithmetic task with the same reward (our `arith` rule), the same hyper-parameters
(lr, batch, group size, mini-batch, lengths, temperature, weight decay, clip, KL; each defaults to
its current value in `verl/trainer/config/arith_demo.yaml` (the bundled demo config) and is passed explicitly to both), and
are evaluated the same way: greedy decoding of at most `--max-response-length` tokens on the 500
held-out test problems, scored by the first integer of the completion. The figure is the training
time until the first evaluation at or above `--threshold` (default 0.5).

- ours: `python -m verl.trainer.main_ppo` as a subprocess (2 worker processes by default) with
  `trainer.test_freq=--test-freq`; accuracy is the trainer's validation metric
  `val-core/arith/acc/mean@1`, and training time is the sum of `timing_s/step` of the steps up to
  that validation (both read from the file logger's metrics.jsonl while it runs; the run is stopped
  once the threshold is reached).
- TRL: `GRPOTrainer` in this process on CPU (`use_cpu=True`, fp32, no vLLM, `torch.set_num_threads`
  = our worker count) with a `TrainerCallback` that, every `--test-freq` generated batches, runs
  `verl.utils.dataset.arith.evaluate_greedy_accuracy` on the 500 test rows; training time is the sum
  of the step times (one `on_step_end` to the next) up to that evaluation.

Evaluation time is EXCLUDED on both sides (the two evaluators differ: ours runs validation through
the framework's rollout workers, TRL's callback uses transformers' `generate()` in-process), and so
is start-up (Ray, model loading). The second table also shows each side's periodic evaluation
time and the total with it included (the step-0 evaluation of the starting model, done by both
before training as our `trainer.val_before_train`, is in no figure). Both
sides check the threshold only every `--test-freq` batches, so times are resolved to that many
steps. Each side stops at the threshold or after `--max-minutes` of training time, whichever comes
first; a side that never reaches the threshold reports `inf`. ratio = ours_min / trl_min (the issue's
goal: at most 0.5).

A "step" here is one generated batch (`--batch-size` prompts x `--n` completions) on both sides.
TRL's own `global_step` counts optimizer steps, which is the same unless `--mini-batch-size` is
smaller than `--batch-size`.

Run:
    python benchmarks/time_to_accuracy.py                        # threshold 0.5, 30 min cap each
    python benchmarks/time_to_accuracy.py --threshold 0.9 --max-minutes 60
    python benchmarks/time_to_accuracy.py --max-steps 2 --test-freq 1     # smoke run
"""

from __future__ import annotations

import argparse
import math
import tempfile

from grpo_common import (
    GRPOSetup,
    add_setup_args,
    make_step_clock_class,
    make_trl_trainer,
    run_ours,
    setup_from_args,
    yaml_test_freq,
)

from verl.utils.machine import bench_headline

VAL_KEY = "val-core/arith/acc/mean@1"


def ours_time_to_accuracy(setup: GRPOSetup, threshold: float, test_freq: int, max_steps: int, max_s: float) -> dict:
    """Train ours until validation accuracy >= threshold or max_s of step time; the evaluation curve."""
    state = {"train_s": 0.0, "eval_s": 0.0, "curve": [], "reached_s": math.inf}

    def on_record(record: dict) -> bool:
        data = record["data"]
        state["train_s"] += data.get("timing_s/step", 0.0)
        state["eval_s"] += data.get("timing_s/testing", 0.0)
        if VAL_KEY in data:
            state["curve"].append((record["step"], state["train_s"], data[VAL_KEY]))
            if data[VAL_KEY] >= threshold:
                state["reached_s"] = state["train_s"]
                return True
        return state["train_s"] >= max_s

    result = run_ours(setup, total_steps=max_steps, test_freq=test_freq, val_before_train=True, on_record=on_record)
    if not state["curve"]:
        raise SystemExit(f"main_ppo logged no {VAL_KEY}; is the validation set the arith test split?")
    print(f"ours: {result.wall_s / 60:.1f} min wall including start-up and validation", flush=True)
    return state


def trl_time_to_accuracy(
    setup: GRPOSetup,
    threshold: float,
    test_freq: int,
    max_steps: int,
    max_s: float,
    train_rows: list[dict],
    test_rows: list[dict],
    micro_batch: int | None,
) -> dict:
    import torch

    from verl.utils.dataset.arith import evaluate_greedy_accuracy

    torch.set_num_threads(setup.workers)
    optimizer_steps_per_batch = setup.batch_size // setup.mini_batch_size
    state = {"curve": [], "reached_s": math.inf}

    def accuracy(model, tokenizer) -> float:
        return evaluate_greedy_accuracy(model, tokenizer, test_rows, max_new_tokens=setup.max_response_length)

    class EvalEveryK(make_step_clock_class()):
        """Evaluates every `test_freq` generated batches and at the last step (as our trainer
        validates at its last step too); stops at the threshold or the time cap."""

        def evaluate(self, state_, control, model=None, processing_class=None, **kwargs) -> None:
            train_s = sum(self.step_seconds)
            batches, remainder = divmod(state_.global_step, optimizer_steps_per_batch)
            due = batches % test_freq == 0 or state_.global_step >= state_.max_steps
            if remainder == 0 and due:
                acc = accuracy(model, processing_class)
                state["curve"].append((batches, train_s, acc))
                if acc >= threshold:
                    state["reached_s"] = train_s
                    control.should_training_stop = True
            if train_s >= max_s:
                control.should_training_stop = True

    clock = EvalEveryK()
    with tempfile.TemporaryDirectory(prefix="trl-tta-") as out:
        trainer, _ = make_trl_trainer(
            setup,
            train_rows,
            out,
            max_steps=max_steps * optimizer_steps_per_batch,
            callbacks=[clock],
            micro_batch_size=micro_batch,
        )
        # Step 0 (like our val_before_train), outside the step clock and the evaluation total.
        state["curve"].append((0, 0.0, accuracy(trainer.model, trainer.processing_class)))
        if state["curve"][0][2] >= threshold:
            state["reached_s"] = 0.0
        else:
            trainer.train()
    state["train_s"], state["eval_s"] = sum(clock.step_seconds), clock.eval_seconds
    return state


def _minutes(seconds: float) -> float:
    return seconds / 60 if math.isfinite(seconds) else math.inf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threshold", type=float, default=0.5, help="held-out greedy accuracy to reach (default 0.5)")
    parser.add_argument(
        "--max-minutes", type=float, default=30.0, help="training-time cap per side, in minutes (default 30)"
    )
    parser.add_argument(
        "--test-freq",
        type=int,
        default=yaml_test_freq(),
        help="evaluate every this many steps on both sides (default: trainer.test_freq of the demo config)",
    )
    parser.add_argument("--max-steps", type=int, default=5000, help="step cap per side (default 5000)")
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="TRL per_device_train_batch_size in completions (default: a whole mini-batch in one forward)",
    )
    add_setup_args(parser)
    args = parser.parse_args(argv)
    setup = setup_from_args(args)
    if args.test_freq < 1 or args.max_steps < 1:
        parser.error("--test-freq and --max-steps must be at least 1")
    max_s = args.max_minutes * 60

    from verl.utils.dataset.arith import ensure_arith_data, load_rows

    train_path, test_path = ensure_arith_data()
    train_rows, test_rows = load_rows(train_path), load_rows(test_path)
    print(f"setup: {setup}", flush=True)
    ours = ours_time_to_accuracy(setup, args.threshold, args.test_freq, args.max_steps, max_s)
    trl = trl_time_to_accuracy(
        setup, args.threshold, args.test_freq, args.max_steps, max_s, train_rows, test_rows, args.trl_micro_batch
    )

    print(f"\n{'side':6}{'step':>6}{'train min':>11}{'accuracy':>10}")
    for name, side in (("ours", ours), ("TRL", trl)):
        for step, train_s, accuracy in side["curve"]:
            print(f"{name:6}{step:6d}{train_s / 60:11.2f}{accuracy:10.3f}")
    print(f"\n{'side':6}{'reached min':>13}{'train min':>11}{'eval min':>10}{'total min':>11}")
    for name, side in (("ours", ours), ("TRL", trl)):
        print(
            f"{name:6}{_minutes(side['reached_s']):13.2f}{side['train_s'] / 60:11.2f}{side['eval_s'] / 60:10.2f}"
            f"{(side['train_s'] + side['eval_s']) / 60:11.2f}"
        )
    ours_min, trl_min = _minutes(ours["reached_s"]), _minutes(trl["reached_s"])
    ratio = ours_min / trl_min if trl_min > 0 and not (math.isinf(ours_min) and math.isinf(trl_min)) else math.nan
    print(
        bench_headline(
            "time_to_accuracy",
            f"threshold={args.threshold} ours_min={ours_min:.2f} trl_min={trl_min:.2f} ratio={ratio:.2f}",
        )
    )


if __name__ == "__main__":
    main()
