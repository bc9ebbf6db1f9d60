"""A GLM-4.5 model (`tiny-glm4moe`: grouped-query attention with q/k/v bias, half rotary and
optional per-head q/k norms, a dense first layer, sigmoid routing with a correction bias and a
scaling factor, a shared expert) on megatron-core's local spec: its log-probs equal transformers'
at tp=1, tp=2 (sequence parallel), ep=2 and cp=2 on 2 gloo ranks, HF -> megatron -> HF is bit-exact,
and what megatron cannot build exactly is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import (
    assert_correction_bias_changes_routing,
    assert_hf_round_trip_exact,
    build_loaded_chunks,
    tiny_glm4moe_hf_model,
)
from tests.models.mcore.test_mcore_model import (
    _batch,
    assert_context_parallel_log_probs_equal_hf,
    assert_log_probs_equal_hf,
    expert_parallel_rows,
)


def _check_log_probs(rank, world_size, tp, ep, use_qk_norm, head_dim=None):
    hf_model = tiny_glm4moe_hf_model(use_qk_norm=use_qk_norm, head_dim=head_dim)
    batch = expert_parallel_rows(_batch(), rank, world_size, tp, ep)
    chunks = build_loaded_chunks(hf_model, tp=tp, ep=ep, sequence_parallel=tp > 1)
    config = chunks[0].config
    assert config.add_qkv_bias and config.qk_layernorm == use_qk_norm
    rotated = (head_dim or 64) // 2
    assert chunks[0].rotary_pos_emb.inv_freq.numel() == rotated // 2, "RoPE on half of the head dimensions"
    layers = chunks[0].decoder.layers
    assert not hasattr(layers[0].mlp, "router"), "layer 0 is dense (first_k_dense_replace=1)"
    assert len(layers[1].mlp.experts.local_experts) == 8 // ep
    assert_log_probs_equal_hf(chunks, hf_model, batch, atol=2e-5, multiple_of=tp)


@pytest.mark.parametrize("tp,ep,use_qk_norm", [(1, 1, False), (1, 1, True), (2, 1, True), (1, 2, False)])
def test_megatron_glm4_moe_log_probs_equal_hf(tp, ep, use_qk_norm):
    run_distributed(_check_log_probs, max(tp, ep), tp, ep, use_qk_norm)


@pytest.mark.slow  # 4 CPU ranks
def test_megatron_glm4_moe_log_probs_equal_hf_at_tp2_ep2_etp2():
    """The routed experts split over 2 expert-parallel ranks and each over 2 expert-tensor ranks (etp
    defaults to tp): the dispatcher's uneven gather over the expert-tensor ranks runs on gloo."""
    run_distributed(_check_log_probs, 4, 2, 2, True)


def test_a_head_dim_other_than_hidden_over_heads_log_probs_equal_hf():
    """GLM-4.5's heads are not hidden_size / num_attention_heads wide (128 x 96 heads on a 4096
    model): q/k/v and o_proj are head_dim * heads, here 96 * 4 on a 256 model, at tp=2."""
    run_distributed(_check_log_probs, 2, 2, 1, True, 96)


def test_the_reference_depends_on_what_the_conversion_carries():
    """The reference itself: the correction bias decides experts, and the rotary part is half of each
    head (a full-head RoPE or a dropped bias would otherwise be able to pass the log-prob test)."""
    hf_model = tiny_glm4moe_hf_model()
    assert_correction_bias_changes_routing(hf_model)
    inv_freq = hf_model.model.rotary_emb.inv_freq
    assert inv_freq.numel() == 16
    torch.testing.assert_close(inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32).float())


def _check_round_trip(rank, world_size, tp, pp, ep, use_qk_norm):
    hf_model = tiny_glm4moe_hf_model(use_qk_norm=use_qk_norm)
    chunks = build_loaded_chunks(hf_model, tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1)
    assert_hf_round_trip_exact(chunks, hf_model)


@pytest.mark.parametrize("tp,pp,ep,use_qk_norm", [(1, 1, 1, True), (2, 1, 1, True), (1, 1, 2, False), (1, 3, 1, False)])
def test_hf_to_megatron_glm4_moe_to_hf_round_trip_is_bit_exact(tp, pp, ep, use_qk_norm):
    run_distributed(_check_round_trip, max(tp * pp, ep * pp), tp, pp, ep, use_qk_norm)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("partial_rotary_factor", 0.3, "partial_rotary_factor=0.3 with head_dim=64"),
        ("n_shared_experts", 0, "n_shared_experts=0"),
        ("norm_topk_prob", False, "glm4_moe config has norm_topk_prob=false"),
        ("output_router_logits", True, "output_router_logits=true on glm4_moe"),
    ],
)
def test_what_megatron_cannot_build_exactly_is_refused(key, value, message):
    from verl.models.mcore import hf_to_mcore_config

    config = tiny_glm4moe_hf_model().config
    if key == "partial_rotary_factor":
        config.rope_parameters = dict(config.rope_parameters, partial_rotary_factor=value)
    else:
        setattr(config, key, value)
    with pytest.raises(NotImplementedError, match=message):
        hf_to_mcore_config(config, None)


def test_the_checkpoint_mtp_layer_is_ignored_as_transformers_ignores_it():
    """GLM-4.5(-Air)'s released configs declare one MTP layer; transformers builds none, and the
    megatron backend builds the same model (the engine refuses `model.mtp.enable`)."""
    from verl.models.mcore import hf_to_mcore_config

    config = tiny_glm4moe_hf_model().config
    config.num_nextn_predict_layers = 1
    tf_config = hf_to_mcore_config(config, None)
    assert not tf_config.mtp_num_layers
    assert tf_config.moe_layer_freq == [0, 1, 1]
    assert tf_config.moe_router_score_function == "sigmoid" and tf_config.moe_router_topk_scaling_factor == 2.5


def _check_context_parallel_log_probs(rank, world_size):
    hf_model = tiny_glm4moe_hf_model(use_qk_norm=True)
    chunks = build_loaded_chunks(hf_model, cp=world_size)
    assert_context_parallel_log_probs_equal_hf(chunks, hf_model, _batch(), atol=2e-5)


def test_megatron_glm4_moe_log_probs_equal_hf_under_context_parallelism():
    """cp=2 (upstream's GLM-4.5-Air recipe runs cp=4): each rank holds half of every sequence, RoPE
    on the half-head rotary part at the positions of its chunks."""
    run_distributed(_check_context_parallel_log_probs, 2)
