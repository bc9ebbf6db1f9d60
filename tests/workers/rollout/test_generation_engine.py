"""The engine's greedy tokens equal transformers' (generate() and a plain forward/argmax loop), for
left-padded prompts of different lengths, on the native decoder and the generic HF path."""

from __future__ import annotations

import pytest
import torch

from tests.workers.rollout.rollout_helpers import build_model, hf_greedy_loop, left_padded_prompts
from verl.workers.rollout.native import llama_decoder
from verl.workers.rollout.native.engine import GenerationEngine
from verl.workers.rollout.native.llama_decoder import repeats_in_blocks, unsupported_reason
from verl.workers.rollout.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False)
LENGTHS = [7, 3, 5, 1]


def _generate_greedy(engine, input_ids, attention_mask, new_tokens, **kw):
    return engine.generate(input_ids, attention_mask, new_tokens, GREEDY, pad_token_id=0, **kw)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_native_greedy_matches_hf_generate_and_forward_loop_with_left_padding(arch, request):
    model = request.getfixturevalue(f"{arch}_model")
    engine = GenerationEngine.from_model(model, device="cpu")
    assert engine.is_native
    input_ids, attention_mask = left_padded_prompts(LENGTHS)
    P, R = input_ids.shape[1], 12

    out = _generate_greedy(engine, input_ids, attention_mask, R)
    torch.testing.assert_close(out.responses, hf_greedy_loop(model, input_ids, attention_mask, R), rtol=0, atol=0)
    assert out.response_mask.all()

    # with EOS (id 2 in the model config): generate() pads finished rows with pad_token_id, as we do
    out = _generate_greedy(engine, input_ids, attention_mask, R, eos_token_id=2)
    hf = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=R, pad_token_id=0)
    hf = torch.nn.functional.pad(hf[:, P:], (0, R - (hf.shape[1] - P)), value=0)
    torch.testing.assert_close(out.responses, hf, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_native_float64_greedy_matches_hf_float64_generate_on_a_long_left_padded_batch(arch):
    """float64 with attention spans past 8 keys: torch's CPU SDPA read the float32 key bias as
    float64 there (garbage scores, every row's tokens wrong); the bias now follows float64."""
    model = build_model(arch).double()
    engine = GenerationEngine.from_model(model, device="cpu", dtype=torch.float64)
    assert engine.is_native
    input_ids, attention_mask = left_padded_prompts([40, 3, 27, 1, 33], seed=4, width=44)
    P, R = input_ids.shape[1], 10
    out = _generate_greedy(engine, input_ids, attention_mask, R, eos_token_id=2)
    with torch.no_grad():
        hf = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=R, pad_token_id=0)
    hf = torch.nn.functional.pad(hf[:, P:], (0, R - (hf.shape[1] - P)), value=0)
    wrong = (out.responses != hf).any(-1).nonzero().flatten().tolist()
    assert not wrong, f"rows {wrong}: engine {out.responses[wrong].tolist()} vs transformers {hf[wrong].tolist()}"
    assert engine.decoder.key_bias.dtype == torch.float64


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
def test_native_greedy_matches_hf_with_scaled_rope(rope):
    model = build_model("llama", rope_parameters={"rope_theta": 500.0, **rope})
    engine = GenerationEngine.from_model(model, device="cpu")
    assert engine.is_native
    input_ids, attention_mask = left_padded_prompts([9, 4], seed=1)
    out = _generate_greedy(engine, input_ids, attention_mask, 10)
    torch.testing.assert_close(out.responses, hf_greedy_loop(model, input_ids, attention_mask, 10), rtol=0, atol=0)


def test_generic_path_runs_any_causal_lm_and_matches_hf():
    model = build_model("gpt2")
    assert unsupported_reason(model.config) is not None
    engine = GenerationEngine.from_model(model, device="cpu")
    assert not engine.is_native
    input_ids, attention_mask = left_padded_prompts(LENGTHS, seed=2)
    out = _generate_greedy(engine, input_ids, attention_mask, 8)
    torch.testing.assert_close(out.responses, hf_greedy_loop(model, input_ids, attention_mask, 8), rtol=0, atol=0)


