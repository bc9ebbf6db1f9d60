"""A Qwen3-MoE model on megatron-core (routed experts in megatron's MoE layer, local spec): its
log-probs equal transformers' at ep=1 and with the experts split over 2 expert-parallel ranks
(tokens dispatched by megatron's all-to-all over gloo), also with each expert split over 2
expert-tensor ranks at tp=2 (4 ranks), and HF -> megatron -> HF is bit-exact at
every expert layout."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import assert_hf_round_trip_exact, build_loaded_chunks, tiny_moe_hf_model
from tests.models.mcore.test_mcore_model import (
    RESPONSE_LENGTH,
    _batch,
    _hf_response_log_probs,
    _megatron_response_log_probs,
    assert_log_probs_equal_hf,
    expert_parallel_rows,
)
from verl.models.mcore.forward import left_align


def _check_log_probs(rank, world_size, tp, ep, etp, norm_topk_prob):
    hf_model = tiny_moe_hf_model(norm_topk_prob=norm_topk_prob)
    batch = expert_parallel_rows(_batch(), rank, world_size, tp, ep, etp)
    chunks = build_loaded_chunks(hf_model, tp=tp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    experts = chunks[0].decoder.layers[0].mlp.experts.local_experts
    assert len(experts) == 4 // ep, f"rank {rank} holds {len(experts)} experts, want {4 // ep}"
    assert_log_probs_equal_hf(chunks, hf_model, batch, atol=2e-5, multiple_of=tp)


@pytest.mark.parametrize(
    "tp,ep,etp,norm_topk_prob",
    [(1, 1, None, True), (1, 1, None, False), (2, 1, None, True), (1, 2, None, True), (2, 1, 1, True)],
)
def test_megatron_moe_log_probs_equal_hf(tp, ep, etp, norm_topk_prob):
    run_distributed(_check_log_probs, max(tp, ep), tp, ep, etp, norm_topk_prob)


def test_megatron_moe_log_probs_equal_hf_with_experts_split_over_more_ranks_than_the_dense_layers():
    """tp=1, etp=2 on 2 ranks: each rank holds the dense layers whole and half of every expert's MLP,
    and routes its own rows; the expert-tensor group (both data-parallel ranks) gathers their uneven
    token counts (gloo's padded form, `verl.utils.megatron.gloo_collectives`) and reduce-scatters
    the expert outputs back."""
    run_distributed(_check_log_probs, 2, 1, 1, 2, True)


@pytest.mark.slow  # 4 CPU ranks
def test_megatron_moe_log_probs_equal_hf_at_ep2_etp2_tp2():
    """Each expert split over 2 expert-tensor ranks and the experts over 2 expert-parallel ranks: the
    dispatcher gathers uneven token counts over the expert-tensor group (gloo's padded form,
    `verl.utils.megatron.gloo_collectives`) and reduce-scatters the results back."""
    run_distributed(_check_log_probs, 4, 2, 2, 2, True)


def _check_round_trip(rank, world_size, tp, pp, ep, etp):
    hf_model = tiny_moe_hf_model(num_layers=2)
    chunks = build_loaded_chunks(hf_model, tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    assert_hf_round_trip_exact(chunks, hf_model)


@pytest.mark.parametrize("tp,pp,ep,etp", [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 1, None), (1, 2, 1, None)])
def test_hf_to_megatron_moe_to_hf_round_trip_is_bit_exact(tp, pp, ep, etp):
    run_distributed(_check_round_trip, max(tp * pp, ep * pp), tp, pp, ep, etp)


@pytest.mark.slow  # 4 CPU ranks
def test_hf_to_megatron_moe_to_hf_round_trip_is_bit_exact_at_ep2_etp2_tp2():
    run_distributed(_check_round_trip, 4, 2, 1, 2, 2)


@pytest.mark.parametrize(
    "megatron_cfg,message",
    [
        ({"expert_model_parallel_size": 3}, "expert_model_parallel_size=3 must divide the model's num_experts=4"),
        ({"expert_tensor_parallel_size": 5}, "expert_tensor_parallel_size=5 must divide the model's moe_intermediate"),
        ({"tensor_model_parallel_size": 2, "sequence_parallel": False}, "needs actor.megatron.sequence_parallel=true"),
    ],
)
def test_an_expert_layout_the_model_cannot_take_is_a_clear_error(megatron_cfg, message):
    from verl.models.mcore import hf_to_mcore_config

    with pytest.raises(ValueError, match=message):
        hf_to_mcore_config(tiny_moe_hf_model().config, megatron_cfg)


def test_expert_parallelism_on_a_dense_model_is_a_clear_error():
    from tests.megatron_helpers import tiny_hf_model
    from verl.models.mcore import hf_to_mcore_config

    with pytest.raises(ValueError, match="expert_model_parallel_size=2 on a dense qwen2 model"):
        hf_to_mcore_config(tiny_hf_model("qwen2").config, {"expert_model_parallel_size": 2})


@pytest.mark.gpu
@pytest.mark.usefixtures("one_gpu_group")
def test_megatron_moe_on_one_gpu_matches_hf_and_trains_the_router():
    """On a GPU without TransformerEngine (the `enable_moe_compat` shim: megatron's router linear
    refers to an unbound TE name there): fp32 log-probs equal the HF model's on the same GPU within
    1e-4 (TF32 off), and a backward pass gives the router and every local expert a finite, non-zero
    gradient."""
    hf_model = tiny_moe_hf_model()
    chunks = build_loaded_chunks(hf_model)
    chunks = [chunk.cuda() for chunk in chunks]
    hf_model = hf_model.cuda()
    batch = {k: v.cuda() for k, v in _batch().items()}
    got = _megatron_response_log_probs(chunks, hf_model.config, batch)
    want = _hf_response_log_probs(hf_model, batch)
    mask = batch["response_mask"].bool()
    diff = float((got[mask] - want[mask]).abs().max())
    assert diff <= 1e-4, f"max |log-prob diff| on the GPU: {diff:.3g}"

    aligned = left_align(batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE_LENGTH)
    chunks[0](aligned.input_ids, aligned.position_ids, None).float().logsumexp(-1).mean().backward()
    mlp = chunks[0].decoder.layers[0].mlp
    grads = {"router": mlp.router.weight.grad}
    grads.update({f"expert {i}": e.linear_fc1.weight.grad for i, e in enumerate(mlp.experts.local_experts)})
    for name, grad in grads.items():
        assert grad is not None and bool(torch.isfinite(grad).all()), f"{name}: gradient {grad}"
        assert float(grad.abs().max()) > 0, f"{name}: zero gradient"
