"""The megatron critic computes what the FSDP critic computes on the HF value model: the same
values, and one value update gives the same losses, gradient norms and weights (tp=2, pp=2)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import assert_metrics_close, build_loaded_chunks, hf_state_dict, tiny_hf_model
from verl.protocol import DataProto
from verl.workers.critic.dp_critic import DataParallelPPOCritic

LR = 0.5
CONFIG = {
    "ppo_mini_batch_size": 4,
    "ppo_micro_batch_size_per_gpu": 2,
    "ppo_epochs": 1,
    "cliprange_value": 0.2,
    "loss_agg_mode": "token-mean",
}


def _hf_value_model(num_layers: int):
    from transformers import AutoModelForTokenClassification

    causal = tiny_hf_model("qwen2", num_layers=num_layers)
    config = copy.deepcopy(causal.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(3)
    model = AutoModelForTokenClassification.from_config(config).float()
    model.load_state_dict(hf_state_dict(causal), strict=False)  # backbone; `score` keeps its random init
    with torch.no_grad():
        model.score.bias.fill_(0.3)
    return model.eval()


def _check_against_fsdp_critic(rank, world_size, tp, pp, vpp=None, cp=1, sp=False):
    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.workers.critic.megatron_critic import MegatronPPOCritic

    hf_model = _hf_value_model(2 * pp * (vpp or 1))
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=4)
    g = torch.Generator().manual_seed(5)
    td["values"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    td["returns"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    data = DataProto.from_dict(tensors=dict(td.items()), meta_info={"micro_batch_size": 3})
    mask = td["response_mask"].bool()

    reference_model = copy.deepcopy(hf_model)
    reference = DataParallelPPOCritic(CONFIG, reference_model, torch.optim.SGD(reference_model.parameters(), lr=LR))
    chunks = build_loaded_chunks(hf_model, tp=tp, pp=pp, vpp=vpp, value_head=True, cp=cp, sequence_parallel=sp)
    params = [p for chunk in chunks for p in chunk.parameters()]
    critic = MegatronPPOCritic(CONFIG, chunks, torch.optim.SGD(params, lr=LR))

    torch.testing.assert_close(
        critic.compute_values(copy.deepcopy(data))[mask],
        reference.compute_values(copy.deepcopy(data))[mask],
        atol=1e-5,
        rtol=0,
    )
    want_metrics = reference.update_critic(copy.deepcopy(data))
    got_metrics = critic.update_critic(copy.deepcopy(data))
    assert sorted(got_metrics) == sorted(want_metrics)
    assert_metrics_close(got_metrics, want_metrics)
    got = dict(mcore_to_hf_named_tensors(chunks, hf_model.config, value_head=True))
    want = reference_model.state_dict()
    assert "score.bias" in got
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0, msg=name)
    assert not torch.equal(got["score.weight"], hf_model.score.weight), "the update should move the head"


@pytest.mark.parametrize(
    "tp,pp,vpp,cp,sp",
    [
        (2, 1, None, 1, False),
        (1, 2, None, 1, False),
        (1, 2, 2, 1, False),
        (1, 1, None, 2, False),
        (2, 1, None, 1, True),
    ],
)
def test_megatron_critic_matches_fsdp_critic(tp, pp, vpp, cp, sp):
    run_distributed(_check_against_fsdp_critic, tp * pp * cp, tp, pp, vpp, cp, sp)
