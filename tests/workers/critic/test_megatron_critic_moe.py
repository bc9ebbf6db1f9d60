"""Mixture-of-experts critics on megatron: a value head on the Qwen3-MoE, DeepSeek-V3 (latent
attention, grouped sigmoid routing with a correction bias, a dense first layer) and GLM-4.5 (q/k/v
bias, half rotary, sigmoid routing) bodies. Their values and one value update on 2 ranks (at ep=1,
with the experts split over 2 expert-parallel ranks, at tp=2 with sequence parallelism, on 2
pipeline stages, and for DeepSeek-V3 and GLM-4.5 with each sequence split over 2 context-parallel
ranks) equal the
single-process FSDP critic on the family's HF token classifier over the whole batch (values, losses,
gradient norm, every weight, the routers' correction bias left where it was). GLM-4.5 has no
token-classification class in transformers: the reference is the generic one
`verl.utils.model.register_token_classifier` registers, transformers' own head over `Glm4MoeModel`.
A DeepSeek-V3 checkpoint with multi-token-prediction layers, which the policy refuses, starts a
critic (a value model never builds them)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import (
    assert_metrics_close,
    build_loaded_chunks,
    hf_state_dict,
    tiny_dsv3_hf_model,
    tiny_glm4moe_hf_model,
    tiny_moe_hf_model,
)
from tests.workers.critic.test_megatron_critic import CONFIG, LR
from verl.protocol import DataProto
from verl.utils.model import register_token_classifier
from verl.workers.critic.dp_critic import DataParallelPPOCritic

CAUSAL_MODELS = {"qwen3_moe": tiny_moe_hf_model, "deepseek_v3": tiny_dsv3_hf_model, "glm4_moe": tiny_glm4moe_hf_model}

# pp=2 stages of the 3-layer DeepSeek-V3 and GLM-4.5 presets: the dense layer alone on the first
PP2_STAGES = {"num_layers_in_first_pipeline_stage": 1}


def hf_moe_value_model(family: str, num_layers: int | None = None):
    """The family's tiny causal model as an HF token classifier (the critic's FSDP form): the same
    body, and a fresh `score` head whose bias is moved off zero."""
    from transformers import AutoModelForTokenClassification

    causal = CAUSAL_MODELS[family]() if num_layers is None else CAUSAL_MODELS[family](num_layers=num_layers)
    config = copy.deepcopy(causal.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    register_token_classifier(config)
    torch.manual_seed(3)
    model = AutoModelForTokenClassification.from_config(config).float()
    model.set_experts_implementation("eager")
    missing = model.load_state_dict(hf_state_dict(causal), strict=False).missing_keys
    assert sorted(missing) == ["score.bias", "score.weight"], missing  # the body is the causal model's
    with torch.no_grad():
        model.score.bias.fill_(0.3)
    return model.eval()


def critic_data() -> DataProto:
    """8 rows with random old values and returns (2-row micro-batches)."""
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=4)
    g = torch.Generator().manual_seed(5)
    td["values"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    td["returns"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"micro_batch_size": 2})


def fsdp_reference_critic(hf_model, data: DataProto):
    """(the updated copy of `hf_model`, its values before the update, its update's metrics): the
    single-process FSDP critic on the whole batch (two mini-batches of 4 rows), with SGD."""
    reference_model = copy.deepcopy(hf_model)
    reference = DataParallelPPOCritic(CONFIG, reference_model, torch.optim.SGD(reference_model.parameters(), lr=LR))
    values = reference.compute_values(copy.deepcopy(data))
    return reference_model, values, reference.update_critic(copy.deepcopy(data))


def _moe_critic_against_fsdp(rank, world_size, family, ep, pp=1, tf_overrides=None, tp=1, cp=1):
    from megatron.core import parallel_state as mpu

    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.workers.critic.megatron_critic import MegatronPPOCritic

    hf_model = hf_moe_value_model(family)
    data = critic_data()
    mask = data.batch["response_mask"].bool()
    reference_model, want_values, want_metrics = fsdp_reference_critic(hf_model, data)

    chunks = build_loaded_chunks(
        hf_model, value_head=True, ep=ep, pp=pp, tp=tp, cp=cp, sequence_parallel=tp > 1, tf_overrides=tf_overrides
    )
    dp = mpu.get_data_parallel_world_size()
    assert mpu.get_expert_model_parallel_world_size() == ep and dp == world_size // (pp * tp * cp)
    assert mpu.get_context_parallel_world_size() == cp
    params = [p for chunk in chunks for p in chunk.parameters()]
    critic = MegatronPPOCritic({**CONFIG, "ppo_mini_batch_size": 4 // dp}, chunks, torch.optim.SGD(params, lr=LR))
    # the reference's mini-batches are rows 0-3 and 4-7: at dp=2 each rank holds one pair of each
    mine = torch.tensor([0, 1, 4, 5] if mpu.get_data_parallel_rank() == 0 else [2, 3, 6, 7])
    mine = mine if dp == 2 else torch.arange(8)
    got_values = critic.compute_values(data.select_idxs(mine))
    torch.testing.assert_close(got_values[mask[mine]], want_values[mine][mask[mine]], atol=1e-5, rtol=0)
    got_metrics = critic.update_critic(data.select_idxs(mine))
    assert sorted(got_metrics) == sorted(want_metrics)
    assert_metrics_close(got_metrics, want_metrics, ["critic/grad_norm"])
    # a micro-batch's loss is over its own rows: this rank's are every dp-th of the reference's
    want_vf_loss = want_metrics["critic/vf_loss"][mpu.get_data_parallel_rank() :: dp]
    assert_metrics_close(got_metrics, {"critic/vf_loss": want_vf_loss}, same_length=True)
    got = dict(mcore_to_hf_named_tensors(chunks, hf_model.config, value_head=True))
    want, start = reference_model.state_dict(), hf_model.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0, msg=name)
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(tensor, start[name]), f"{name} moved: the bias is not trained online"
    moved = max(float((want[n] - start[n]).abs().max()) for n in want if ".mlp.experts." in n)
    assert moved > 1e-3, f"the update should move the experts (max change {moved})"


@pytest.mark.parametrize("family", sorted(CAUSAL_MODELS))
@pytest.mark.parametrize("ep", [1, 2])
def test_megatron_moe_critic_on_two_ranks_equals_the_fsdp_critic_on_the_whole_batch(family, ep):
    run_distributed(_moe_critic_against_fsdp, 2, family, ep)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_megatron_moe_critic_on_two_pipeline_stages_equals_the_fsdp_critic(family):
    run_distributed(_moe_critic_against_fsdp, 2, family, 1, 2, PP2_STAGES)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_megatron_moe_critic_at_tp2_with_sequence_parallelism_equals_the_fsdp_critic(family):
    run_distributed(_moe_critic_against_fsdp, 2, family, 1, 1, None, 2)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_megatron_moe_critic_at_cp2_equals_the_fsdp_critic(family):
    run_distributed(_moe_critic_against_fsdp, 2, family, 1, 1, None, 1, 2)


def _deepseek_critic_ignores_mtp_layers(rank, world_size, path):
    from omegaconf import OmegaConf

    from tests.megatron_helpers import setup_megatron
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    causal = tiny_dsv3_hf_model()
    causal.config.num_nextn_predict_layers = 1  # DeepSeek-V3-671B's own
    causal.save_pretrained(path)
    setup_megatron()
    model_config = OmegaConf.create({"path": str(path)})
    with pytest.raises(NotImplementedError, match="num_nextn_predict_layers=1 .multi-token prediction"):
        MegatronEngineWithLMHead(model_config, {})  # the policy would need the MTP layers
    critic = MegatronEngineWithValueHead(model_config, {}, optimizer_config={"lr": 1e-3})
    got = dict(critic.iter_hf_params())
    want = hf_state_dict(causal)
    assert sorted(got) == sorted([n for n in want if not n.startswith("lm_head.")] + ["score.bias", "score.weight"])
    for name, tensor in got.items():
        if not name.startswith("score."):
            assert torch.equal(tensor, want[name]), name


def test_a_deepseek_v3_critic_builds_from_a_checkpoint_with_mtp_layers_the_policy_refuses(tmp_path):
    """The critic never builds MTP layers (neither does HF's token classifier), so
    `num_nextn_predict_layers > 0`, refused for the actor, builds the critic's body as it is."""
    run_distributed(_deepseek_critic_ignores_mtp_layers, 1, tmp_path / "dsv3-mtp")
