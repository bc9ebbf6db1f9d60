"""Columns that are padding in every row are dropped before generation (`drop_leading_padding`):
the outputs equal those of the untrimmed batch (the same tokens; log-probs to fp32 rounding and to a float64 forward),
and the KV cache holds only the attended columns."""

from __future__ import annotations

import copy

import pytest
import torch

import verl.workers.rollout.native.engine as engine_module
from tests.workers.rollout.rollout_helpers import left_padded_prompts
from verl.workers.rollout.native.engine import GenerationEngine, drop_leading_padding
from verl.workers.rollout.sampling import SamplingParams


def test_drop_leading_padding_keeps_from_the_first_attended_column():
    input_ids, attention_mask = left_padded_prompts([3, 5, 2], width=9)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = drop_leading_padding(input_ids, attention_mask, positions)
    assert ids.shape == (3, 5)  # the longest prompt, 5 tokens, starts at column 4
    assert torch.equal(ids, input_ids[:, 4:]) and torch.equal(mask, attention_mask[:, 4:])
    assert torch.equal(pos, positions[:, 4:])
    # nothing to drop: a row attends to column 0, or no row attends to anything
    full = torch.ones(2, 4, dtype=torch.long)
    assert drop_leading_padding(full, full, full)[0] is full
    empty = torch.zeros(2, 4, dtype=torch.long)
    assert drop_leading_padding(empty, empty, empty)[0] is empty


@pytest.mark.parametrize("allow_native", [True, False])
def test_generation_equals_the_untrimmed_batch(qwen2_model, allow_native, monkeypatch):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu", allow_native=allow_native)
    # 3 distinct prompts of at most 6 tokens, each 4 times, left-padded to 20 columns (14 all-padding)
    ids, mask = left_padded_prompts([6, 2, 4], seed=5, width=20)
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    params = SamplingParams(do_sample=True, temperature=1.2)

    def run():
        gen = torch.Generator().manual_seed(3)
        return engine.generate(ids, mask, 10, params, eos_token_id=2, return_logprobs=True, generator=gen)

    trimmed = run()
    if allow_native:
        assert engine.decoder.cache_capacity()[1] == 6 + 10, "the cache should hold only the attended columns"
    monkeypatch.setattr(engine_module, "drop_leading_padding", lambda *t: t)
    engine.sleep(level=1)  # a fresh cache for the untrimmed width
    engine.wake_up()
    untrimmed = run()
    assert torch.equal(trimmed.responses, untrimmed.responses)
    assert torch.equal(trimmed.response_mask, untrimmed.response_mask)
    # fp32 rounding only (the kernels' blocking follows the width), against a float64 reference
    torch.testing.assert_close(trimmed.logprobs, untrimmed.logprobs, rtol=0, atol=1e-5)
    seq = torch.cat([ids, trimmed.responses], 1)
    full_mask = torch.cat([mask, trimmed.response_mask], 1)
    with torch.no_grad():
        model64 = copy.deepcopy(qwen2_model).double()
        logits = model64(seq, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
    ref = (logits[:, 19:-1] / 1.2).log_softmax(-1).gather(-1, trimmed.responses[..., None]).squeeze(-1)
    torch.testing.assert_close(trimmed.logprobs.double(), ref * trimmed.response_mask, rtol=0, atol=2e-5)


def test_without_cuda_graphs_no_cache_cell_is_read_before_it_is_written(qwen2_model):
    """The CPU cache is allocated uninitialised: poisoning every cell with NaN before generating
    changes nothing, so every cell read was written first (prefill, decode steps, row compaction)."""
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    assert not engine.decoder.cuda_graphs
    ids, mask = left_padded_prompts([7, 3, 5, 1, 6, 2, 4, 4], seed=2)
    params = SamplingParams(do_sample=True, temperature=1.0)

    def run():
        gen = torch.Generator().manual_seed(0)
        return engine.generate(ids, mask, 12, params, eos_token_id=2, return_logprobs=True, generator=gen)

    expected = run()
    assert not expected.response_mask.all() and expected.response_mask[:, 0].all(), "some rows should stop early"
    engine.decoder.k_cache.fill_(float("nan"))  # same shape next call: the cache is reused, not reallocated
    engine.decoder.v_cache.fill_(float("nan"))
    poisoned = run()
    assert torch.equal(poisoned.responses, expected.responses)
    assert torch.equal(poisoned.logprobs, expected.logprobs)


def test_rotary_table_without_cuda_graphs_covers_the_positions_asked_for(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    decoder = engine.decoder
    ids, mask = left_padded_prompts([5, 3], seed=1)
    engine.generate(ids, mask, 4)
    small = decoder._cos.shape[0]
    assert 5 + 4 <= small < 64, f"the table should cover the ~10 positions used, not {small}"
    cos, sin = decoder._cos.clone(), decoder._sin.clone()
    decoder._build_rope_table(4096)  # what CUDA graphs start from: the same values for those positions
    torch.testing.assert_close(decoder._cos[:small], cos)
    torch.testing.assert_close(decoder._sin[:small], sin)


@pytest.mark.gpu
def test_cuda_graph_generation_with_dropped_padding_equals_transformers_and_keeps_the_graph_buffers():
    """On CUDA with graphs: greedy tokens of a batch with 24 all-padding columns equal transformers'
    (which sees the full width), and the graph path keeps its 4096-row rotary table (each rebuild
    would recapture the graphs)."""
    from tests.workers.rollout.rollout_helpers import build_model, hf_greedy_loop
    from verl.utils.device import get_device

    model = build_model("qwen2").to(get_device(), torch.float32)
    device = next(model.parameters()).device
    engine = GenerationEngine.from_model(model, device=device, dtype=torch.float32)
    assert engine.graphs is not None and engine.decoder.cuda_graphs, "CUDA graphs should be on for this test"
    ids, mask = (t.to(device) for t in left_padded_prompts([6, 2, 4, 5, 1], seed=4, width=30))
    widths = []
    prefill = engine.decoder.prefill
    engine.decoder.prefill = lambda p_ids, *a, **kw: widths.append(p_ids.shape[1]) or prefill(p_ids, *a, **kw)
    out = engine.generate(ids, mask, 8, SamplingParams(do_sample=False), pad_token_id=0)
    expected = hf_greedy_loop(model, ids, mask, 8)
    mismatch = (out.responses != expected).any(-1).nonzero().flatten().tolist()
    assert not mismatch, (
        f"rows {mismatch}: engine {out.responses[mismatch].tolist()} vs HF {expected[mismatch].tolist()}"
    )
    assert widths == [6], f"prefill widths {widths}: the 24 all-padding columns should be dropped"
    assert engine.decoder._cos.shape[0] >= 4096, f"rotary table {engine.decoder._cos.shape[0]} rows under graphs"
