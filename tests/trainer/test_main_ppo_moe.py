"""`python -m verl.trainer.main_ppo` end to end with a mixture-of-experts model on CPU (real Ray, 2
worker processes, FSDP2 sharding the experts, the built-in engine generating with the model, the
router load-balancing loss switched on through `override_config`): two steps train, the loss is
logged, and the step-2 checkpoint merges into a Qwen3-MoE HF directory.

The rollout runs at expert parallelism 2 (`rollout.expert_parallel_size=2`): each worker's built-in
engine holds 2 of the 4 experts of every layer, synced from the actor each step, and routes its
tokens to the other worker and back. The engine's log-probs must equal the actor's fp32
recomputation of the same tokens (`training/rollout_probs_diff_max`), which they cannot if a token
reached a wrong expert or a worker held another worker's expert weights."""

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


def test_main_ppo_trains_a_moe_model_two_steps_with_the_load_balancing_loss(ray_session, tmp_path):
    from transformers import AutoModelForCausalLM

    from verl.model_merger.__main__ import main as merger
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
        "actor_rollout_ref.model.use_remove_padding=True",
        "+actor_rollout_ref.model.override_config.output_router_logits=True",
        "+actor_rollout_ref.model.override_config.router_aux_loss_coef=0.01",
        "actor_rollout_ref.rollout.expert_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.data_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        # a random-init model never solves the task, so every GRPO advantage is 0 and the update would be
        # skipped before any forward; run it, so the load-balancing loss trains the router and the entropy
        # bonus every weight (the experts too: step 2 generates with synced new expert shards)
        "actor_rollout_ref.actor.skip_zero_advantage_step=False",
        "actor_rollout_ref.actor.skip_zero_advantage_rows=False",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
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
        assert record["data"]["actor/skipped_zero_adv"] == 0, record["data"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/load_balancing_loss"):
            assert math.isfinite(record["data"][key]), (record["step"], key, record["data"][key])
        # E * sum_e f_e P_e <= E * max P * sum f = E * k = 8 (top-2 of 4 experts); 2 when balanced
        assert 0 < record["data"]["actor/load_balancing_loss"] <= 8.0, record["data"]
        assert record["data"]["response_length/mean"] > 0, record["data"]
        # fp32 on both sides: rounding only (a misrouted token or a wrong expert shard is off by far more)
        assert record["data"]["training/rollout_probs_diff_max"] < 1e-4, record["data"]

    merger(
        [
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(tmp_path / "ckpt" / "global_step_2" / "actor"),
            "--target_dir",
            str(tmp_path / "hf"),
        ]
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(merged).__name__ == "Qwen3MoeForCausalLM"
    before = AutoModelForCausalLM.from_pretrained(model_path)
    name = "model.layers.0.mlp.gate.weight"
    assert not merged.state_dict()[name].equal(before.state_dict()[name]), "two steps must have moved the router"
