"""Generation ahead of training: wall-clock and final accuracy at 0, 1 and 2 steps ahead (issue #12),
plus weights synced every 2 updates and partial rollouts.

Each setting runs `python -m verl.trainer.main_ppo` for the same number of steps from the bundled
SFT model on the arithmetic task, with the same total number of CPU worker processes:

- ahead=0: the synchronous colocated step, `trainer.n_gpus_per_node=--workers` (hybrid engine);
- ahead=k>=1: `async_training.staleness_threshold=k`, the workers split into a trainer pool and a
  rollout pool (`--rollout-workers` of them), generation of the next batches overlapping training;
- `2s2`: k=2 with `async_training.trigger_parameter_sync_step=2` (weights pushed every 2 updates);
- `1p`: k=1 with `async_training.partial_rollout=true` (weights taken mid-generation, checked every
  decode step); `mixed` reports the fraction of trained samples whose tokens span two versions;
- a fraction such as `0.5` (not run by default): half of each next batch generated ahead.

Reported per setting: training wall-clock (sum of `timing_s/step`, start-up and validation
excluded), the trainer's idle time waiting for samples (`timing_s/wait_rollout`), the greedy
accuracy on the 500 held-out problems after the last step (`val-core/arith/acc/mean@1`) and the
mean staleness of the trained samples. ratio = time(ahead=k) / time(ahead=0). The trade-off: more
overlap (less idle time) against older samples (staleness up to k weight versions), corrected by
`async_training.off_policy_correction` (decoupled PPO by default).

Run:
    python benchmarks/async_ahead.py                      # 40 steps each
    python benchmarks/async_ahead.py --steps 2            # smoke run
    python benchmarks/async_ahead.py --ahead 0 1          # a subset of the settings
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from verl.utils.machine import bench_headline

ROOT = Path(__file__).resolve().parents[1]
VAL_KEY = "val-core/arith/acc/mean@1"


def parse_setting(text: str) -> tuple[float, int, bool]:
    """'2' -> (ahead 2, sync every 1, no partial rollouts); '2s2' -> sync every 2; '1p' -> partial;
    '0.5' -> half a batch ahead."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(?:s(\d+))?(p?)", text)
    if m is None:
        raise SystemExit(
            f"--ahead {text!r}: expected K (0.5: half a batch), KsN (sync every N updates) or Kp (partial)"
        )
    ahead = float(m.group(1))
    return (int(ahead) if ahead.is_integer() else ahead), int(m.group(2) or 1), bool(m.group(3))


def run(setting: str, args, workdir: Path) -> dict:
    from verl.models import bundled_model_path

    ahead, sync_every, partial = parse_setting(setting)

    metrics_file = workdir / "metrics.jsonl"
    workers = [f"trainer.n_gpus_per_node={args.workers}"]
    if ahead:
        workers = [
            f"trainer.n_gpus_per_node={args.workers - args.rollout_workers}",
            f"rollout.n_gpus_per_node={args.rollout_workers}",
        ]
    cmd = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        "--config-name=arith_demo",
        f"actor_rollout_ref.model.path={bundled_model_path()}",
        "trainer.device=cpu",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.steps}",
        "trainer.val_before_train=False",
        "trainer.logger=[file]",
        f"trainer.default_local_dir={workdir / 'ckpt'}",
        f"trainer.run_dir={workdir / 'run'}",
        f"data.train_batch_size={args.batch_size}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch_size}",
        f"actor_rollout_ref.rollout.n={args.n}",
        # the per-rank mini-batch when every worker trains (ahead=0), half of it with one rollout worker
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch_size * args.n // args.workers}",
        f"async_training.staleness_threshold={ahead}",
        *workers,
    ]
    if sync_every > 1:
        cmd.append(f"async_training.trigger_parameter_sync_step={sync_every}")
    if partial:
        cmd += ["async_training.partial_rollout=true", "async_training.partial_rollout_check_steps=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), VERL_FILE_LOGGER_PATH=str(metrics_file))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ahead={setting} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = [json.loads(line)["data"] for line in metrics_file.read_text().splitlines() if line.strip()]
    train = [r for r in records if "timing_s/step" in r]
    return {
        "time_s": sum(r["timing_s/step"] for r in train),
        "wait_s": sum(r.get("timing_s/wait_rollout", 0.0) for r in train),
        "acc": next((r[VAL_KEY] for r in reversed(records) if VAL_KEY in r), float("nan")),
        "staleness": sum(r.get("async/staleness_mean", 0.0) for r in train) / max(1, len(train)),
        "syncs": max((r.get("async/weight_syncs", 0.0) for r in train), default=0.0),
        "mixed": sum(r.get("async/mixed_version_frac", 0.0) for r in train) / max(1, len(train)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="worker processes in total, every setting")
    parser.add_argument("--rollout-workers", type=int, default=1, help="of which in the rollout pool (ahead >= 1)")
    parser.add_argument(
        "--ahead", nargs="+", default=["0", "1", "2", "2s2", "1p"], help="settings: K, KsN (sync every N), Kp (partial)"
    )
    args = parser.parse_args()
    results = {}
    for ahead in args.ahead:
        with tempfile.TemporaryDirectory() as tmp:
            results[ahead] = run(ahead, args, Path(tmp))
        r = results[ahead]
        print(
            f"ahead={ahead}: train {r['time_s']:.1f} s (waiting for rollout {r['wait_s']:.1f} s), "
            f"final greedy acc {r['acc']:.3f}, mean staleness {r['staleness']:.2f}, weight syncs {r['syncs']:.0f}, "
            f"mixed-version samples {r['mixed']:.2f}",
            flush=True,
        )
    base = results[args.ahead[0]]["time_s"]
    fields = []
    for ahead, r in results.items():
        fields += [f"time_s_{ahead}={r['time_s']:.1f}", f"acc_{ahead}={r['acc']:.3f}"]
        fields.append(f"ratio_{ahead}={r['time_s'] / base:.2f}")
    print(bench_headline("async_ahead", f"steps={args.steps} " + " ".join(fields)))


if __name__ == "__main__":
    main()
