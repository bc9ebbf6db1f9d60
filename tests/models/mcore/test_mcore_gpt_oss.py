"""A gpt-oss model (`tiny-gptoss`: attention sinks, a sliding-window layer then a full-attention one,
YaRN RoPE, biases on q/k/v/o, the router and the experts, the clamped SwiGLU with gate/up
interleaved) on megatron-core's local spec: its log-probs equal transformers' at tp=1, tp=2
(sequence parallel), ep=2, tp=2 x ep=2 and etp=2 (tp=1, tp=2) on sequences longer than the 4-token
window; HF ->
megatron -> HF is bit-exact; dropping the sinks or the window fails the comparison; and what
megatron cannot build exactly is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import assert_hf_round_trip_exact, build_loaded_chunks, tiny_gptoss_hf_model
from tests.models.mcore.test_mcore_model import (
    RESPONSE_LENGTH,
    _hf_response_log_probs,
    _megatron_response_log_probs,
    assert_log_probs_equal_hf,
    expert_parallel_rows,
)

ATOL = 2e-5
WINDOW = 4


def _batch():
    """4 rows of 8 to 13 real tokens (left-padded prompts, right-padded responses): every row runs
    past the 4-token window, so the sliding layer attends differently from the full one."""
    return make_ppo_batch(
        batch_size=4,
        prompt_length=8,
        response_length=RESPONSE_LENGTH,
        seed=3,
        prompt_lengths=[8, 3, 6, 5],
        response_lengths=[5, 5, 2, 4],
    )


def _check_log_probs(rank, world_size, tp, ep, etp=1):
    hf_model = tiny_gptoss_hf_model()
    batch = expert_parallel_rows(_batch(), rank, world_size, tp, ep, etp)
    assert int(batch["attention_mask"].sum(-1).min()) > WINDOW + 2, "every row must leave the sliding window"
    chunks = build_loaded_chunks(hf_model, tp=tp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    config = chunks[0].config
    assert config.softmax_type == "learnable" and config.window_size == (WINDOW - 1, 0)
    assert config.window_attn_skip_freq == [1, 0] and config.glu_linear_offset == 1.0
    assert config.activation_func_clamp_value == 7.0 and config.add_bias_linear
    assert type(chunks[0].rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
    layers = chunks[0].decoder.layers
    assert layers[0].self_attention.core_attention.softmax_offset.numel() == 4 // tp
    assert len(layers[1].mlp.experts.local_experts) == 4 // ep
    expert = layers[1].mlp.experts.local_experts[0]
    assert expert.linear_fc1.bias.numel() == 2 * hf_model.config.intermediate_size // etp  # [gate; up] shards
    assert expert.linear_fc2.bias.numel() == hf_model.config.hidden_size  # whole, added once over the etp ranks
    assert_log_probs_equal_hf(chunks, hf_model, batch, atol=ATOL, multiple_of=tp)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_megatron_gpt_oss_log_probs_equal_hf(tp, ep):
    run_distributed(_check_log_probs, max(tp, ep), tp, ep)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_gpt_oss_log_probs_equal_hf_with_each_expert_split_over_two_ranks(tp):
    """expert_tensor_parallel_size=2 (megatron-core refuses biased experts there): fc1's bias is
    split with its rows, fc2's bias is whole on both ranks and each adds half before the reduction."""
    run_distributed(_check_log_probs, 2, tp, 1, 2)


def _drop_sinks(chunks):
    for layer in chunks[0].decoder.layers:
        layer.self_attention.core_attention.softmax_offset = None


def _ignore_window(chunks):
    for layer in chunks[0].decoder.layers:
        layer.self_attention.core_attention.scale_mask_softmax.window_size = None


@pytest.mark.parametrize("mutation", [_drop_sinks, _ignore_window])
def test_a_model_without_sinks_or_without_the_window_fails_the_comparison(mutation):
    """The log-prob check sees both attention features: megatron with the sinks dropped (plain
    softmax) or with the sliding window ignored (full causal attention in layer 0) is off by far more
    than the tolerance."""
    run_distributed(_check_mutation_fails, 1, mutation)


