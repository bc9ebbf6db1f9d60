"""The default run with the CPU workers' malloc settings off and on, alternated (issue #31).

`verl.single_controller.ray.cpu_allocator` starts CPU workers with glibc settings that keep freed
memory, so a step does not fault the pages of its re-allocated tensors in again. This runs
`main_ppo --config-name=arith_demo` (through `grpo_common.run_ours`) with
`VERL_CPU_MALLOC_TUNING` alternating in ABBA order (`--rounds 2`: off, on, on, off) and reports,
per run, the medians of the step's phases (steps after the first 5) and, sampled from /proc over
`--sample-s` seconds mid-run, each worker process's minor page faults and CPU time per step.

CPU time per step is the figure to compare on a shared machine: wall-clock step times there
measure the other jobs as much as the code; a worker's own CPU time moves much less with them.

    python benchmarks/worker_page_faults.py                 # 2 rounds of 40 steps per setting
    python benchmarks/worker_page_faults.py --steps 60 --rounds 1

Last line: `bench worker_page_faults: faults_off=... faults_on=... cpu_ms_off=... cpu_ms_on=...
step_s_off=... step_s_on=... cpu=... load1=...` (medians over runs of the per-worker means).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time

from verl.single_controller.ray.cpu_allocator import TUNING_SWITCH
from verl.utils.machine import bench_headline

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `root`."""
    rows = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[tuple[int, str]]] = {}
    for line in rows.splitlines()[1:]:
        parts = line.split(None, 2)
        children.setdefault(int(parts[1]), []).append((int(parts[0]), parts[2] if len(parts) > 2 else ""))
    found, stack = [], [root]
    while stack:
        for pid, args in children.get(stack.pop(), []):
            found.append((pid, args))
            stack.append(pid)
    return found


def _faults_and_cpu_s(pid: int) -> tuple[int, float]:
    """Minor page faults and user + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]), (int(fields[11]) + int(fields[12])) * _TICK_S


def sampled_run(steps: int, sample_s: float, repo: str | None = None) -> dict[str, float]:
    """One default run (from the source tree `repo`, default this checkout); the workers' page faults
    and CPU ms per step over `sample_s` s after step 8, and the medians of the step phases after the
    first 5 steps (also `perf/update_actor_s`, the workers' own update time)."""
    from grpo_common import GRPOSetup, run_ours, step_records

    done_steps, result = [0], {}

    def count(record: dict) -> bool:
        done_steps[0] += "timing_s/step" in record["data"]
        return False

    extra = {} if repo is None else {"repo": repo}
    runner = threading.Thread(target=lambda: result.update(r=run_ours(GRPOSetup(), steps, on_record=count, **extra)))
    runner.start()
    while done_steps[0] < 8 and runner.is_alive():
        time.sleep(0.2)
    workers = [pid for pid, args in _descendants(os.getpid()) if "WorkerDict" in args]
    before, steps_before = {p: _faults_and_cpu_s(p) for p in workers}, done_steps[0]
    time.sleep(sample_s)
    after, sampled = {p: _faults_and_cpu_s(p) for p in workers}, done_steps[0] - steps_before
    runner.join()
    if not workers or sampled < 1 or "r" not in result:
        raise SystemExit(f"no worker processes or no steps sampled (workers {workers}, steps {sampled}); raise --steps")
    records = [r["data"] for r in step_records(result["r"].records)][5:]
    return {
        "faults": statistics.mean((after[p][0] - before[p][0]) / sampled for p in workers),
        "cpu_ms": statistics.mean(1e3 * (after[p][1] - before[p][1]) / sampled for p in workers),
        "step_s": statistics.median(r["timing_s/step"] for r in records),
        "gen_s": statistics.median(r["timing_s/gen"] for r in records),
        "update_s": statistics.median(r["timing_s/update_actor"] for r in records),
        "worker_update_s": statistics.median(r.get("perf/update_actor_s", float("nan")) for r in records),
    }


def one_run(tuned: bool, steps: int, sample_s: float) -> dict[str, float]:
    """One default run with the malloc settings off or on (`sampled_run`)."""
    os.environ[TUNING_SWITCH] = "1" if tuned else "0"
    return sampled_run(steps, sample_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40; at least 20)")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds: off, on, on, off per 2 (default 2)")
    parser.add_argument("--sample-s", type=float, default=6.0, help="seconds of /proc sampling per run (default 6)")
    args = parser.parse_args(argv)
    if args.steps < 20:
        parser.error("--steps must be at least 20 (8 before the sampling starts, the first 5 left out)")
    order = [(False, True) if i % 2 == 0 else (True, False) for i in range(args.rounds)]
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for pair in order:
        for tuned in pair:
            run = one_run(tuned, args.steps, args.sample_s)
            runs[tuned].append(run)
            print(
                f"malloc settings {'on ' if tuned else 'off'}: " + " ".join(f"{k}={v:.4g}" for k, v in run.items()),
                f"load1={os.getloadavg()[0]:.1f}",
                flush=True,
            )
    med = {(t, k): statistics.median(r[k] for r in runs[t]) for t in runs for k in runs[t][0]}
    fields = " ".join(
        f"{key}_{'on' if tuned else 'off'}={med[tuned, key]:.4g}"
        for key in ("faults", "cpu_ms", "step_s")
        for tuned in (False, True)
    )
    print(bench_headline("worker_page_faults", fields))


if __name__ == "__main__":
    main()
