"""The megatron actor trains a gpt-oss model (`tiny-gptoss`: attention sinks, a sliding-window then a
full-attention layer, YaRN, biases on attention, router and experts, the clamped SwiGLU) as the FSDP
actor does: at ep=1, with the experts split over 2 expert-parallel ranks, at tp=2 (sequence
parallel, experts whole on each rank: expert_tensor_parallel_size=1), on 2 pipeline stages and with
each expert split over 2 ranks (etp=2 at tp=1 and tp=2), one PPO update on 2 ranks gives the
single-process FSDP update on the whole batch (its packed, remove-padding forward): losses,
gradient norms and every weight, the sinks and biases included. The router load-balancing loss is
transformers' gpt-oss aux loss (Switch Transformer's over the softmax of all biased logits, though
gpt-oss routes with a softmax over the top-k only), and with it on the megatron actor's logged loss
and update equal the FSDP actor's."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, tiny_gptoss_hf_model
from tests.workers.actor.test_megatron_actor import LR, _actor_config, _training_data
from tests.workers.actor.test_megatron_actor_deepseek import update_and_compare_with_fsdp
from tests.workers.actor.test_megatron_actor_moe import _update_and_compare, fsdp_reference_update
from verl.models.moe import METRIC, load_balancing_loss

AUX_COEF = 0.1  # as the Qwen3-MoE test's: large enough to show in the routers' update


def _against_fsdp_actor(rank, world_size, ep, tp, pp=1, etp=1):
    from megatron.core import parallel_state as mpu

    hf_model = tiny_gptoss_hf_model()
    data = _training_data(hf_model)
    reference_model, want_metrics = fsdp_reference_update(hf_model, data)
    assert METRIC not in want_metrics
    start = {name: p.detach().clone() for name, p in hf_model.named_parameters()}
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.down_proj_bias"):
        assert (reference_model.state_dict()[name] - start[name]).abs().max() > 1e-4, f"{name} should train"

    chunks = build_loaded_chunks(hf_model, ep=ep, tp=tp, pp=pp, etp=etp, sequence_parallel=tp > 1)
    assert mpu.get_data_parallel_world_size() == world_size // (tp * pp)
    assert mpu.get_expert_tensor_parallel_world_size() == etp
    assert len(chunks[0].decoder.layers[-1].mlp.experts.local_experts) == 4 // ep
    update_and_compare_with_fsdp(chunks, hf_model, data, reference_model, want_metrics)


@pytest.mark.parametrize("ep,tp,pp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_megatron_gpt_oss_update_on_two_ranks_equals_the_fsdp_update_on_the_whole_batch(ep, tp, pp):
    """pp=2: the sliding-window layer on the first stage, the full-attention layer on the second."""
    run_distributed(_against_fsdp_actor, 2, ep, tp, pp)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_gpt_oss_update_with_each_expert_split_over_two_ranks_equals_the_fsdp_update(tp):
    """expert_tensor_parallel_size=2: the fc2 bias, whole on both expert-tensor ranks, gets the whole
    gradient on each and stays equal; at tp=1 the two expert-tensor ranks are data-parallel ranks."""
    run_distributed(_against_fsdp_actor, 2, 1, tp, 1, 2)


def _switch_loss_float64(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch Transformer's loss by hand, in float64: over every layer's tokens, E * sum_e f_e * P_e
    with P_e the mean of the softmax over all E biased logits and f_e the share of top-k choices."""
    logits = torch.cat(router_logits).double()
    tokens, experts = logits.shape
    probs = logits.softmax(dim=-1)
    chosen = logits.topk(top_k, dim=-1).indices
    f = torch.stack([(chosen == e).sum() for e in range(experts)]).double() / tokens
    return experts * (f * probs.mean(dim=0)).sum()


