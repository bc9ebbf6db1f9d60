"""Upstream's PPO quickstart command runs here unchanged but for paths and device: PPO with GAE and a
critic (upstream's default estimator), on the bundled model, on CPU.

The command is upstream's documented quickstart (docs/start/quickstart.rst: GSM8K, Qwen2.5-0.5B,
vLLM, one GPU), with only what names this machine substituted: the data files (the bundled
arithmetic task), the two model paths (the bundled model), the rollout engine (vLLM -> the
built-in `hf`), the device (`trainer.device=cpu`), and one step instead of 15 epochs. Every other
value, and every default it leaves alone (upstream's: bf16 compute, remove padding, gradient
checkpointing, async rollout mode, 8 data-loader workers, ...), is upstream's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

ROOT = Path(__file__).resolve().parents[2]


def quickstart(train: str, val: str, model: str) -> list[str]:
    """Upstream's quickstart overrides, paths and engine substituted (the substitutions marked)."""
    return [
        f"data.train_files={train}",  # substituted: $HOME/data/gsm8k/train.parquet
        f"data.val_files={val}",  # substituted: $HOME/data/gsm8k/test.parquet
        "data.train_batch_size=256",
        "data.max_prompt_length=512",
        "data.max_response_length=512",
        f"actor_rollout_ref.model.path={model}",  # substituted: Qwen/Qwen2.5-0.5B-Instruct
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=hf",  # substituted: vllm
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.optim.lr=1e-5",
        f"critic.model.path={model}",  # substituted: Qwen/Qwen2.5-0.5B-Instruct
        "critic.ppo_micro_batch_size_per_gpu=4",
        "algorithm.kl_ctrl.kl_coef=0.001",
        "trainer.logger=console",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=10",
        "trainer.test_freq=10",
        "trainer.total_epochs=15",
        "trainer.device=cpu",  # substituted: upstream's default cuda
    ]


def console_metrics(log: str, step: int) -> dict[str, float]:
    """The metrics of one step from the console logger's line `step N | key=value key=value ...`."""
    (line,) = [text for text in log.splitlines() if re.search(rf"\bstep {step} \| ", text)]
    pairs = line.split(f"step {step} | ", 1)[1].split()
    return {key: float(value) for key, _, value in (pair.partition("=") for pair in pairs)}


def test_upstream_ppo_quickstart_trains_gae_with_a_critic_on_cpu(tmp_path, shared_ray_cluster):
    from verl.models import bundled_model_path
    from verl.utils.dataset.arith import ensure_arith_data

    train, val = ensure_arith_data(str(tmp_path / "data"))
    model = bundled_model_path()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VERL_CACHE_DIR": str(tmp_path / "cache"),
        "RAY_DEDUP_LOGS": "0",
    }
    run = [
        "trainer.total_training_steps=1",  # a short run
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.run_dir={tmp_path / 'run'}",
        *shared_ray_cluster.overrides_for(env),  # joins the session's cluster: Ray's start-up paid once
    ]
    env = shared_ray_cluster.env_for(env)
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *quickstart(train, val, model), *run],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    resolved = (tmp_path / "run" / "config.yaml").read_text()
    assert "adv_estimator: gae" in resolved  # upstream's default estimator, not set by the command
    metrics = console_metrics(proc.stdout + proc.stderr, step=1)  # trainer.logger=console, as upstream's command
    # the critic trained (GAE's value function), the actor took a PPO step with those advantages
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "actor/pg_loss", "actor/grad_norm"):
        assert key in metrics, f"{key} missing: {sorted(metrics)}"
    assert metrics["critic/grad_norm"] > 0 and metrics["actor/grad_norm"] > 0, metrics
    assert metrics["actor/lr"] == 1e-6 and metrics["critic/lr"] == 1e-5
    assert "val-core/arith/acc/mean@1" in metrics  # test_freq=10: validated at the last step
    assert (tmp_path / "ckpt" / "global_step_1" / "critic").is_dir()  # save_freq=10: saved at the last step
