"""What the reliability tests share: one small, fast run configuration, bad data files, a way to find
every process a run started (to kill a worker, and to prove none is left), and checkpoint fingerprints.

Every process of a run launched by `launch` carries `VERL_TEST_RUN=<id>` in its environment (Ray
passes the driver's environment on to its daemons and workers), so the processes of one run are
found exactly, never by name: other runs, and other people's Ray clusters, are left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
RUN_ID_VAR = "VERL_TEST_RUN"


def model_path() -> str:
    from verl.models import bundled_model_path

    return bundled_model_path()


# The bundled demo config (`arith_demo`, CPU settings of the tiny model) that small_run's overrides
# start from: pass it to main_ppo, or config_name="arith_demo" to load_ppo_config.
DEMO = "--config-name=arith_demo"


def small_run(tmp: Path, steps: int = 2) -> list[str]:
    """Overrides of the demo config for a cheap 2-worker GRPO run of the bundled tiny model: 4 prompts x 2 samples."""
    return [
        f"actor_rollout_ref.model.path={model_path()}",
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        f"trainer.run_dir={tmp / 'run'}",
    ]


def run_env(tmp: Path, run_id: str | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        VERL_CACHE_DIR=str(tmp / "cache"),
        VERL_FILE_LOGGER_PATH=str(tmp / "metrics.jsonl"),
        RAY_DEDUP_LOGS="0",
        TOKENIZERS_PARALLELISM="false",
    )
    if run_id:
        env[RUN_ID_VAR] = run_id
    return env


def launch(args: list[str], tmp: Path, log_name: str = "run.log") -> tuple[subprocess.Popen, str, Path]:
    """Start `python -m verl.trainer.main_ppo ARGS` in its own session (like a terminal job).
    Returns (process, run id, log file holding its stdout and stderr)."""
    run_id = uuid.uuid4().hex
    log = tmp / log_name
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "verl.trainer.main_ppo", *args],
            cwd=ROOT,
            env=run_env(tmp, run_id),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # a terminal job takes Ctrl-C: undo an ignored SIGINT inherited from a CI job started in
            # the background (non-interactive shells start `cmd &` with SIGINT ignored, and Python
            # then never raises KeyboardInterrupt)
            preexec_fn=_default_sigint,
        )
    return proc, run_id, log


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_processes(run_id: str) -> list[psutil.Process]:
    """Every live process started by the run `run_id` (driver, Ray daemons, TaskRunner, workers)."""
    marker = f"{RUN_ID_VAR}={run_id}".encode()
    found = []
    for proc in psutil.process_iter():
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if marker in f.read() and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def worker_pid(run_id: str, rank: int) -> int:
    """PID of the worker process of `rank` (its environment holds RANK, set by the worker group)."""
    for proc in run_processes(run_id):
        try:
            env = proc.environ()
            if env.get("RANK") == str(rank) and "WorkerDict" in " ".join(proc.cmdline()):
                return proc.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of rank {rank} among the run's processes")


def wait_until_gone(run_id: str, timeout_s: float) -> list[str]:
    """Wait for every process of the run to exit; returns descriptions of those still alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = run_processes(run_id)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    described = []
    for proc in left:
        try:
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            continue
    return described


def kill_run(run_id: str) -> None:
    """Clean-up after a test: SIGKILL whatever the run left (only its own processes)."""
    for proc in run_processes(run_id):
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)


def wait_for(predicate, timeout_s: float, proc: subprocess.Popen | None = None, poll_s: float = 0.02, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) while waiting for {what}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def tracker_step(ckpt: Path) -> int | None:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None


def fingerprint(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` (to prove a failed run left it untouched)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def fake_checkpoint(root: Path, step: int = 1) -> Path:
    """A stand-in for an earlier run's checkpoint directory (tracker + step directory with files)."""
    step_dir = root / f"global_step_{step}"
    (step_dir / "actor").mkdir(parents=True, exist_ok=True)
    (step_dir / "actor" / "weights.bin").write_bytes(os.urandom(256))
    (step_dir / "data.pt").write_bytes(b"driver state")
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return root


def write_rows(path: Path, rows: list[dict]) -> Path:
    from verl.utils.dataset.files import write_parquet

    write_parquet(rows, str(path))
    return path


def arith_rows(n: int = 16) -> list[dict]:
    """Well-formed rows in upstream's schema (the arithmetic task of the bundled model)."""
    rows = []
    for i in range(n):
        a, b = 10 + i, 20 + 2 * i
        rows.append(
            {
                "data_source": "arith",
                "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    return rows


def copy_model_without_pad_token(dst: Path) -> Path:
    """The bundled model with its tokenizer's pad token removed (a common state of base models)."""
    import json

    shutil.copytree(model_path(), dst)
    config_file = dst / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("pad_token", None)
    config_file.write_text(json.dumps(config))
    tokenizer_file = dst / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    tokenizer["padding"] = None
    tokenizer_file.write_text(json.dumps(tokenizer))
    return dst
