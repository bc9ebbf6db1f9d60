"""`main_ppo --cfg job` checks a config without training, and a config this machine cannot run fails
before Ray starts, in one line that says how to switch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verl.trainer.config import ConfigError, check_machine, load_ppo_config

ROOT = Path(__file__).resolve().parents[3]
RUNNABLE_HERE = [
    "actor_rollout_ref.rollout.name=hf",
    "trainer.device=cpu",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


def main_ppo(*args: str, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *python_flags, "-m", "verl.trainer.main_ppo", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=False,
    )


def imported_modules(importtime_stderr: str) -> set[str]:
    """The modules a `python -X importtime` run imported (its stderr lines `import time: a | b | name`)."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def main_ppo_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `main_ppo.main(args)` in this process: what the command
    prints and returns, without a new interpreter (one of these tests still starts one, to show
    that the whole command takes seconds)."""
    from verl.trainer.main_ppo import main

    capsys.readouterr()
    try:
        main(list(args))
        status = 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def test_cfg_job_prints_the_composed_config_and_checks_it_without_importing_ray():
    """Seconds, not a Ray start-up (measured ~3 s idle): shown by what the command imports, not by a
    wall-clock bound, which a loaded machine broke (2026-11-27: over 30 s at load 27)."""
    result = main_ppo(*RUNNABLE_HERE, "data.train_batch_size=512", "--cfg", "job", python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr[-3000:]
    printed = yaml.safe_load(result.stdout)
    assert printed["data"]["train_batch_size"] == 512
    assert printed["algorithm"]["adv_estimator"] == "gae"  # upstream's default
    assert printed["actor_rollout_ref"]["actor"]["rollout_n"].startswith("${")  # as Hydra prints it: unresolved
    assert "passed every check" in result.stderr
    imported = imported_modules(result.stderr)
    assert {"verl.trainer.config", "omegaconf"} <= imported  # what main() imports: the check sees its imports
    assert not {m for m in imported if m == "ray" or m.startswith("ray.")}, "--cfg job imported ray"


def test_cfg_job_resolve_prints_values(capsys):
    status, out, err = main_ppo_in_process(capsys, *RUNNABLE_HERE, "--cfg=job", "--resolve")
    assert status == 0, err
    assert yaml.safe_load(out)["actor_rollout_ref"]["actor"]["rollout_n"] == 1


def test_cfg_job_fails_with_the_message_and_status_2(capsys):
    """Upstream refuses data.train_batch_size=3 under its defaults (mini-batch 256 > 3); so does this."""
    status, out, err = main_ppo_in_process(capsys, *RUNNABLE_HERE, "data.train_batch_size=3", "--cfg", "job")
    assert status == 2
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=256 is larger than data.train_batch_size=3" in err
    assert "train_batch_size: 3" in out  # the config was printed first


def test_cfg_job_runs_the_machine_check_too(capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    status, _, err = main_ppo_in_process(capsys, *RUNNABLE_HERE, "actor_rollout_ref.rollout.name=vllm", "--cfg", "job")
    assert status == 2
    assert "set actor_rollout_ref.rollout.name=hf" in err


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or __import__("torch").cuda.is_available(),
    reason="needs a CPU-only machine",
)
def test_asking_for_a_gpu_on_a_cpu_machine_fails_in_one_line_naming_the_switches():
    cfg = load_ppo_config(["actor_rollout_ref.rollout.name=vllm", *RUNNABLE_HERE[2:]])  # device: cuda
    with pytest.raises(ConfigError) as e:
        check_machine(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert "trainer.device=cuda but torch sees no CUDA GPU" in message
    assert "set trainer.device=cpu actor_rollout_ref.rollout.name=hf" in message
    check_machine(load_ppo_config(RUNNABLE_HERE))  # what it says to set runs here


def test_main_fails_before_ray_starts_on_a_machine_without_the_engine():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    result = main_ppo(*RUNNABLE_HERE, "actor_rollout_ref.rollout.name=vllm")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("actor_rollout_ref.rollout.name=vllm but the vllm package is not installed")
    assert "ray" not in result.stderr.lower().replace("array", "")  # no Ray start-up in between
