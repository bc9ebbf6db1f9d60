"""The default run from two source trees, alternated in ABBA order (issue #31).

Compares a change end to end on a shared machine: `main_ppo --config-name=arith_demo` (through
`grpo_common.run_ours`, the `grpo_vs_trl` setup) runs from the `--before` tree and from this
checkout in turn (`--rounds 2`: before, after, after, before), and each run reports the medians
of its step phases (steps after the first 5) and, sampled from /proc over `--sample-s` seconds
mid-run, each worker process's own CPU time per step.

Read the CPU time per step first: on a loaded machine wall-clock step times measure the other jobs
as much as the code, a worker's own CPU time much less. A change that removes waiting (one rank
idle until the other arrives) shows in the wall-clock update time only, not in CPU time.

    mkdir -p /tmp/before && git archive main | tar -x -C /tmp/before   # the tree to compare against
    python benchmarks/tree_abba.py --before /tmp/before        # 2 rounds of 40 steps per tree

Last line: `bench tree_abba: cpu_ms_before=... cpu_ms_after=... step_s_before=... step_s_after=...
update_s_before=... update_s_after=... cpu=... load1=...` (medians over runs).
"""

from __future__ import annotations

import argparse
import os
import statistics

from grpo_common import REPO
from worker_page_faults import sampled_run

from verl.utils.machine import bench_headline


def one_run(repo: str, steps: int, sample_s: float) -> dict[str, float]:
    """One default run from `repo`; the workers' CPU ms per step over `sample_s` s after step 8."""
    run = sampled_run(steps, sample_s, repo=repo)
    return {key: run[key] for key in ("cpu_ms", "step_s", "gen_s", "update_s", "worker_update_s")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the source tree to compare this checkout against")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40; at least 20)")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds: before, after, after, before per 2")
    parser.add_argument("--sample-s", type=float, default=6.0, help="seconds of /proc sampling per run (default 6)")
    args = parser.parse_args(argv)
    if args.steps < 20:
        parser.error("--steps must be at least 20 (8 before the sampling starts, the first 5 left out)")
    if not os.path.isdir(os.path.join(args.before, "verl")):
        parser.error(f"--before {args.before!r} holds no verl package")
    trees = {"before": os.path.abspath(args.before), "after": REPO}
    order = [("before", "after") if i % 2 == 0 else ("after", "before") for i in range(args.rounds)]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for pair in order:
        for side in pair:
            run = one_run(trees[side], args.steps, args.sample_s)
            runs[side].append(run)
            print(f"{side:6s}: " + " ".join(f"{k}={v:.4g}" for k, v in run.items()), f"load1={os.getloadavg()[0]:.1f}")
    fields = " ".join(
        f"{key}_{side}={statistics.median(r[key] for r in runs[side]):.4g}"
        for key in ("cpu_ms", "step_s", "update_s")
        for side in ("before", "after")
    )
    print(bench_headline("tree_abba", fields))


if __name__ == "__main__":
    main()
