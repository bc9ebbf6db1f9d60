"""Faults during `python -m verl.trainer.main_ppo`: a worker killed with SIGKILL while a checkpoint is
being saved, resuming afterwards, and Ctrl-C. Two real runs, each in its own session like a job
started from a terminal, with every process they start tracked (see reliability_helpers):

1. a worker is killed with `kill -9` while step 2's checkpoint is being written: the driver fails
   within 30 s naming the role and the rank, exits non-zero and leaves no process behind; the
   tracker still names step 1, whose checkpoint is complete;
2. the same command again resumes from step 1 and trains on; Ctrl-C (SIGINT to the process group,
   as a terminal sends it) then stops the driver and every worker cleanly, exit status 130.

No verdict depends on the machine's speed: run 1 blocks at the start of step 2 (gated_reward.py)
until the test has seen the tracker name step 1, and the signal tests wait for "step >= N", never
for one exact tracker value that a fast run (or a starved test process) can step over.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from reliability_helpers import (
    DEMO,
    arith_rows,
    kill_run,
    launch,
    run_processes,
    small_run,
    tracker_step,
    wait_for,
    wait_until_gone,
    worker_pid,
    write_rows,
)

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

STARTUP_S = 300  # generous: on a busy 2-core machine a run needs a minute or more to reach step 1


def _long_run_saving_every_step(tmp, *extra: str) -> list[str]:
    """Overrides for a 50-step run of the small config that checkpoints after every step."""
    data = write_rows(tmp / "train.parquet", arith_rows(64))
    return [
        DEMO,
        *small_run(tmp, steps=50),
        f"data.train_files={data}",
        f"data.val_files={data}",
        "trainer.save_freq=1",
        "trainer.progress_bar=false",
        *extra,
    ]


GATED_REWARD = Path(__file__).with_name("gated_reward.py")
SAMPLES_PER_STEP = 8  # small_run: 4 prompts x rollout.n=2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    gate = tmp / "gate"
    gate.mkdir()
    args = _long_run_saving_every_step(
        tmp,
        # the HF export makes each save last long enough to be hit reliably
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        # step 2 waits at its first reward until the test releases it (see gated_reward.py)
        f"custom_reward_function.path={GATED_REWARD}",
        f"+custom_reward_function.reward_kwargs.gate_dir={gate}",
        f"+custom_reward_function.reward_kwargs.samples_per_step={SAMPLES_PER_STEP}",
    )
    return tmp, args


@pytest.fixture(scope="module")
def killed_during_save(run_dir):
    """Run 1: SIGKILL worker rank 1 as soon as step 2's checkpoint directory appears."""
    tmp, args = run_dir
    ckpt, gate = tmp / "ckpt", tmp / "gate"
    proc, run_id, log = launch(args, tmp, "run1.log")
    try:
        # the run now holds still after step 1's save, however long this process waits for the CPU
        wait_for(lambda: (gate / "waiting").exists(), STARTUP_S, proc, what="the start of step 2")
        step_before = tracker_step(ckpt)
        victim = worker_pid(run_id, rank=1)
        listening = _listening_ports(run_id)
        (gate / "release").touch()
        wait_for(lambda: (ckpt / "global_step_2").exists(), 120, proc, poll_s=0.005, what="the save of step 2")
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        step_at_kill = tracker_step(ckpt)
        returncode = proc.wait(timeout=120)
        exit_s = time.monotonic() - killed_at
        print(f"kill -9 of worker rank 1 -> driver exit {returncode} after {exit_s:.1f} s")
        left = wait_until_gone(run_id, timeout_s=15)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(run_id)
    return {
        "returncode": returncode,
        "exit_s": exit_s,
        "left": left,
        "log": log.read_text(errors="replace"),
        "step_before": step_before,
        "step_at_kill": step_at_kill,
        "listening": listening,
    }


def _listening_ports(run_id: str) -> dict[int, str]:
    """{port: address} of every TCP socket the run's processes listen on."""
    pids = {p.pid for p in run_processes(run_id)}
    return {
        c.laddr.port: c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    }


