"""`main_ppo --config-name=arith_demo_megatron` with PPO (GAE) and a megatron critic on the
sigmoid-routed MoE families, on CPU: a GLM-4.5 actor and critic with the experts split over 2 ranks,
and a DeepSeek-V3 actor and critic on 2 pipeline stages, train one step, and the critic's checkpoint
merges back into the family's HF token classifier (for GLM-4.5 transformers' generic one, registered
by `verl.utils.model.register_token_classifier`: transformers has no `Glm4MoeForTokenClassification`)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


# GAE layouts: the actor's and the critic's megatron sections alike
CRITIC_LAYOUTS = {
    "tiny-glm4moe": ["{role}.megatron.expert_model_parallel_size=2"],
    "tiny-dsv3": [
        "{role}.megatron.pipeline_model_parallel_size=2",
        "+{role}.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=1",
    ],
}


@pytest.mark.parametrize("preset", sorted(CRITIC_LAYOUTS))
def test_gae_trains_a_moe_critic_and_its_checkpoint_merges(tmp_path, shared_ray_cluster, preset):
    """PPO (GAE) with a megatron actor and critic on GLM-4.5 (experts split over 2 ranks) and on
    DeepSeek-V3 (2 pipeline stages, the dense layer alone on the first): the critic loads as the
    family's token classifier (for GLM-4.5 transformers' generic one: transformers has none), trains,
    and its checkpoint merges back into that class with moved experts."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo
    from verl.model_merger.__main__ import main as merger
    from verl.models.factory import build_model, save_model
    from verl.utils.model import register_token_classifier

    model_path = save_model(*build_model(preset), str(tmp_path / preset))
    roles = ("actor_rollout_ref.actor", "critic")
    layout = [key.format(role=role) for key in CRITIC_LAYOUTS[preset] for role in roles]
    run = tmp_path / "run"
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "algorithm.adv_estimator=gae",
            *layout,
            "trainer.save_freq=1",
            *common_overrides(run, 1, model=model_path),
        ),
        run,
        cluster=shared_ray_cluster,
    )
    (row,) = [r["data"] for r in read_metrics(run) if "critic/vf_loss" in r["data"]]
    assert row["critic/grad_norm"] > 0, row

    hf_dir = tmp_path / "critic_hf"
    merger(["merge", "--backend", "megatron", "--is-value-model", "--local_dir", str(run / "ckpt" / "global_step_1" / "critic"), "--target_dir", str(hf_dir)])  # fmt: skip
    register_token_classifier(AutoConfig.from_pretrained(hf_dir))
    critic = AutoModelForTokenClassification.from_pretrained(hf_dir)
    family = {"tiny-glm4moe": "Glm4Moe", "tiny-dsv3": "DeepseekV3"}[preset]
    assert type(critic).__name__ == f"{family}ForTokenClassification"
    before = build_model(preset)[0].state_dict()
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert not critic.state_dict()[name].equal(before[name]), "the critic's update must move the experts"