def _check_mutation_fails(rank, world_size, mutation):
    hf_model = tiny_gptoss_hf_model()
    batch = _batch()
    chunks = build_loaded_chunks(hf_model)
    mask = batch["response_mask"].bool()
    want = _hf_response_log_probs(hf_model, batch)[mask]
    exact = _megatron_response_log_probs(chunks, hf_model.config, batch)[mask]
    mutation(chunks)
    mutated = _megatron_response_log_probs(chunks, hf_model.config, batch)[mask]
    assert float((exact - want).abs().max()) < ATOL
    assert float((mutated - want).abs().max()) > 100 * ATOL


def test_the_reference_depends_on_the_clamp_and_the_yarn_scaling():
    """transformers' model itself: the experts' clamp cuts pre-activations of this model (a
    different `swiglu_limit` changes the log-probs), and its YaRN frequencies and cos/sin scale are
    the formulas megatron's YarnRotaryEmbedding computes (written out here in float64)."""
    import math

    hf_model = tiny_gptoss_hf_model()
    batch = _batch()
    want = _hf_response_log_probs(hf_model, batch)
    for experts in (layer.mlp.experts for layer in hf_model.model.layers):
        experts.limit = 1e9
    unclamped = _hf_response_log_probs(hf_model, batch)
    mask = batch["response_mask"].bool()
    assert float((unclamped - want)[mask].abs().max()) > 100 * ATOL

    rotary = hf_model.model.rotary_emb
    dim, base, factor, original = 64, 150000.0, 32.0, 4096
    index = torch.arange(0, dim, 2, dtype=torch.float64) / dim

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(correction_dim(32.0), 0), min(correction_dim(1.0), dim - 1)  # truncate=False: no rounding
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = (1 / (factor * base**index)) * ramp + (1 / base**index) * (1 - ramp)
    torch.testing.assert_close(rotary.inv_freq.double(), inv_freq, atol=1e-9, rtol=1e-6)
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(factor) + 1)


def _check_round_trip(rank, world_size, tp, pp, ep):
    hf_model = tiny_gptoss_hf_model()
    chunks = build_loaded_chunks(hf_model, tp=tp, pp=pp, ep=ep, etp=1, sequence_parallel=tp > 1)
    assert_hf_round_trip_exact(chunks, hf_model)


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1)])
def test_hf_to_megatron_gpt_oss_to_hf_round_trip_is_bit_exact(tp, pp, ep):
    run_distributed(_check_round_trip, max(tp * pp, ep * pp), tp, pp, ep)


@pytest.mark.parametrize(
    "change,megatron,error,message",
    [
        ({"attention_bias": False}, {}, NotImplementedError, "attention_bias=false"),
        ({"swiglu_alpha": 1.5}, {}, NotImplementedError, "swiglu_alpha=1.5"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, {}, NotImplementedError, "rope_type='linear'"),
        ({}, {"context_parallel_size": 2}, NotImplementedError, "context_parallel_size > 1 on gpt_oss"),
    ],
)
def test_what_megatron_cannot_build_exactly_is_refused(change, megatron, error, message):
    from verl.models.mcore import hf_to_mcore_config

    config = tiny_gptoss_hf_model().config
    for key, value in change.items():
        if key == "rope_parameters":
            value = dict(value, rope_theta=150000.0)
        setattr(config, key, value)
    with pytest.raises(error, match=message):
        hf_to_mcore_config(config, megatron)


def test_an_all_full_attention_config_builds_no_window():
    from verl.models.mcore import hf_to_mcore_config

    config = tiny_gptoss_hf_model().config
    config.layer_types = ["full_attention", "full_attention"]
    tf_config = hf_to_mcore_config(config, None)
    assert tf_config.window_size is None and tf_config.softmax_type == "learnable"