def test_gpt_oss_load_balancing_loss_is_transformers_over_the_full_softmax_of_the_biased_logits():
    """gpt-oss routes with a softmax over the top-k logits only, but transformers' aux loss (what
    `GptOssForCausalLM` adds with output_router_logits) takes the softmax over all experts of the
    router's biased logits; the FSDP actor's `load_balancing_loss` of the recorded logits is that,
    and the softmax-after-top-k form is a different number."""
    hf_model = tiny_gptoss_hf_model()
    routers = [layer.mlp.router for layer in hf_model.model.layers]
    with torch.no_grad():
        for router in routers:  # a bias large enough to move the loss
            router.bias.copy_(torch.tensor([1.0, -1.0, 0.5, -0.5]))
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = hf_model(input_ids=ids, output_router_logits=True, labels=ids)
    logits = [layer.reshape(-1, layer.shape[-1]) for layer in out.router_logits]
    top_k = hf_model.config.num_experts_per_tok
    want = _switch_loss_float64(logits, top_k)
    unbiased = _switch_loss_float64([t - r.bias.detach() for t, r in zip(logits, routers)], top_k)
    assert (unbiased - want).abs() > 1e-2, "the router bias is part of the logits the loss reads"
    torch.testing.assert_close(out.aux_loss.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(load_balancing_loss(logits, top_k).double(), want, atol=1e-6, rtol=0)
    # softmax over the chosen logits only (the routing weights) puts all mass on the top-k
    top = torch.cat(logits).double().topk(top_k, dim=-1)
    weights = torch.zeros_like(torch.cat(logits).double()).scatter(1, top.indices, top.values.softmax(-1))
    f = torch.zeros(weights.shape[1], dtype=torch.float64).index_add_(
        0, top.indices.reshape(-1), torch.ones(top.indices.numel(), dtype=torch.float64)
    )
    after_top_k = weights.shape[1] * (f / weights.shape[0] * weights.mean(0)).sum()
    assert (after_top_k - want).abs() > 1e-4  # 6e-4 here, 600x the tolerance above


def _aux_against_fsdp_actor(rank, world_size, ep, tp, pp=1, etp=1):
    from megatron.core import parallel_state as mpu

    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = tiny_gptoss_hf_model(router_aux_loss_coef=AUX_COEF)
    data = _training_data(hf_model)  # its scorer (an FSDP actor) takes the flag over: set it after
    without_aux, _ = fsdp_reference_update(hf_model, data)
    hf_model.config.output_router_logits = True
    reference_model, want_metrics = fsdp_reference_update(hf_model, data)
    assert want_metrics[METRIC] and min(want_metrics[METRIC]) > 0
    hf_model.config.output_router_logits = True  # the reference actor switched it off too
    for name in ("model.layers.0.mlp.router.weight", "model.layers.0.mlp.router.bias"):
        moved_by_aux = (reference_model.state_dict()[name] - without_aux.state_dict()[name]).abs().max()
        assert moved_by_aux > 1e-4, f"the load-balancing gradient should show in {name}"  # 10x the weight tolerance

    chunks = build_loaded_chunks(hf_model, ep=ep, tp=tp, pp=pp, etp=etp, sequence_parallel=tp > 1)
    dp = mpu.get_data_parallel_world_size()
    params = [p for chunk in chunks for p in chunk.parameters()]
    actor = MegatronPPOActor(
        _actor_config(ppo_mini_batch_size=4 // dp), chunks, hf_model.config, torch.optim.SGD(params, lr=LR)
    )
    assert actor.router_aux.enabled and actor.router_aux.coef == AUX_COEF
    _update_and_compare(actor, chunks, hf_model, data, want_metrics, reference_model, dp, True)


# tp and pp add nothing family-specific to the term (test_megatron_actor_moe.py covers them on tiny-moe)
@pytest.mark.parametrize("ep,tp,pp,etp", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 1, 1, 2)])
def test_megatron_gpt_oss_load_balancing_loss_and_update_equal_the_fsdp_actor(ep, tp, pp, etp):
    """output_router_logits=true: the logged `actor/load_balancing_loss` of every micro-batch, the
    grad norm and every weight (router weight and bias included) equal the FSDP actor's, also with
    each expert split over 2 ranks."""
    run_distributed(_aux_against_fsdp_actor, 2, ep, tp, pp, etp)
