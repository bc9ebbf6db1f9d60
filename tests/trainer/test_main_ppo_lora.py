"""`python -m verl.trainer.main_ppo ... actor_rollout_ref.model.lora_rank=8` end to end on CPU (real Ray,
2 worker processes, FSDP2, the built-in engine), then `python -m verl.model_merger merge` on its
checkpoint: the merged directory loads in transformers and equals peft's own merge of the saved
adapter (`PeftModel.from_pretrained(base, lora_adapter).merge_and_unload()`).

The run joins the session's Ray cluster (`ray_session`) through RAY_ADDRESS instead of starting
its own; a KL loss is on, so the reference policy (the base model with the adapters off) is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

ROOT = Path(__file__).resolve().parents[2]


def test_lora_run_trains_two_steps_and_its_checkpoint_merges_into_a_transformers_model(ray_session, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

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
        f"actor_rollout_ref.model.path={bundled_model_path()}",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2",  # adapters need a larger step than full fine-tuning
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
    assert records[-1]["data"]["actor/kl_loss"] > 0  # step 1 moved the adapters off the reference (the base)

    actor_dir = tmp_path / "ckpt" / "global_step_2" / "actor"
    target = tmp_path / "merged"
    merge = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
    merge += ["--local_dir", str(actor_dir), "--target_dir", str(target)]
    subprocess.run(merge, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)

    merged = AutoModelForCausalLM.from_pretrained(target).state_dict()
    base = AutoModelForCausalLM.from_pretrained(bundled_model_path())
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    reference = PeftModel.from_pretrained(base, actor_dir / "lora_adapter").merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    moved = [n for n in reference if not torch.equal(merged[n], base_state[n])]
    assert any(".q_proj." in n for n in moved) and not any("norm" in n for n in moved)
