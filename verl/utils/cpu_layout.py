"""How many worker processes, and how many threads each, a CPU run uses when the user leaves it to us.

On CPU a worker is a process (`trainer.n_gpus_per_node` of them per node, joined by gloo) and each
runs `torch.get_num_threads()` threads. The same cores can be split two ways: more processes (data
parallel: each generates and trains on its share of the batch, then one gradient all-reduce) or
more threads per process (intra-op parallel: every matmul and elementwise op split across threads).

The rule, and why (measurements in docs/benchmarks.md, "Worker layout chosen automatically"):

- Processes first: one worker process per usable core, one thread each. On the 2-core Xeon the
  default GRPO step took 0.188 s with 2 processes x 1 thread against 0.208 s with 1 process x 2
  threads; the built-in engine's decode steps are too small to use a second thread, and even the
  update scaled better across processes (128 rows on 1 thread: 71.6 ms; 256 rows on 2 threads:
  78.3 ms), because the only cross-process cost is one gradient all-reduce per optimizer step.
- At most `MAX_AUTO_WORKERS` processes; cores beyond that become threads. Each process holds a
  full copy of the rollout weights and its own Python and Ray overhead, and the all-reduce grows
  with the ranks. This cap is an extrapolation (only 2-core machines were measured); an explicit
  `trainer.n_gpus_per_node` or `OMP_NUM_THREADS` overrides it.
- The process count divides the batch: `data.train_batch_size x rollout.n` rows and the actor's
  `ppo_mini_batch_size x rollout.n` must split evenly across ranks (the config check refuses
  otherwise), so the largest such count not above the cores is chosen.
- Threads per process: the usable cores of the node divided by the worker processes of all pools
  on it (a rollout pool beside the trainer's counts; at least 1), unless the user set
  `OMP_NUM_THREADS` (that wins, for every worker). Worker groups colocated on the same bundles
  (a critic beside the actor) are not counted: they take turns, phase by phase.

What the rule leaves out, deliberately: the model size. A larger model makes each matmul bigger,
which favours threads, but it also makes the gradient all-reduce bigger; no machine here was
measured where that changes the answer, so the rule does not guess.

Where it applies: the bundled demo config sets `trainer.n_gpus_per_node` to
`${verl_cpu_workers:...}` (resolved by `verl.trainer.config.loader`), so on CUDA it stays the
number written there and on CPU it is `choose_cpu_workers`'s answer; a value given on the command
line replaces the interpolation and is used as given. The threads are set by the Ray worker group
(`cpu_worker_thread_env`) for every CPU worker group, whoever chose the process count.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from verl.utils.machine import usable_cores

MAX_AUTO_WORKERS = 8
"""The most worker processes chosen automatically per node; cores beyond it become threads."""

THREADS_VAR = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class CpuLayout:
    """Worker processes per node x threads per process, and why."""

    workers: int
    threads: int
    reason: str

    def describe(self) -> str:
        return f"{self.workers} worker process(es) x {self.threads} thread(s) each: {self.reason}"


def choose_cpu_workers(cores: int, rows_per_step: int, mini_batch_rows: int | None = None) -> CpuLayout:
    """The automatic layout for `cores` usable cores and a batch of `rows_per_step` rows.

    cores: usable cores of the node (`os.sched_getaffinity`).
    rows_per_step: `data.train_batch_size x rollout.n` (sequences per step).
    mini_batch_rows: the actor's `ppo_mini_batch_size x rollout.n` (None: same as rows_per_step).
    """
    if cores < 1 or rows_per_step < 1:
        raise ValueError(f"choose_cpu_workers needs cores >= 1 and rows_per_step >= 1, got {cores} and {rows_per_step}")
    mini = rows_per_step if mini_batch_rows is None else mini_batch_rows
    cap = min(cores, MAX_AUTO_WORKERS)
    workers = next(w for w in range(cap, 0, -1) if rows_per_step % w == 0 and mini % w == 0)
    threads = max(1, cores // workers)
    why = [f"{cores} usable core(s), one process per core"]
    if cores > MAX_AUTO_WORKERS:
        why.append(f"at most {MAX_AUTO_WORKERS} processes, the other cores as threads")
    if workers < cap:
        why.append(f"{workers} is the most that divides the {rows_per_step}-row batch and {mini}-row mini-batch")
    return CpuLayout(workers, threads, "; ".join(why))


def threads_per_worker(cores: int, workers_on_node: int) -> int:
    """Threads for each of `workers_on_node` processes sharing `cores` usable cores (at least 1)."""
    return max(1, cores // max(1, workers_on_node))


def user_threads(*envs: Mapping[str, str]) -> str | None:
    """The user's `OMP_NUM_THREADS`, from the first environment that sets it (None: not set)."""
    for env in envs:
        if env.get(THREADS_VAR):
            return env[THREADS_VAR]
    return None


def cpu_worker_thread_env(use_gpu: bool, workers_on_node: int, *user_envs: Mapping[str, str]) -> dict[str, str]:
    """`{"OMP_NUM_THREADS": n}` for a CPU worker's environment, or {} when the user set it or on GPU.

    Without it Ray starts every actor with `OMP_NUM_THREADS=1` (a fractional CPU bundle), so a
    single CPU worker on a many-core node would use one core. The node's cores are those this
    driver process may use: a multi-node CPU run assumes its nodes alike (set OMP_NUM_THREADS
    otherwise).
    """
    if use_gpu or user_threads(*user_envs) is not None:
        return {}
    return {THREADS_VAR: str(threads_per_worker(usable_cores(), workers_on_node))}


def resolve_cpu_workers(device: str, gpu_workers, train_batch_size, rollout_n, mini_batch_size=None) -> int:
    """`${verl_cpu_workers:device,gpu_workers,train_batch_size,rollout_n[,ppo_mini_batch_size]}`.

    On CUDA (`device` cuda, or auto with a GPU visible) the workers per node are `gpu_workers`; on
    CPU, `choose_cpu_workers` decides from this machine's usable cores and the batch.
    """
    from verl.utils.device import preference_uses_accelerator  # imports torch: only when the resolver runs

    if preference_uses_accelerator(str(device)):
        return int(gpu_workers)
    try:
        n = int(rollout_n)
        rows = int(train_batch_size) * n
        mini = None if mini_batch_size is None else int(mini_batch_size) * n
        layout = choose_cpu_workers(usable_cores(), rows, mini)
    except (TypeError, ValueError):
        # a bad batch value (`data.train_batch_size=abc`, or 0): the config check reports it under its
        # own key; failing here would report this interpolation instead
        return min(usable_cores(), MAX_AUTO_WORKERS)
    print(f"verl: {layout_line(layout, user_threads(os.environ))}", file=sys.stderr)
    return layout.workers


def layout_line(layout: CpuLayout, threads_given: str | None) -> str:
    """The start-up line that says which layout was chosen, why, and how to choose another."""
    if threads_given is None:
        return (
            f"CPU layout chosen automatically: {layout.describe()} "
            "(set trainer.n_gpus_per_node and/or OMP_NUM_THREADS to choose another)"
        )
    return (
        f"CPU layout chosen automatically: {layout.workers} worker process(es) ({layout.reason}), "
        f"each with OMP_NUM_THREADS={threads_given} thread(s) as set (set trainer.n_gpus_per_node to choose the "
        "process count)"
    )
