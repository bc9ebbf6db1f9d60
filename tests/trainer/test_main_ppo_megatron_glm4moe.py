"""`main_ppo --config-name=arith_demo_megatron` end to end with the GLM-4.5 preset on CPU: the
tiny-glm4moe model (grouped-query attention with q/k/v bias and half rotary, a dense first layer,
sigmoid routing with a correction bias, a shared expert) trains two GRPO steps on 2 megatron workers
with the experts split over them (ep=2), and the step-2 checkpoint merges back into a
`Glm4MoeForCausalLM` that transformers loads, with moved weights and the routers' correction bias as
it was."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


def test_grpo_trains_a_glm4_moe_model_at_ep2_and_merges(tmp_path, shared_ray_cluster):
    from transformers import AutoModelForCausalLM

    from verl.model_merger.__main__ import main as merger
    from verl.models.factory import build_model, save_model

    model, tokenizer = build_model("tiny-glm4moe")
    with torch.no_grad():  # a non-zero correction bias, so its trip through training and merging shows
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(7)))
    model_path = save_model(model, tokenizer, str(tmp_path / "tiny-glm4moe"))
    run = tmp_path / "run2"
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            # a random-init model never solves the task (every GRPO advantage is 0): an entropy bonus gives
            # the update a gradient
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.skip_zero_advantage_step=False",
            "actor_rollout_ref.actor.skip_zero_advantage_rows=False",
            "trainer.save_freq=2",
            *common_overrides(run, 2, model=model_path),
        ),
        run,
        cluster=shared_ray_cluster,
    )
    rows = [r["data"] for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert len(rows) == 2
    assert all(row["actor/grad_norm"] > 0 for row in rows), rows

    merger(
        [
            "merge",
            "--backend",
            "megatron",
            "--local_dir",
            str(run / "ckpt" / "global_step_2" / "actor"),
            "--target_dir",
            str(tmp_path / "hf"),
        ]
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded).__name__ == "Glm4MoeForCausalLM"
    merged = loaded.state_dict()
    before = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    assert sorted(merged) == sorted(before)
    for name in (
        "model.layers.1.mlp.gate.weight",
        "model.layers.2.self_attn.q_proj.bias",
        "model.layers.2.mlp.shared_experts.up_proj.weight",
    ):
        assert not merged[name].equal(before[name]), f"two steps must have moved {name}"
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert before[bias].abs().min() > 0 and merged[bias].equal(before[bias]), "the correction bias is not trained"
