"""A mixture-of-experts critic on megatron: a value head on the Qwen3-MoE body. Its values and one
value update on 2 ranks, at ep=1 and with the experts split over 2 expert-parallel ranks, equal the
single-process FSDP critic on HF's `Qwen3MoeForTokenClassification` over the whole batch (values,
losses, gradient norm, weights)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import assert_metrics_close, build_loaded_chunks, hf_state_dict, tiny_moe_hf_model
from tests.workers.critic.test_megatron_critic import CONFIG, LR
from verl.protocol import DataProto
from verl.workers.critic.dp_critic import DataParallelPPOCritic


def _hf_moe_value_model():
    from transformers import AutoModelForTokenClassification

    causal = tiny_moe_hf_model()
    config = copy.deepcopy(causal.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(3)
    model = AutoModelForTokenClassification.from_config(config).float()
    model.set_experts_implementation("eager")
    missing = model.load_state_dict(hf_state_dict(causal), strict=False).missing_keys
    assert sorted(missing) == ["score.bias", "score.weight"], missing  # the body is the causal model's
    with torch.no_grad():
        model.score.bias.fill_(0.3)
    return model.eval()


def _moe_critic_against_fsdp(rank, world_size, ep):
    from megatron.core import parallel_state as mpu

    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.workers.critic.megatron_critic import MegatronPPOCritic

    hf_model = _hf_moe_value_model()
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=4)
    g = torch.Generator().manual_seed(5)
    td["values"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    td["returns"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    data = DataProto.from_dict(tensors=dict(td.items()), meta_info={"micro_batch_size": 2})
    mask = td["response_mask"].bool()

    reference_model = copy.deepcopy(hf_model)
    reference = DataParallelPPOCritic(CONFIG, reference_model, torch.optim.SGD(reference_model.parameters(), lr=LR))
    want_values = reference.compute_values(copy.deepcopy(data))
    want_metrics = reference.update_critic(copy.deepcopy(data))

    chunks = build_loaded_chunks(hf_model, value_head=True, ep=ep)
    assert mpu.get_expert_model_parallel_world_size() == ep and mpu.get_data_parallel_world_size() == 2
    params = [p for chunk in chunks for p in chunk.parameters()]
    critic = MegatronPPOCritic({**CONFIG, "ppo_mini_batch_size": 2}, chunks, torch.optim.SGD(params, lr=LR))
    # the reference's mini-batches are rows 0-3 and 4-7: each rank holds one pair of each
    mine = torch.tensor([0, 1, 4, 5] if mpu.get_data_parallel_rank() == 0 else [2, 3, 6, 7])
    got_values = critic.compute_values(data.select_idxs(mine))
    torch.testing.assert_close(got_values[mask[mine]], want_values[mine][mask[mine]], atol=1e-5, rtol=0)
    got_metrics = critic.update_critic(data.select_idxs(mine))
    assert_metrics_close(got_metrics, want_metrics, ["critic/grad_norm"])
    got = dict(mcore_to_hf_named_tensors(chunks, hf_model.config, value_head=True))
    want = reference_model.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0, msg=name)
    moved = max(float((want[n] - hf_model.state_dict()[n]).abs().max()) for n in want if ".mlp.experts." in n)
    assert moved > 1e-3, f"the update should move the experts (max change {moved})"


@pytest.mark.parametrize("ep", [1, 2])
def test_megatron_moe_critic_on_two_ranks_equals_the_fsdp_critic_on_the_whole_batch(ep):
    run_distributed(_moe_critic_against_fsdp, 2, ep)
