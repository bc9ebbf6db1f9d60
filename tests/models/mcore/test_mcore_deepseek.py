"""A DeepSeek-V3 model (`tiny-dsv3`: multi-head latent attention, a dense first layer, sigmoid
group-limited routing with a correction bias and a scaling factor, a shared expert) on
megatron-core's local spec: its log-probs equal transformers' at tp=1, tp=2 (sequence parallel),
ep=2 and cp=2 on 2 gloo ranks, HF -> megatron -> HF is bit-exact, and what the backend does not build
is refused in one line."""

from __future__ import annotations

import pytest

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import (
    assert_correction_bias_changes_routing,
    assert_hf_round_trip_exact,
    build_loaded_chunks,
    tiny_dsv3_hf_model,
)
from tests.models.mcore.test_mcore_model import (
    _batch,
    assert_context_parallel_log_probs_equal_hf,
    assert_log_probs_equal_hf,
    expert_parallel_rows,
)


def _check_log_probs(rank, world_size, tp, ep, q_lora_rank, rope_interleave):
    hf_model = tiny_dsv3_hf_model(q_lora_rank=q_lora_rank, rope_interleave=rope_interleave)
    batch = expert_parallel_rows(_batch(), rank, world_size, tp, ep)
    chunks = build_loaded_chunks(hf_model, tp=tp, ep=ep, sequence_parallel=tp > 1)
    layers = chunks[0].decoder.layers
    assert not hasattr(layers[0].mlp, "router"), "layer 0 is dense (first_k_dense_replace=1)"
    assert len(layers[1].mlp.experts.local_experts) == 8 // ep
    assert_log_probs_equal_hf(chunks, hf_model, batch, atol=2e-5, multiple_of=tp)


@pytest.mark.parametrize(
    "tp,ep,q_lora_rank,rope_interleave",
    [(1, 1, 96, True), (1, 1, None, False), (2, 1, 96, True), (1, 2, 96, True)],
)
def test_megatron_deepseek_v3_log_probs_equal_hf(tp, ep, q_lora_rank, rope_interleave):
    run_distributed(_check_log_probs, max(tp, ep), tp, ep, q_lora_rank, rope_interleave)


@pytest.mark.slow  # 4 CPU ranks
def test_megatron_deepseek_v3_log_probs_equal_hf_at_tp2_ep2_etp2():
    """The routed experts split over 2 expert-parallel ranks and each over 2 expert-tensor ranks (etp
    defaults to tp): the dispatcher's uneven gather over the expert-tensor ranks runs on gloo."""
    run_distributed(_check_log_probs, 4, 2, 2, 96, True)


def test_the_correction_bias_changes_the_routing():
    """The reference itself: the bias the conversion carries decides experts (else a dropped bias
    would pass the log-prob test)."""
    hf_model = tiny_dsv3_hf_model()
    assert_correction_bias_changes_routing(hf_model)


# uneven pipeline stages for the 3 layers at pp=2 -> the global layers of stage 0 and stage 1
_PP2_SPLITS = {
    "first=1": ({"num_layers_in_first_pipeline_stage": 1}, ([0], [1, 2])),
    "last=1": ({"num_layers_in_last_pipeline_stage": 1}, ([0, 1], [2])),
    "embedding": ({"account_for_embedding_in_pipeline_split": True}, ([0], [1, 2])),
    "loss": ({"account_for_loss_in_pipeline_split": True}, ([0, 1], [2])),
}


def _check_round_trip(rank, world_size, tp, pp, ep, split=None):
    from megatron.core import parallel_state as mpu

    hf_model = tiny_dsv3_hf_model()
    overrides, stage_layers = _PP2_SPLITS[split] if split else (None, None)
    chunks = build_loaded_chunks(hf_model, tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1, tf_overrides=overrides)
    if split:  # each stage builds its own layers' kinds: layer 0 dense, 1 and 2 MoE
        want = stage_layers[mpu.get_pipeline_model_parallel_rank()]
        layers = chunks[0].decoder.layers
        assert [layer.layer_number - 1 for layer in layers] == want
        assert [hasattr(layer.mlp, "router") for layer in layers] == [i > 0 for i in want]
    assert_hf_round_trip_exact(chunks, hf_model)


