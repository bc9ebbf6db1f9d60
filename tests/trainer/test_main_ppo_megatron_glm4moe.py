"""`main_ppo --config-name=arith_demo_megatron` end to end with the GLM-4.5 preset on CPU: the
tiny-glm4moe model (grouped-query attention with q/k/v bias and half rotary, a dense first layer,
sigmoid routing with a correction bias, a shared expert) trains two GRPO steps on 2 pipeline stages
(the dense layer alone on the first, both MoE layers on the second, sized as upstream's scripts size
uneven stages), and the step-2 checkpoint merges back into a `Glm4MoeForCausalLM` that transformers
loads, with moved weights and the routers' correction bias as it was. The experts split over 2 workers
(ep=2) train end to end in test_main_ppo_megatron_moe_critic.py (a GLM-4.5 actor and critic at ep=2),
so this file does not repeat that run: one main_ppo run less in the slow tier."""

from __future__ import annotations

import pytest

from tests.trainer.test_main_ppo_megatron_deepseek import LAYOUTS, train_two_steps_and_merge

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


@pytest.mark.parametrize("layout", ["pp2"])
def test_grpo_trains_a_glm4_moe_model_and_merges(tmp_path, shared_ray_cluster, layout):
    moved = (
        "model.layers.1.mlp.gate.weight",
        "model.layers.2.self_attn.q_proj.bias",
        "model.layers.2.mlp.shared_experts.up_proj.weight",
    )
    loaded = train_two_steps_and_merge("tiny-glm4moe", LAYOUTS[layout], tmp_path, shared_ray_cluster, moved)
    assert type(loaded).__name__ == "Glm4MoeForCausalLM"
