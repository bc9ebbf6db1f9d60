"""The same `python -m verl.trainer.main_ppo` GRPO run with each rollout backend: only
`actor_rollout_ref.rollout.name` changes. With rollout log-probs on, every step reports the
train/rollout mismatch (`training/rollout_probs_diff_mean`, `_max`) and the truncated
importance-sampling correction (`actor.tis_imp_ratio_cap`) is applied.

The hf case runs in the main suite; the vllm case needs vllm and runs in the vllm virtualenv
(.ci/vllm.sh). SGLang cannot be installed on these machines (docs/rollout_backends.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

ROOT = Path(__file__).resolve().parents[2]


def _model_path() -> str:
    from verl.models import bundled_model_path

    return bundled_model_path()


@pytest.mark.parametrize(
    "backend",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.vllm,
                pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (.ci/vllm.sh)"),
            ],
        ),
    ],
)
def test_grpo_runs_with_the_backend_and_reports_the_train_rollout_mismatch(backend, tmp_path):
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        PYTHON=sys.executable,
        VERL_CACHE_DIR=str(tmp_path / "cache"),
        VERL_FILE_LOGGER_PATH=str(tmp_path / "metrics.jsonl"),
        MLFLOW_TRACKING_URI=f"file:{tmp_path / 'mlruns'}",
        RAY_DEDUP_LOGS="0",
    )
    cmd = [
        "bash",
        "examples/grpo_trainer/run_arith_tiny_cpu.sh",
        f"actor_rollout_ref.model.path={_model_path()}",
        f"actor_rollout_ref.rollout.name={backend}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        data = record["data"]
        for key in ("actor/pg_loss", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"):
            assert key in data, f"{key} missing from {sorted(data)}"
        # both sides compute in float32 on CPU, so the engines agree to rounding; a sampling or
        # temperature bug (log-probs of another distribution) shows up as gaps of 0.1 and more
        assert 0 <= data["training/rollout_probs_diff_mean"] < 1e-3, data["training/rollout_probs_diff_mean"]
        assert data["training/rollout_probs_diff_max"] < 1e-2, data["training/rollout_probs_diff_max"]
    print(backend, [{k: r["data"][k] for k in r["data"] if "rollout_probs_diff" in k} for r in records])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (.ci/vllm.sh)")
def test_one_step_off_with_vllm_partial_rollouts_tags_versions_within_the_bound(tmp_path):
    """Generation one step ahead in a separate rollout pool running vLLM, with partial rollouts
    checked every engine step: every trained sample's oldest version is within the bound, its newest
    never ahead of the trainer, and the rollout log-probs stay those of the sampling weights."""
    from tests.trainer.test_main_ppo_async import _cmd, _trained, assert_partial_rollout_tags
    from tests.trainer.test_main_ppo_e2e import _metrics, _run

    steps = 3
    cmd = _cmd(
        tmp_path,
        steps,
        1,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "async_training.partial_rollout=true",
        "async_training.partial_rollout_check_steps=1",
    )
    _run(cmd, tmp_path, timeout=900)
    assert_partial_rollout_tags(_trained(tmp_path), steps)
    records = {r["step"]: r["data"] for r in _metrics(tmp_path)}
    for step in range(1, steps + 1):
        data = records[step]
        assert 0.0 <= data["async/mixed_version_frac"] <= 1.0
        # decoupled correction: behaviour log-probs from vLLM, per token of the version that sampled it
        assert "off_policy/is_weight_mean" in data
    # step 1 trains samples of version 0 with version 0: the engines agree to rounding (later steps
    # differ by one update, which is what the correction is for)
    assert records[1]["training/rollout_probs_diff_mean"] < 1e-3, records[1]["training/rollout_probs_diff_mean"]
    print(
        {s: (records[s]["training/rollout_probs_diff_mean"], records[s]["async/mixed_version_frac"]) for s in records}
    )
