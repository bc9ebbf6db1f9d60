"""What the end-to-end `python -m verl.trainer.main_ppo` tests share: the per-run environment and
overrides (every run writes its data, metrics, checkpoints and MLflow store under its own tmp_path),
the CPU demo script on small batches (`demo_script_cmd`), a run to completion (optionally joining the
session's shared Ray cluster), a run killed with -9 right after a checkpoint, and a module's runs
started side by side (`start_module_runs`).

The runs stay subprocesses: each parses its command line, builds its config and exits on its own,
so no run leaves state (env, trackers, Ray actors) in pytest's process for the next test.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# GRPO on the bundled tiny model, 2 worker processes; the base of most end-to-end runs
DEMO_SCRIPT = "examples/grpo_trainer/run_arith_tiny_cpu.sh"


def model_path() -> str:
    from verl.models import bundled_model_path

    return bundled_model_path()


def run_env(tmp_path: Path) -> dict:
    """The environment of a run writing under `tmp_path`: its data set cache, metrics file, MLflow store."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        PYTHON=sys.executable,
        VERL_CACHE_DIR=str(tmp_path / "cache"),
        VERL_FILE_LOGGER_PATH=str(tmp_path / "metrics.jsonl"),
        MLFLOW_TRACKING_URI=f"file:{tmp_path / 'mlruns'}",
        RAY_DEDUP_LOGS="0",
    )
    return env


def imported_modules(importtime_stderr: str) -> set[str]:
    """The modules a `python -X importtime` run imported (its stderr lines `import time: a | b | name`)."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def main_ppo_cmd(config_name: str, *overrides: str) -> list[str]:
    """`python -m verl.trainer.main_ppo --config-name=<config_name> <overrides>` with this interpreter."""
    return [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-name={config_name}", *overrides]


def common_overrides(tmp_path: Path, steps: int, model: str | None = None) -> list[str]:
    """`steps` training steps on `model` (default: the bundled one), no validation, metrics to
    console and file, checkpoints and the run directory under `tmp_path`."""
    return [
        f"actor_rollout_ref.model.path={model or model_path()}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]


def demo_script_cmd(
    tmp_path: Path, steps: int, *overrides: str, batch: int = 4, n: int = 4, ranks: int = 2
) -> list[str]:
    """The CPU demo script for `steps` steps on `batch` prompts x `n` samples a step (the script's
    own 32 x 8 takes several times longer and proves nothing more about the features these tests
    switch on), over `ranks` worker processes, each micro batch a rank's whole share; then `overrides`
    (later overrides of a key win)."""
    rows_per_rank = batch * n // ranks
    return [
        "bash",
        DEMO_SCRIPT,
        *common_overrides(tmp_path, steps),
        f"trainer.n_gpus_per_node={ranks}",
        f"data.train_batch_size={batch}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows_per_rank}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows_per_rank}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={rows_per_rank}",
        *overrides,
    ]


def read_metrics(tmp_path: Path) -> list[dict]:
    """The file logger's records of the run under `tmp_path`, in the order written."""
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def run_main_ppo(
    cmd: list[str], tmp_path: Path, timeout: int = 420, cluster=None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `cmd` to completion in `run_env(tmp_path)` (updated with `env`); with `cluster` (the
    `shared_ray_cluster` fixture) it joins that cluster instead of starting its own. A non-zero exit
    fails with the run's output tails."""
    run_env_ = {**run_env(tmp_path), **(env or {})}
    if cluster is not None:
        run_env_, cmd = cluster.env_for(run_env_), [*cmd, *cluster.overrides_for(run_env_)]
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env_, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )
    return proc


def _wait_for_checkpoint(ckpt: Path, step: int, proc: subprocess.Popen, timeout: float) -> None:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tracker.exists() and tracker.read_text().strip() == str(step):
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before checkpoint {step}")
        time.sleep(0.02)  # a step of the tiny runs takes ~0.2 s
    raise AssertionError(f"no checkpoint {step} within {timeout} s")


def run_and_kill_9_after_checkpoint(cmd: list[str], run_dir: Path, step: int) -> None:
    """Start `cmd` and, once checkpoint `step` is saved, SIGKILL every process of the run at once
    (driver, Ray daemons, TaskRunner, workers), as a machine crash would. Killing the driver's
    process group alone is not that: Ray's worker processes are outside it, and the TaskRunner,
    which runs the training loop, goes on training and checkpointing for about a second, until Ray
    notices that its driver is gone. The run starts a cluster of its own: the kill takes its Ray
    daemons down too, which must not be the session's."""
    import uuid

    from tests.reliability.reliability_helpers import RUN_ID_VAR, kill_run, wait_until_gone

    run_id = uuid.uuid4().hex
    env = {**run_env(run_dir), RUN_ID_VAR: run_id}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_for_checkpoint(run_dir / "ckpt", step, proc, timeout=300)
    finally:
        kill_run(run_id)
        proc.wait()
        left = wait_until_gone(run_id, timeout_s=15)
    assert left == [], left
    tracker = (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == str(step), f"the run saved checkpoint {tracker} before the kill landed; the test needs {step}"


# Runs at once in `start_module_runs`. A run is mostly start-up that uses one core or waits (imports,
# the Ray job, its worker processes, the model load, messages between driver, TaskRunner and
# workers), so on CI's 2 cores runs side by side take much less than their sum (docs/testing.md,
# "CI time"); more at once only queue for the cores.
MAX_CONCURRENT_RUNS = 3


@contextlib.contextmanager
def start_module_runs(request, runs: dict, test_runs: dict, tmp_path_factory, cluster, max_concurrent: int = 0):
    """For a module fixture: start every run that the module's selected tests read, all at once (at
    most `max_concurrent`, default MAX_CONCURRENT_RUNS, at a time, in `runs` order), and yield
    {name: future}; a test's `.result()` waits for its run and re-raises the run's failure (with its
    output) in that test.

    `runs` maps a name to a function (its own new directory, `cluster`, the started futures) -> what
    the tests read; `test_runs` maps a test function's name to the names of the runs it reads. A run
    may wait for an earlier one's future (to resume from its checkpoint): the pool starts runs in
    `runs` order, so the one it waits for is already running or done. A run function does its work in
    the subprocess it starts, not in pytest's process: runs execute in threads, and transformers'
    lazy imports are not thread-safe (two threads building models at once failed with an ImportError
    of `PreTrainedTokenizerFast`), so models are built in the fixture, before the runs start."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    unknown = set(test_runs) - {name for name in dir(request.module) if name.startswith("test_")}
    assert not unknown, f"test_runs names tests that {request.module.__name__} does not define: {sorted(unknown)}"
    missing = {name for names in test_runs.values() for name in names} - set(runs)
    assert not missing, f"test_runs names runs that runs does not define: {sorted(missing)}"
    wanted = {name for test, names in test_runs.items() if test in selected for name in names}
    started: dict[str, Future] = {}
    with ThreadPoolExecutor(max_concurrent or MAX_CONCURRENT_RUNS) as pool:
        for name, run in runs.items():
            if name in wanted:
                started[name] = pool.submit(run, tmp_path_factory.mktemp(name), cluster, started)
        yield started
