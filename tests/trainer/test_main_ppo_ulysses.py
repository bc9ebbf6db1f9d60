"""`python -m verl.trainer.main_ppo ... actor_rollout_ref.actor.ulysses_sequence_parallel_size=2`
end to end on CPU (real Ray, 2 worker processes forming one sp group, FSDP2, the built-in engine,
a KL loss so the reference runs at sp=2 too): two steps train and log finite losses."""

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


def test_main_ppo_with_ulysses_sp2_trains_two_steps(ray_session, tmp_path):
    from verl.models import bundled_model_path
    from verl.utils.dataset.arith import ensure_arith_data

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
        f"actor_rollout_ref.model.path={bundled_model_path()}",  # 2 attention heads: sp=2 splits them
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert math.isfinite(record["data"][key]), (record["step"], key, record["data"][key])
    assert records[-1]["data"]["actor/kl_loss"] > 0, "step 1 must have moved the actor off the reference"