def test_generic_path_can_be_forced_for_a_supported_model(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu", allow_native=False)
    assert not engine.is_native
    input_ids, attention_mask = left_padded_prompts(LENGTHS)
    out = _generate_greedy(engine, input_ids, attention_mask, 6)
    torch.testing.assert_close(out.responses, hf_greedy_loop(qwen2_model, input_ids, attention_mask, 6), rtol=0, atol=0)


@pytest.mark.parametrize("allow_native", [True, False])
def test_rows_stop_at_eos_keep_it_and_pad_after(qwen2_model, allow_native):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu", allow_native=allow_native)
    input_ids, attention_mask = left_padded_prompts(LENGTHS)
    free = _generate_greedy(engine, input_ids, attention_mask, 10).responses
    # declare as EOS the token row 0 emits at step 3 (and never before): row 0 must stop right there
    eos = int(free[0, 3])
    assert eos not in free[0, :3].tolist()
    out = engine.generate(input_ids, attention_mask, 10, GREEDY, eos_token_id=[eos], pad_token_id=0)
    for row in range(len(LENGTHS)):
        hits = (free[row] == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else 10
        assert out.responses[row, :stop].tolist() == free[row, :stop].tolist()
        assert out.responses[row, stop:].eq(0).all()
        assert out.response_mask[row].tolist() == [1] * stop + [0] * (10 - stop)
    assert out.response_mask[0].sum() == 4


def test_generation_stops_early_when_every_row_finished(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    input_ids, attention_mask = left_padded_prompts([4])
    first = int(_generate_greedy(engine, input_ids, attention_mask, 1).responses[0, 0])
    calls = []
    decode = engine._decode
    engine._decode = lambda *a: calls.append(1) or decode(*a)
    out = engine.generate(input_ids, attention_mask, 50, GREEDY, eos_token_id=first, pad_token_id=0)
    assert out.responses.shape == (1, 50) and out.response_mask.sum() == 1
    assert calls == []  # the only row finished at the first token: no decode step ran


def test_logprobs_equal_log_softmax_of_scaled_logits_from_a_full_forward(qwen2_model):
    """Sampled tokens' log-probs equal log_softmax(logits / T) of a teacher-forced HF forward (without
    top-k/top-p; with them they are renormalised over the kept tokens: test_hf_rollout, test_rollout_sampling)."""
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    input_ids, attention_mask = left_padded_prompts(LENGTHS, seed=3)
    temperature = 0.7
    params = SamplingParams(do_sample=True, temperature=temperature)
    gen = torch.Generator().manual_seed(0)
    out = engine.generate(
        input_ids, attention_mask, 8, params, eos_token_id=2, pad_token_id=0, return_logprobs=True, generator=gen
    )
    seq = torch.cat([input_ids, out.responses], 1)
    mask = torch.cat([attention_mask, out.response_mask], 1)
    with torch.no_grad():
        logits = qwen2_model(seq, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.double()
    P = input_ids.shape[1]
    ref = (logits[:, P - 1 : -1] / temperature).log_softmax(-1).gather(-1, out.responses[..., None]).squeeze(-1)
    ref = ref * out.response_mask
    torch.testing.assert_close(out.logprobs.double(), ref, atol=1e-4, rtol=0)
    assert (out.logprobs[out.response_mask == 0] == 0).all()


def test_sampling_is_reproducible_with_a_generator_and_varies_without_one(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    input_ids, attention_mask = left_padded_prompts([5] * 8)
    params = SamplingParams(do_sample=True, temperature=1.5)
    a = engine.generate(input_ids, attention_mask, 8, params, generator=torch.Generator().manual_seed(7)).responses
    b = engine.generate(input_ids, attention_mask, 8, params, generator=torch.Generator().manual_seed(7)).responses
    c = engine.generate(input_ids, attention_mask, 8, params, generator=torch.Generator().manual_seed(8)).responses
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_cache_is_reused_across_batches_and_grows_when_needed(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    big_ids, big_mask = left_padded_prompts([6, 2, 4, 5])
    engine.generate(big_ids, big_mask, 8, GREEDY)
    k_cache = engine.decoder.k_cache
    small_ids, small_mask = left_padded_prompts([3, 2], seed=5)
    out = _generate_greedy(engine, small_ids, small_mask, 4)
    assert engine.decoder.k_cache is k_cache  # smaller batch: same buffers
    torch.testing.assert_close(out.responses, hf_greedy_loop(qwen2_model, small_ids, small_mask, 4), rtol=0, atol=0)
    long_ids, long_mask = left_padded_prompts([20], seed=6)
    out = _generate_greedy(engine, long_ids, long_mask, 12)
    assert engine.decoder.k_cache is not k_cache
    torch.testing.assert_close(out.responses, hf_greedy_loop(qwen2_model, long_ids, long_mask, 12), rtol=0, atol=0)


def test_unsupported_architectures_are_named():
    assert "sliding" in unsupported_reason(build_model("qwen2", use_sliding_window=True, max_window_layers=0).config)
    assert "rope_type" in unsupported_reason(
        build_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}).config
    )
    assert unsupported_reason(build_model("llama", mlp_bias=True).config) == "mlp_bias=True"


def test_native_greedy_matches_hf_for_llama_with_attention_biases():
    model = build_model("llama", attention_bias=True)
    engine = GenerationEngine.from_model(model, device="cpu")
    assert engine.is_native and engine.decoder.spec.o_bias
    input_ids, attention_mask = left_padded_prompts(LENGTHS, seed=4)
    out = _generate_greedy(engine, input_ids, attention_mask, 8)
    torch.testing.assert_close(out.responses, hf_greedy_loop(model, input_ids, attention_mask, 8), rtol=0, atol=0)


def _record_decode_batches(engine) -> list[int]:
    sizes = []
    decode = engine._decode
    engine._decode = lambda tokens, *a: sizes.append(tokens.shape[0]) or decode(tokens, *a)
    return sizes


@pytest.mark.parametrize("allow_native", [True, False])
def test_finished_rows_leave_the_batch_without_changing_any_row(qwen2_model, allow_native):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu", allow_native=allow_native)
    lengths = [7, 3, 5, 1, 6, 2, 4, 8]
    input_ids, attention_mask = left_padded_prompts(lengths, seed=4)
    R = 12
    free = engine.generate(input_ids, attention_mask, R, GREEDY, pad_token_id=0, return_logprobs=True)
    # EOS = the tokens rows 0..3 emit at steps 1..4: rows stop at different steps, some never
    eos = sorted({int(free.responses[row, row + 1]) for row in range(4)})
    sizes = _record_decode_batches(engine)
    out = engine.generate(input_ids, attention_mask, R, GREEDY, eos_token_id=eos, pad_token_id=0, return_logprobs=True)

    stops = []
    for row in range(len(lengths)):
        hits = torch.isin(free.responses[row], torch.tensor(eos)).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else R
        stops.append(stop)
        assert out.responses[row, :stop].tolist() == free.responses[row, :stop].tolist()
        assert out.responses[row, stop:].eq(0).all() and out.response_mask[row].sum() == stop
        torch.testing.assert_close(out.logprobs[row, :stop], free.logprobs[row, :stop], rtol=0, atol=1e-5)
        assert out.logprobs[row, stop:].eq(0).all()
    assert len(set(stops)) >= 4 and max(stops) == R  # rows finish at different steps, some never
    # the decode batch shrank as rows finished: never more rows than were still generating
    assert sizes[0] == len(lengths) and min(sizes) < len(lengths)
    for step, size in enumerate(sizes, start=1):
        assert sum(stop > step for stop in stops) <= size


@pytest.mark.parametrize("allow_native", [True, False])
def test_repeated_prompts_are_prefilled_once_and_generate_like_distinct_rows(qwen2_model, allow_native):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu", allow_native=allow_native)
    distinct_ids, distinct_mask = left_padded_prompts([6, 2, 4], seed=8)
    input_ids, attention_mask = distinct_ids.repeat_interleave(4, 0), distinct_mask.repeat_interleave(4, 0)
    prefill_rows = []
    prefill = engine.decoder.prefill
    engine.decoder.prefill = lambda ids, *a, **kw: prefill_rows.append(ids.shape[0]) or prefill(ids, *a, **kw)

    out = _generate_greedy(engine, input_ids, attention_mask, 8)
    assert prefill_rows == [3]
    expected = hf_greedy_loop(qwen2_model, distinct_ids, distinct_mask, 8).repeat_interleave(4, 0)
    torch.testing.assert_close(out.responses, expected, rtol=0, atol=0)

    # sampling: copies of a prompt draw their own tokens, each scored under the right context
    params = SamplingParams(do_sample=True, temperature=1.5)
    gen = torch.Generator().manual_seed(0)
    out = engine.generate(input_ids, attention_mask, 8, params, pad_token_id=0, return_logprobs=True, generator=gen)
    assert all(len({tuple(r) for r in out.responses[i : i + 4].tolist()}) > 1 for i in range(0, 12, 4))
    seq = torch.cat([input_ids, out.responses], 1)
    mask = torch.cat([attention_mask, out.response_mask], 1)
    with torch.no_grad():
        logits = qwen2_model(seq, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.double()
    P = input_ids.shape[1]
    ref = (logits[:, P - 1 : -1] / 1.5).log_softmax(-1).gather(-1, out.responses[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs.double(), ref, atol=1e-4, rtol=0)


def test_repeats_in_blocks_recognises_only_grpo_layouts():
    assert repeats_in_blocks(torch.tensor([0, 0, 0, 1, 1, 1]), 2) == 3
    assert repeats_in_blocks(torch.tensor([0, 1, 0, 1]), 2) is None  # repeated, not interleaved
    assert repeats_in_blocks(torch.tensor([1, 1, 0, 0]), 2) is None  # blocks out of order
    assert repeats_in_blocks(torch.tensor([0, 0, 1]), 2) is None  # unequal counts
    assert repeats_in_blocks(torch.tensor([0, 1]), 2) is None  # no repeats


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("prefill_tokens", [None, 14])
def test_block_fan_out_writes_the_cache_the_indexed_fan_out_writes(llama_model, prefill_tokens, device, monkeypatch):
    """GRPO's interleaved repeats take the broadcast fan-out (the engine numbers the distinct
    prompts by first appearance); cache, key bias and logits equal the indexed path's bit for bit,
    also when the prompts are prefilled in chunks of two."""
    engine = GenerationEngine.from_model(llama_model, device=device, dtype=torch.float32, prefill_tokens=prefill_tokens)
    # lengths chosen so that torch.unique's content order differs from the order of appearance
    distinct_ids, distinct_mask = left_padded_prompts([7, 3, 5, 6], seed=2)
    input_ids = distinct_ids.repeat_interleave(3, 0).to(device)
    attention_mask = distinct_mask.repeat_interleave(3, 0).to(device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    taken = []
    blocks = llama_decoder.repeats_in_blocks
    monkeypatch.setattr(llama_decoder, "repeats_in_blocks", lambda *a: taken.append(blocks(*a)) or taken[-1])
    d = engine.decoder

    def prefill():
        d.reserve(12, 12, 12)
        d.k_cache.fill_(float("nan"))
        d.v_cache.fill_(float("nan"))
        logits, _ = engine._prefill(input_ids, attention_mask, positions)
        return logits, d.k_cache[:, :, :, :7].clone(), d.v_cache[:, :, :, :7].clone(), d.key_bias[:, :7].clone()

    block = prefill()
    assert taken == [3], f"the interleaved batch should take the block fan-out, got {taken}"
    monkeypatch.setattr(llama_decoder, "repeats_in_blocks", lambda *a: None)
    indexed = prefill()
    for name, got, expected in zip(("logits", "keys", "values", "key bias"), block, indexed):
        assert torch.equal(got, expected), f"{name}: max difference {(got - expected).abs().max().item()}"
    assert not block[1].isnan().any(), "every cache row should have been written"


def test_compaction_waits_for_an_eighth_of_the_rows_or_a_smaller_cuda_graph_bucket(qwen2_model):
    eager = GenerationEngine.from_model(qwen2_model, device="cpu")
    assert not eager._worth_compacting(57, 64) and eager._worth_compacting(56, 64)
    # with CUDA graphs a step costs its batch bucket (a power of two, at most the cache's rows),
    # whatever the live rows
    graphed = GenerationEngine(eager.decoder, use_cuda_graph=True)
    graphed.decoder.reserve(128, 16, 16)
    assert not graphed._worth_compacting(33, 64) and graphed._worth_compacting(32, 64)
    assert not graphed._worth_compacting(40, 48)  # 40 and 48 both replay the 64-row graph
    graphed.decoder.release_cache()
    graphed.decoder.reserve(48, 16, 16)  # a 48-row cache: 48 live rows replay a 48-row graph
    assert graphed.graphs.graph_batch(48) == 48 and graphed.graphs.graph_batch(40) == 48
    assert not graphed._worth_compacting(40, 48) and graphed._worth_compacting(32, 48)
