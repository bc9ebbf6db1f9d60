"""`python -m verl.trainer.main_ppo` GRPO with the built-in engine at rollout expert parallelism 2 on
tiny-moe (real Ray, 2 CPU workers, FSDP2 actor): each worker's engine holds 2 of the 4 experts of
every layer, synced from the actor each step, and generates its half of the batch with tokens
routed to the other worker and back. The engine's log-probs must equal the actor's fp32
recomputation of the same tokens (`training/rollout_probs_diff_max`), which they cannot if a
token reached a wrong expert or a worker held another worker's expert weights."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

ROOT = Path(__file__).resolve().parents[2]


def test_main_ppo_grpo_with_the_built_in_engine_at_rollout_expert_parallel_size_2(ray_session, tmp_path):
    from verl.models.factory import make_tiny
    from verl.utils.dataset.arith import ensure_arith_data

    model_path = make_tiny("tiny-moe", str(tmp_path / "tiny-moe"))
    train, test = ensure_arith_data(str(tmp_path / "data"))
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        PYTHON=sys.executable,
        RAY_ADDRESS=ray_session.get_runtime_context().gcs_address,
    )
    env.pop("VERL_FILE_LOGGER_PATH", None)
    cmd = [
        "bash",
        "examples/grpo_trainer/run_arith_tiny_cpu.sh",
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.rollout.expert_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.data_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        # a random-init model never solves the task: train on every row anyway
        "actor_rollout_ref.actor.skip_zero_advantage_step=False",
        "actor_rollout_ref.actor.skip_zero_advantage_rows=False",
        # every advantage is 0 too: the entropy bonus alone moves the weights, so step 2 generates with synced new ones
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        data = record["data"]
        assert math.isfinite(data["actor/pg_loss"]) and data["actor/grad_norm"] > 0, data
        assert data["response_length/mean"] > 0, data
        # fp32 on both sides: rounding only (a misrouted token or a wrong expert shard is off by far more)
        assert data["training/rollout_probs_diff_max"] < 1e-4, data