def test_kill_9_of_a_worker_fails_the_run_naming_role_and_rank_within_30_s(killed_during_save):
    result = killed_during_save
    assert result["step_before"] == 1, "step 2 started before step 1's checkpoint was complete"
    assert result["step_at_kill"] == 1, "the kill landed after the save finished; the test did not hit the save"
    assert result["returncode"] == 1, result["log"][-3000:]
    assert result["exit_s"] < 30, f"the driver needed {result['exit_s']:.1f} s to fail"
    last = result["log"].rstrip().splitlines()
    summary = next(line for line in reversed(last) if line.startswith("verl: training failed"))
    assert "WorkerDiedError: actor_rollout rank 1 died during save_checkpoint()" in summary
    assert "Traceback" not in result["log"]  # a dead worker is explained by its message alone


def test_a_killed_run_leaves_no_process_behind(killed_during_save):
    assert killed_during_save["left"] == []


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_complete(run_dir, killed_during_save):
    from verl.utils.checkpoint.safe_load import dcp_metadata, torch_load

    ckpt = run_dir[0] / "ckpt"
    assert tracker_step(ckpt) == 1
    assert not (ckpt / "global_step_2" / "data.pt").exists()  # step 2 was cut short
    state = torch_load(str(ckpt / "global_step_1" / "data.pt"), "driver state")  # weights_only=True
    assert state["global_steps"] == 1
    assert dcp_metadata(str(ckpt / "global_step_1" / "actor" / "model")).state_dict_metadata


def test_the_run_serves_no_dashboard(killed_during_save):
    listening = killed_during_save["listening"]
    assert 8265 not in listening, listening  # Ray's dashboard port: off unless asked for


def _signal_after_checkpoint(args, tmp, log_name: str, step: int, send) -> tuple[int, float, list[str], str]:
    """Launch a run, `send(proc)` a signal once checkpoint `step` (or a later one) is saved, and wait
    for the end. "Or later": a starved test may poll only after the run has saved the next step too.
    Returns (driver exit status, seconds from the signal to the exit, processes left, log text)."""
    proc, run_id, log = launch(args, tmp, log_name)
    try:
        wait_for(
            lambda: (tracker_step(tmp / "ckpt") or 0) >= step, STARTUP_S, proc, what=f"the checkpoint of step {step}"
        )
        send(proc)
        sent_at = time.monotonic()
        returncode = proc.wait(timeout=60)
        exit_s = time.monotonic() - sent_at
        print(f"signal -> driver exit {returncode} after {exit_s:.1f} s")
        left = wait_until_gone(run_id, timeout_s=15)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(run_id)
    return returncode, exit_s, left, log.read_text(errors="replace")


def test_resume_after_the_kill_then_ctrl_c_stops_every_process(run_dir, killed_during_save):
    tmp, args = run_dir
    returncode, exit_s, left, text = _signal_after_checkpoint(
        args,
        tmp,
        "run2.log",
        step=2,
        send=lambda proc: os.killpg(proc.pid, signal.SIGINT),  # a terminal's Ctrl-C
    )
    assert "resuming from" in text and "global_step_1" in text, text[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and 1 not in steps[1:], steps  # step 1 came from the killed run only
    assert returncode == 130, text[-3000:]
    assert "verl: interrupted; the workers were stopped" in text
    assert exit_s < 30, f"Ctrl-C took {exit_s:.1f} s"
    assert left == []
    # trainer.progress_bar=false silences the driver's step bar and the workers' model-loading bars
    assert "Training Progress" not in text and "Loading weights" not in text


def test_sigterm_to_the_driver_stops_every_process_and_exits_143(tmp_path):
    """`kill PID`, `timeout`, a scheduler's preemption: SIGTERM to the driver alone stops the run like
    Ctrl-C does (workers first, a message, no process left), not with Ray's stack dump and abort."""
    ckpt = tmp_path / "ckpt"
    returncode, exit_s, left, text = _signal_after_checkpoint(
        _long_run_saving_every_step(tmp_path),
        tmp_path,
        "run.log",
        step=1,
        send=lambda proc: proc.send_signal(signal.SIGTERM),
    )
    assert returncode == 143, text[-3000:]
    assert "verl: terminated (SIGTERM); the workers were stopped" in text
    assert "SIGTERM received" not in text  # Ray's own handler: a stack dump, then abort
    assert exit_s < 30, f"SIGTERM took {exit_s:.1f} s"
    assert left == []
    step = tracker_step(ckpt)
    assert step >= 1 and (ckpt / f"global_step_{step}" / "data.pt").exists()  # the tracker names a whole save
