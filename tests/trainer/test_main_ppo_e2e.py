"""`python -m verl.trainer.main_ppo` end to end on CPU: real Ray, 2 worker processes, FSDP2, the
built-in engine, the bundled tiny model. The GRPO example script runs two steps (the other
algorithms' scripts: test_algorithm_steps.py, in-process); resume after a kill -9 reproduces an
uninterrupted run; a config typo fails fast with a did-you-mean."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.trainer.main_ppo_runs import (
    ROOT,
    common_overrides,
    imported_modules,
    read_metrics,
    run_and_kill_9_after_checkpoint,
    run_env,
    run_main_ppo,
)


def test_misspelled_key_exits_fast_with_a_did_you_mean(tmp_path):
    """Fast means: before any Ray start-up or worker (about 2 s idle): shown by the modules the
    command imported (`python -X importtime`), not by a wall-clock bound, which measures the
    machine's load as much as the command (a speed claim belongs in benchmarks/)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "verl.trainer.main_ppo", "data.train_batch_sze=8"],
        cwd=ROOT,
        env=run_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "data.train_batch_sze" in proc.stderr and "data.train_batch_size" in proc.stderr
    imported = imported_modules(proc.stderr)
    assert "verl.trainer.config.loader" in imported  # what the check imports: the list is the command's own
    assert not {m for m in imported if m == "ray" or m.startswith("ray.")}, "a config typo imported ray"


# The one real main_ppo run through Ray of the default tier: GRPO's example script. The other
# algorithms' scripts train in-process on shared workers (test_algorithm_steps.py); this run checks
# what only a whole process shows as well (the script's command line, the start-up log).
def test_grpo_example_script_trains_two_steps_through_main_ppo(tmp_path, shared_ray_cluster):
    import yaml

    script = "examples/grpo_trainer/run_arith_tiny_cpu.sh"
    proc = run_main_ppo(["bash", script, *common_overrides(tmp_path, steps=2)], tmp_path, cluster=shared_ray_cluster)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    last = records[-1]["data"]
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "timing_s/gen", "perf/throughput"):
        assert key in last, f"{key} missing from step metrics of {script}: {sorted(last)}"
    assert 0.0 <= last["critic/score/mean"] <= 1.0
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


@pytest.mark.slow
def test_resume_after_kill_9_reproduces_the_uninterrupted_run(tmp_path, shared_ray_cluster):
    """4 steps straight == 2 steps, kill -9, resume, 2 more steps (same metrics on CPU). With 32
    training rows in batches of 16 the kill falls on an epoch boundary: the resumed run must start
    the second epoch with the same shuffle as the uninterrupted one. The killed run writes its
    checkpoints in the background (checkpoint.async_save) and copies them to trainer.default_hdfs_dir."""
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
    run_main_ppo([*base, *common_overrides(straight, steps)], straight, cluster=shared_ray_cluster)

    killed = tmp_path / "killed"
    killed.mkdir()
    remote = tmp_path / "remote"
    background = ["actor_rollout_ref.actor.checkpoint.async_save=true", f"trainer.default_hdfs_dir={remote}"]
    cmd = [*base, *common_overrides(killed, steps), *background]
    run_and_kill_9_after_checkpoint(cmd, killed, 2)
    run_main_ppo(cmd, killed, cluster=shared_ray_cluster)

    expected = {r["step"]: r["data"] for r in read_metrics(straight)}
    resumed = {r["step"]: r["data"] for r in read_metrics(killed)}  # later lines (the resumed run) win
    assert expected[3]["training/epoch"] == expected[2]["training/epoch"] + 1  # the kill sat on the boundary
    for step in (3, 4):
        assert resumed[step]["training/epoch"] == expected[step]["training/epoch"]
        for key in ("critic/score/mean", "actor/pg_loss", "response_length/mean", "actor/entropy", "actor/grad_norm"):
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-6), (step, key)
    # the run waited for its last background write, then copied the step (step 2's copy may have been cut by the kill)
    assert (killed / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (remote / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    local, copy = killed / "ckpt" / "global_step_4", remote / "global_step_4"
    files = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file())
    assert all((local / f).read_bytes() == (copy / f).read_bytes() for f in files)
