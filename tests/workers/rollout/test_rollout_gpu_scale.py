"""The built-in engine on a GPU at Qwen2.5-0.5B's shape (random bf16 weights, 152k vocabulary): the
checks of the GPU review that only a real device can make, each a few seconds on an H100.

- prefill of 64 distinct 1024-token prompts stays within a stated working memory and its logits
  match transformers' sdpa (#2);
- the KV cache honours `gpu_memory_utilization`: a batch that does not fit runs in chunks and the
  engine's reserved memory stays under util x total (#3);
- greedy decoding with graphs, eager and transformers agree: token match rate, divergences only at
  near ties of an fp32 reference, log-probs no further from fp32 than transformers' bf16 (#8);
- generate -> sleep -> wake cycles free the engine's memory, restore identical greedy outputs and
  count the graph recaptures (#10); a long response keeps reserved memory flat (#11);
- sampling costs under 20% of a decode step at batch 256 (#12).

Every failure message prints the measured numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.workers.rollout.rollout_helpers import hf_greedy_loop
from verl.utils.device import get_device
from verl.workers.rollout.native.engine import GenerationEngine
from verl.workers.rollout.sampling import SamplingParams, select_tokens

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(do_sample=False)
GIB, MIB = 2**30, 2**20


@pytest.fixture(scope="module")
def model_05b():
    from transformers import AutoModelForCausalLM

    from verl.models.factory import build_config

    config = build_config("qwen2.5-0.5b-shape")
    torch.manual_seed(0)
    with get_device():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    yield model
    del model
    torch.cuda.empty_cache()


def _prompts(model, batch: int, length: int, seed: int, min_length: int | None = None):
    """Random distinct prompts, left-padded: row i has a length between min_length and length."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    input_ids = torch.randint(4, model.config.vocab_size, (batch, length), device=device, generator=gen)
    attention_mask = torch.ones_like(input_ids)
    if min_length is not None:
        lengths = torch.linspace(min_length, length, batch, device=device).long()
        attention_mask = (torch.arange(length, device=device) >= length - lengths[:, None]).long()
        input_ids = input_ids * attention_mask
    return input_ids, attention_mask


def _positions(attention_mask):
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _engine(model, **kw):
    return GenerationEngine.from_model(model, device=next(model.parameters()).device, dtype=torch.bfloat16, **kw)


def _free(*engines):
    for engine in engines:
        engine.sleep()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_prefill_of_64_distinct_1024_token_prompts_is_bounded_and_matches_transformers(model_05b):
    input_ids, attention_mask = _prompts(model_05b, 64, 1024, seed=1, min_length=512)
    positions = _positions(attention_mask)
    engine = _engine(model_05b)
    decoder = engine.decoder
    decoder.reserve(64, 1024 + 8, 1024 + 8)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logits = decoder.prefill(input_ids, attention_mask, positions)
    torch.cuda.synchronize()
    workspace = torch.cuda.max_memory_allocated() - before
    # the math-kernel fallback materialised fp32 [rows, 14, 1024, 1024] scores: 3.7 GB per layer here
    assert workspace < 2 * GIB, f"prefill working memory {workspace / GIB:.2f} GiB (limit 2 GiB)"
    with torch.no_grad():
        ref = model_05b(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, logits_to_keep=1
        ).logits[:, -1]
    ours_lp, ref_lp = logits.float().log_softmax(-1), ref.float().log_softmax(-1)
    diff = (ours_lp - ref_lp).abs()
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(
        f"prefill 64x1024: working memory {workspace / GIB:.2f} GiB, |log-softmax diff| mean {diff.mean():.4f} "
        f"max {diff.max():.3f}, argmax agreement {agree:.3f}"
    )
    assert diff.mean() < 0.05 and agree >= 0.75, (diff.mean().item(), diff.max().item(), agree)
    _free(engine)


