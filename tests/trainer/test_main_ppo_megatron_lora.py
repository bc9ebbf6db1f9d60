"""`main_ppo --config-name=arith_demo_megatron actor_rollout_ref.model.lora.rank=8` end to end on CPU
(real Ray, the Megatron actor at tp=2, the built-in engine): two GRPO steps with a KL loss against
the reference policy (the base model with the adapters off), checkpointed; the checkpoint holds the
adapters, the `lora_config.json` and merged HF weights that differ from the base model's only in
the adapted projections."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


def test_grpo_with_lora_on_a_megatron_actor_at_tp2_trains_and_saves_merged_weights(tmp_path, shared_ray_cluster):
    from verl.models import bundled_model_path
    from verl.utils.model import load_causal_lm

    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "actor_rollout_ref.model.lora.rank=8",
            "actor_rollout_ref.model.lora.alpha=16",
            "actor_rollout_ref.actor.optim.lr=1e-2",  # adapters need a larger step than full fine-tuning
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            "trainer.save_freq=2",
            *common_overrides(tmp_path, steps=2),
        ),
        tmp_path,
        cluster=shared_ray_cluster,
    )
    rows = [r["data"] for r in read_metrics(tmp_path) if "actor/pg_loss" in r["data"]]
    assert len(rows) == 2
    assert rows[0]["actor/grad_norm"] > 0
    assert rows[1]["actor/kl_loss"] > 0, "step 1 should move the policy off the reference (the base model)"

    actor = tmp_path / "ckpt" / "global_step_2" / "actor"
    assert json.loads((actor / "lora_config.json").read_text())["rank"] == 8
    merged = load_file(actor / "huggingface" / "model.safetensors")
    base = load_causal_lm(bundled_model_path()).state_dict()
    moved = {n for n, t in merged.items() if not torch.equal(t, base[n].to(t.dtype))}
    assert any(".q_proj." in n for n in moved) and any(".down_proj." in n for n in moved), sorted(moved)
    assert not any("norm" in n or "embed" in n for n in moved), sorted(moved)
