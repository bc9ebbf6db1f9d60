"""`python -m verl.trainer.main_ppo` end to end on CPU: real Ray, 2 worker processes, FSDP2, the
built-in engine, the bundled tiny model. Each example script runs a few steps; resume after a
kill -9 reproduces an uninterrupted run; a config typo fails fast with a did-you-mean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _model_path() -> str:
    from verl.models import bundled_model_path

    return bundled_model_path()


def _env(tmp_path: Path) -> dict:
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


def _common(tmp_path: Path, steps: int) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={_model_path()}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]


def _metrics(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _run(cmd: list[str], tmp_path: Path, timeout: int = 420, cluster=None) -> subprocess.CompletedProcess:
    """Run `cmd` to completion; with `cluster` (the `shared_ray_cluster` fixture) it joins that
    cluster instead of starting its own."""
    env = _env(tmp_path)
    if cluster is not None:
        env, cmd = cluster.env_for(env), [*cmd, *cluster.overrides_for(env)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )
    return proc


def test_misspelled_key_exits_fast_with_a_did_you_mean(tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "data.train_batch_sze=8"],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "data.train_batch_sze" in proc.stderr and "data.train_batch_size" in proc.stderr
    assert time.monotonic() - start < 60


# script -> a metric only that algorithm produces
EXAMPLES = {
    "examples/grpo_trainer/run_arith_tiny_cpu.sh": "actor/pg_loss",
    "examples/ppo_trainer/run_arith_tiny_gae_cpu.sh": "critic/vf_loss",
    "examples/rloo_trainer/run_arith_tiny_cpu.sh": "actor/pg_loss",
    "examples/reinforce_plus_plus_trainer/run_arith_tiny_cpu.sh": "actor/kl_loss",
    "examples/remax_trainer/run_arith_tiny_cpu.sh": "actor/reward_kl_penalty",
    "recipes/dapo/run_dapo_arith_tiny_cpu.sh": "train/num_gen_batches",
}


# the default tier keeps one real main_ppo run through Ray (GRPO); the other algorithms are the slow tier's
DEFAULT_TIER_EXAMPLE = "examples/grpo_trainer/run_arith_tiny_cpu.sh"


@pytest.mark.parametrize(
    "script", [s if s == DEFAULT_TIER_EXAMPLE else pytest.param(s, marks=pytest.mark.slow) for s in sorted(EXAMPLES)]
)
def test_example_script_trains_two_steps(script, tmp_path, shared_ray_cluster):
    import yaml

    proc = _run(["bash", script, *_common(tmp_path, steps=2)], tmp_path, cluster=shared_ray_cluster)
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    last = records[-1]["data"]
    for key in (EXAMPLES[script], "critic/score/mean", "response_length/mean", "timing_s/gen", "perf/throughput"):
        assert key in last, f"{key} missing from step metrics of {script}: {sorted(last)}"
    assert 0.0 <= last["critic/score/mean"] <= 1.0 or script.startswith("recipes/dapo")
    run_dir = tmp_path / "run"
    assert (run_dir / "config.yaml").read_text().count("adv_estimator") == 1  # the resolved config
    # the speed paths: said at start, a metric each step, recorded beside the config
    assert last["perf/shared_prompt_forward"] == 1.0, {k: v for k, v in last.items() if k.startswith("perf/")}
    assert "speed path shared_prompt_forward: on" in proc.stdout + proc.stderr
    recorded = yaml.safe_load((run_dir / "speed_paths.yaml").read_text())
    assert recorded["shared_prompt_forward"] == {"requested": True, "active": True, "reason": ""}, recorded
    assert set(recorded) >= {"remove_padding", "fused_kernels", "cuda_graphs", "shm_transport"}, recorded
    png = run_dir / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def _run_and_kill_9_after_checkpoint(cmd: list[str], run_dir: Path, step: int) -> None:
    """Start `cmd` and, once checkpoint `step` is saved, SIGKILL every process of the run at once
    (driver, Ray daemons, TaskRunner, workers), as a machine crash would. Killing the driver's
    process group alone is not that: Ray's worker processes are outside it, and the TaskRunner,
    which runs the training loop, goes on training and checkpointing for about a second, until Ray
    notices that its driver is gone."""
    import uuid

    from tests.reliability.reliability_helpers import RUN_ID_VAR, kill_run, wait_until_gone

    run_id = uuid.uuid4().hex
    env = {**_env(run_dir), RUN_ID_VAR: run_id}
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


@pytest.mark.slow
def test_resume_after_kill_9_reproduces_the_uninterrupted_run(tmp_path, shared_ray_cluster):
    """4 steps straight == 2 steps, kill -9, resume, 2 more steps (same metrics on CPU). With 32
    training rows in batches of 16 the kill falls on an epoch boundary: the resumed run must start
    the second epoch with the same shuffle as the uninterrupted one."""
    steps = 4
    base = [
        "bash",
        "examples/grpo_trainer/run_arith_tiny_cpu.sh",
        "trainer.save_freq=2",
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "data.train_max_samples=32",
    ]
    straight = tmp_path / "straight"
    straight.mkdir()
    _run([*base, *_common(straight, steps)], straight, cluster=shared_ray_cluster)

    killed = tmp_path / "killed"
    killed.mkdir()
    cmd = [*base, *_common(killed, steps)]
    _run_and_kill_9_after_checkpoint(cmd, killed, 2)  # its own cluster: the kill takes Ray's daemons down too
    _run(cmd, killed, cluster=shared_ray_cluster)

    expected = {r["step"]: r["data"] for r in _metrics(straight)}
    resumed = {r["step"]: r["data"] for r in _metrics(killed)}  # later lines (the resumed run) win
    assert expected[3]["training/epoch"] == expected[2]["training/epoch"] + 1  # the kill sat on the boundary
    for step in (3, 4):
        assert resumed[step]["training/epoch"] == expected[step]["training/epoch"]
        for key in ("critic/score/mean", "actor/pg_loss", "response_length/mean", "actor/entropy", "actor/grad_norm"):
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-6), (step, key)