@pytest.mark.parametrize(
    "tp,pp,ep,split",
    [
        (1, 1, 1, None),
        (2, 1, 1, None),
        (1, 1, 2, None),
        (1, 3, 1, None),
        (1, 2, 1, "first=1"),
        (1, 2, 1, "last=1"),
        (1, 2, 1, "embedding"),
        (1, 2, 1, "loss"),
        pytest.param(1, 2, 2, "first=1", marks=pytest.mark.slow),  # four ranks: the slow tier
    ],
)
def test_hf_to_megatron_deepseek_v3_to_hf_round_trip_is_bit_exact(tp, pp, ep, split):
    run_distributed(_check_round_trip, max(tp * pp, ep * pp), tp, pp, ep, split)


@pytest.mark.parametrize(
    "pp,overrides,message",
    [
        (2, {}, "cannot be split evenly .* or set megatron.override_transformer_config.num_layers_in_first"),
        (1, {"num_layers_in_first_pipeline_stage": 1}, "pipeline_model_parallel_size=1; remove it"),
        (2, {"num_layers_in_first_pipeline_stage": 0}, "must be a positive integer"),
        (2, {"num_layers_in_first_pipeline_stage": 3}, "leave 0 layers for 1 middle stages"),
        (2, {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 1}, "leave 1 layers for 0"),
        (3, {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 1}, None),
        (4, {"num_layers_in_last_pipeline_stage": 1}, "2 layers left for the 3 middle stages do not split evenly"),
        (
            2,
            {"num_layers_in_first_pipeline_stage": 1, "account_for_loss_in_pipeline_split": True},
            "keep one of them",
        ),
        (
            2,
            {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
            "make 5, which pipeline_model_parallel_size=2",
        ),
        (2, {"pipeline_model_parallel_layout": "Et|tt|L"}, "pipeline_model_parallel_layout is not supported"),
    ],
)
def test_pipeline_stage_sizes_that_do_not_add_up_are_refused(pp, overrides, message):
    """The 3 layers on `pp` stages: an even split needs pp to divide 3; the uneven-split keys of
    `override_transformer_config` must leave every stage layers and every layer a stage."""
    from verl.models.mcore import hf_to_mcore_config

    megatron_cfg = {"pipeline_model_parallel_size": pp, "override_transformer_config": overrides}
    if message is None:  # 1 + 1 + 1: a valid split reaches megatron's config as given
        tf_config = hf_to_mcore_config(tiny_dsv3_hf_model().config, megatron_cfg)
        assert tf_config.num_layers_in_first_pipeline_stage == tf_config.num_layers_in_last_pipeline_stage == 1
        return
    error = NotImplementedError if "layout" in message else ValueError
    with pytest.raises(error, match=message):
        hf_to_mcore_config(tiny_dsv3_hf_model().config, megatron_cfg)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("num_nextn_predict_layers", 1, "num_nextn_predict_layers=1 .multi-token prediction"),
        ("norm_topk_prob", False, "norm_topk_prob=false"),
        ("topk_group", 1, "agree only when that is 2"),
        ("output_router_logits", True, "aux-loss-free"),
    ],
)
def test_what_the_backend_does_not_build_is_refused(key, value, message):
    from verl.models.mcore import hf_to_mcore_config

    config = tiny_dsv3_hf_model().config
    setattr(config, key, value)
    with pytest.raises(NotImplementedError, match=message):
        hf_to_mcore_config(config, None)


def _check_context_parallel_log_probs(rank, world_size, q_lora_rank):
    hf_model = tiny_dsv3_hf_model(q_lora_rank=q_lora_rank)
    chunks = build_loaded_chunks(hf_model, cp=world_size)
    assert_context_parallel_log_probs_equal_hf(chunks, hf_model, _batch(), atol=2e-5)


@pytest.mark.parametrize("q_lora_rank", [96, None])
def test_megatron_deepseek_v3_log_probs_equal_hf_under_context_parallelism(q_lora_rank):
    """cp=2: each rank holds chunks 1 and 4 (or 2 and 3) of every row; the latent attention's rotary
    part is applied at those chunks' positions and the queries attend to the gathered keys/values
    (value heads narrower than query/key heads)."""
    run_distributed(_check_context_parallel_log_probs, 2, q_lora_rank)


def _check_lora_refused(rank, world_size):
    from verl.models.mcore.lora import apply_lora

    chunks = build_loaded_chunks(tiny_dsv3_hf_model())
    with pytest.raises(NotImplementedError, match="multi-head latent attention"):
        apply_lora(chunks, {"rank": 4, "alpha": 8, "target_modules": ["linear_qkv", "linear_proj"]})


def test_lora_on_latent_attention_is_refused():
    run_distributed(_check_lora_refused, 1)