def test_kv_cache_budget_is_honoured_on_the_device(model_05b):
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    total = torch.cuda.mem_get_info()[1]
    weights = sum(p.numel() * p.element_size() for p in model_05b.parameters())
    utilization = (weights + 2 * GIB) / total  # ~2 GiB beyond the weights for KV cache and work
    engine = _engine(model_05b, gpu_memory_utilization=utilization)
    input_ids, attention_mask = _prompts(model_05b, 512, 256, seed=2, min_length=200)
    fit = engine.max_cache_rows(engine._cache_len(256, 32), 256, 512)
    torch.cuda.reset_peak_memory_stats()
    out = engine.generate(input_ids, attention_mask, 32, GREEDY, pad_token_id=0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved() - baseline
    rows = engine.decoder.cache_capacity()[0]
    print(
        f"util {utilization:.4f} x {total / GIB:.1f} GiB = {utilization * total / GIB:.2f} GiB; budget rows {fit}, "
        f"cache rows {rows} for a batch of 512; engine peak reserved {peak / GIB:.2f} GiB"
    )
    assert out.responses.shape == (512, 32) and out.response_mask.all()
    assert 32 <= rows < 512, f"the 512 rows should run in chunks; the cache holds {rows} rows (budget {fit})"
    assert peak <= utilization * total, f"reserved {peak / GIB:.2f} GiB > {utilization * total / GIB:.2f} GiB"
    _free(engine)


def _first_divergence_gaps(a, b, ref_logits):
    """For each row where token sequences a and b [B, R] differ, the fp32 reference's logit gap
    between the two tokens at the first difference (same context up to there)."""
    gaps = []
    for row in range(a.shape[0]):
        diff = (a[row] != b[row]).nonzero()
        if len(diff):
            k = int(diff[0])
            gaps.append(abs(float(ref_logits[row, k, a[row, k]] - ref_logits[row, k, b[row, k]])))
    return gaps


def test_greedy_decode_with_graphs_eager_and_transformers_agree(model_05b):
    B, P, R = 16, 64, 32
    input_ids, attention_mask = _prompts(model_05b, B, P, seed=3, min_length=40)
    graphed = _engine(model_05b)
    eager = _engine(model_05b, use_cuda_graph=False)
    assert graphed.graphs is not None and eager.graphs is None
    a = graphed.generate(input_ids, attention_mask, R, GREEDY, return_logprobs=True)
    b = eager.generate(input_ids, attention_mask, R, GREEDY, return_logprobs=True)
    hf = hf_greedy_loop(model_05b, input_ids, attention_mask, R)

    # fp32 and bf16 transformers, teacher-forced on the graphed tokens
    seq = torch.cat([input_ids, a.responses], 1)
    mask = torch.cat([attention_mask, torch.ones_like(a.responses)], 1)
    with torch.no_grad():
        ref = copy.deepcopy(model_05b).float()(seq, attention_mask=mask, position_ids=_positions(mask)).logits
        ref = ref[:, P - 1 : -1].float()
        bf16 = model_05b(seq, attention_mask=mask, position_ids=_positions(mask)).logits[:, P - 1 : -1].float()
    ref_lp = ref.log_softmax(-1).gather(-1, a.responses[..., None]).squeeze(-1)
    bf16_lp = bf16.log_softmax(-1).gather(-1, a.responses[..., None]).squeeze(-1)
    ours_err = (a.logprobs - ref_lp).abs().mean().item()
    hf_err = (bf16_lp - ref_lp).abs().mean().item()
    match_eager = (a.responses == b.responses).float().mean().item()
    match_hf = (a.responses == hf).float().mean().item()
    gaps = _first_divergence_gaps(a.responses, b.responses, ref) + _first_divergence_gaps(a.responses, hf, ref)
    print(
        f"token match graphs/eager {match_eager:.3f}, graphs/transformers {match_hf:.3f}; fp32 logit gaps at "
        f"divergences {[round(g, 3) for g in gaps]}; |log-prob - fp32| ours {ours_err:.4f}, transformers bf16 "
        f"{hf_err:.4f}; fp32 scores from bmm(out_dtype) (no fp32 copy of the keys): {graphed.decoder._bmm_out_dtype}"
    )
    # With random weights the logits are nearly flat, so near ties are everywhere and one row's tokens
    # all differ after its first tie: the H100 run of 2026-11-26 matched transformers on 48% of the
    # tokens, with every divergence at an fp32 gap below 0.035 and our log-prob error equal to
    # transformers' own bf16 error (0.0084 both). So the rate against transformers is reported, not
    # bounded; what is bounded is where rows may diverge (near ties only) and how far off the
    # log-probs are. Graphs against eager run the same kernels on the same shapes but the bucketed
    # KV window: they must agree almost everywhere.
    assert match_eager >= 0.8, (match_eager, match_hf)
    assert all(g < 0.15 for g in gaps), f"a divergence at a token the fp32 reference does not consider tied: {gaps}"
    assert ours_err <= 1.5 * hf_err + 0.005, (ours_err, hf_err)
    _free(graphed, eager)


def test_sleep_wake_cycles_free_memory_restore_outputs_and_count_recaptures(model_05b):
    input_ids, attention_mask = _prompts(model_05b, 64, 128, seed=4, min_length=64)
    engine = _engine(model_05b)
    first, captures = None, []
    for cycle in range(3):
        before = engine.graph_stats()
        out = engine.generate(input_ids, attention_mask, 48, GREEDY, pad_token_id=0)
        after = engine.graph_stats()
        captures.append((after["captures"] - before["captures"], after["capture_s"] - before["capture_s"]))
        if first is None:
            first = out.responses
        assert torch.equal(out.responses, first), f"cycle {cycle}: greedy outputs changed after sleep/wake"
        torch.cuda.synchronize()
        held = sum(engine.memory_bytes().values())
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        engine.sleep()
        freed = allocated - torch.cuda.memory_allocated()
        released = reserved - torch.cuda.memory_reserved()
        print(
            f"cycle {cycle}: engine held {held / GIB:.2f} GiB, sleep freed {freed / GIB:.2f} GiB allocated and "
            f"{released / GIB:.2f} GiB reserved; {captures[-1][0]} graph captures in {captures[-1][1]:.3f} s"
        )
        assert freed >= 0.9 * held and released >= 0.9 * held, (held, freed, released)
        engine.wake_up()
        engine.update_weights(model_05b.named_parameters())
    assert all(n > 0 and s > 0 for n, s in captures), f"every generation after a sleep recaptures: {captures}"
    _free(engine)


def test_reserved_memory_stays_flat_over_a_long_response(model_05b):
    """1024 new tokens cross 9 KV-length buckets: 9 graphs at batch 256. Each used to keep its own
    [256, 152k] bf16 logits (78 MB) alive in the graph pool; now they share one output buffer."""
    input_ids, attention_mask = _prompts(model_05b, 256, 64, seed=5)
    engine = _engine(model_05b)
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    engine.generate(input_ids, attention_mask, 1024, SamplingParams(temperature=1.0), pad_token_id=0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # drops the prefill's cached blocks; the graph pool stays (graphs hold it)
    held = sum(engine.memory_bytes().values())
    extra = torch.cuda.memory_reserved() - baseline - held
    print(
        f"{engine.graphs.num_graphs()} graphs; engine buffers {held / GIB:.2f} GiB, reserved beyond them "
        f"{extra / MIB:.0f} MiB (one logits tensor per graph would be {engine.graphs.num_graphs() * 78} MB)"
    )
    assert engine.graphs.num_graphs() >= 9
    assert extra < 300 * MIB, f"{extra / MIB:.0f} MiB reserved beyond the engine's buffers"
    _free(engine)


def test_sampling_is_under_a_fifth_of_a_decode_step_at_batch_256(model_05b):
    B, P = 256, 256
    input_ids, attention_mask = _prompts(model_05b, B, P, seed=6)
    engine = _engine(model_05b)
    engine.generate(input_ids, attention_mask, 8, GREEDY, pad_token_id=0)  # cache, graphs, kernels ready
    device = engine.device
    tokens = torch.randint(4, 1000, (B,), device=device)
    positions = torch.full((B,), P + 6, device=device)
    params = SamplingParams(temperature=1.0)
    logits = engine._decode(tokens, positions, P + 6)
    select_tokens(logits, params, True)

    def timed(fn, repeats=50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats

    # what sampling adds to a step of the decode loop (its host work overlaps the replay, as there),
    # and the sampler alone back to back for reference
    decode_ms = timed(lambda: engine._decode(tokens, positions, P + 6))
    step_ms = timed(lambda: select_tokens(engine._decode(tokens, positions, P + 6), params, True))
    alone_ms = timed(lambda: select_tokens(logits, params, True))
    share = (step_ms - decode_ms) / step_ms
    print(
        f"batch {B}, context {P + 7}: decode step {decode_ms:.3f} ms, with sampling (temperature 1, log-probs) "
        f"{step_ms:.3f} ms: sampling {100 * share:.1f}% of the step ({alone_ms:.3f} ms back to back)"
    )
    assert share < 0.2, f"sampling adds {step_ms - decode_ms:.3f} ms = {100 * share:.1f}% of a {step_ms:.3f} ms step"
    _free(engine)
