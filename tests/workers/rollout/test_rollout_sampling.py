"""Token selection: top-k/top-p follow transformers' warpers, sampling draws from the filtered
distribution (down to tokens far below 1e-8), the returned log-probs follow rollout.logprobs_mode
(vLLM's meanings), and the fused CUDA kernel does the same."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from verl.utils.device import get_device
from verl.workers.rollout.sampling import (
    SamplingParams,
    filter_logits,
    filter_threshold,
    sample_from_cdf,
    select_tokens,
)

NEG_INF = float("-inf")


def test_top_k_keeps_the_k_largest_and_ties_with_the_kth():
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0, 4.0], [1.0, 2.0, 2.0, 0.0, 2.0]])
    out = filter_logits(logits, top_k=2, top_p=1.0)
    assert out[0].tolist() == [NEG_INF, NEG_INF, NEG_INF, 5.0, 4.0]
    assert out[1].tolist() == [NEG_INF, 2.0, 2.0, NEG_INF, 2.0]


def test_top_p_keeps_the_smallest_nucleus_and_always_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(filter_logits(logits, top_k=-1, top_p=p))[0].tolist()  # noqa: E731
    assert kept(0.6) == [True, True, False, False]  # 0.5 < 0.6 needs the 0.3 too
    assert kept(0.9) == [True, True, True, False]
    assert kept(1e-6) == [True, False, False, False]


def test_filtering_matches_transformers_warpers_on_random_logits():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = filter_logits(logits, top_k=10, top_p=0.7)
    theirs = TopPLogitsWarper(0.7)(None, TopKLogitsWarper(10)(None, logits))
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


def test_samples_follow_the_tempered_filtered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature, top_k = 0.8, 3
    expected = torch.zeros(5)
    expected[:3] = (logits[:3] / temperature).softmax(-1)
    n = 100_000
    tokens, _ = select_tokens(
        logits.expand(n, 5),
        SamplingParams(temperature=temperature, top_k=top_k),
        generator=torch.Generator().manual_seed(0),
    )
    freq = torch.bincount(tokens, minlength=5).double() / n
    sigma = (expected * (1 - expected) / n).sqrt().double()
    assert freq[3:].sum() == 0
    assert ((freq - expected.double()).abs() <= 5 * sigma + 1e-12).all(), (freq, expected)


def test_logprobs_without_filters_are_log_softmax_of_tempered_logits():
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.5)
    tokens, logprobs = select_tokens(logits, params, want_logprobs=True, generator=torch.Generator().manual_seed(2))
    ref = [math.log(torch.softmax(logits[i].double() / 0.5, -1)[t]) for i, t in enumerate(tokens.tolist())]
    torch.testing.assert_close(logprobs.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=0)


def test_logprobs_with_filters_are_renormalised_over_the_kept_tokens():
    # vLLM's processed_logprobs: log_softmax of the tempered logits with the filtered tokens at -inf
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9)
    tokens, logprobs = select_tokens(logits, params, want_logprobs=True, generator=torch.Generator().manual_seed(2))
    for row, token in enumerate(tokens.tolist()):
        scaled = logits[row].double() / 0.5
        kept = [v for v in sorted(scaled.tolist(), reverse=True)[:4]]
        probs = [math.exp(v - kept[0]) for v in kept]
        kept = kept[: next(i + 1 for i in range(4) if sum(probs[: i + 1]) / sum(probs) >= 0.9)]
        ref = scaled[token].item() - math.log(sum(math.exp(v) for v in kept))
        assert abs(logprobs[row].item() - ref) < 1e-5, (row, logprobs[row].item(), ref)


# Hand-worked: logits (2, 1, 0, -1), temperature 0.5, top_k 2. Only tokens 0 and 1 can be drawn.
# raw_logits: 2, 1; raw_logprobs: x - log(e^2 + e + 1 + 1/e); processed_logits: x / 0.5 = 4, 2;
# processed_logprobs: over the two kept tokens, 4 - log(e^4 + e^2) = -log(1 + e^-2), 2 - log(e^4 + e^2).
_RAW_NORM = math.log(math.e**2 + math.e + 1 + 1 / math.e)
_HAND_WORKED = {
    "raw_logits": (2.0, 1.0),
    "raw_logprobs": (2.0 - _RAW_NORM, 1.0 - _RAW_NORM),
    "processed_logits": (4.0, 2.0),
    "processed_logprobs": (-math.log(1 + math.exp(-2)), -math.log(1 + math.exp(2))),
}


@pytest.mark.parametrize("mode", sorted(_HAND_WORKED))
def test_logprobs_mode_returns_vllms_value_on_a_hand_worked_example(mode):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(64, 4)
    params = SamplingParams(temperature=0.5, top_k=2, logprobs_mode=mode)
    tokens, values = select_tokens(logits, params, want_logprobs=True, generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}  # both drawn (p = 0.88 / 0.12), so both values are checked
    expected = torch.tensor(_HAND_WORKED[mode], dtype=torch.float64)[tokens]
    torch.testing.assert_close(values.double(), expected, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(_HAND_WORKED))
def test_logprobs_mode_on_the_fused_cuda_path_returns_the_same_hand_worked_values(mode):
    device = get_device()
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0], device=device).expand(64, 4)
    params = SamplingParams(temperature=0.5, top_k=2, logprobs_mode=mode)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens, values = select_tokens(logits, params, want_logprobs=True, generator=gen)
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.tensor(_HAND_WORKED[mode], dtype=torch.float64)[tokens.cpu()]
    torch.testing.assert_close(values.cpu().double(), expected, atol=1e-6, rtol=0)


def test_raw_and_processed_agree_when_greedy():
    # greedy decoding applies neither temperature nor filters (vLLM's all-greedy path)
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(4))
    greedy = dict(do_sample=False, temperature=0.0, top_k=3)
    raw = select_tokens(logits, SamplingParams(**greedy, logprobs_mode="raw_logits"), want_logprobs=True)[1]
    processed = select_tokens(logits, SamplingParams(**greedy, logprobs_mode="processed_logits"), want_logprobs=True)[1]
    torch.testing.assert_close(raw, logits.max(-1).values)
    torch.testing.assert_close(processed, raw)


def test_unknown_logprobs_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode='logits' is not one of processed_logprobs"):
        SamplingParams(logprobs_mode="logits")


def test_greedy_is_argmax_with_untempered_logprobs():
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(3))
    tokens, logprobs = select_tokens(logits, SamplingParams(do_sample=False, temperature=0.0), want_logprobs=True)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).max(-1).values)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.0}, "temperature > 0"),
        ({"top_p": 0.0}, r"top_p=0.0 must lie in \(0, 1\]"),
        ({"top_k": -5}, "top_k=-5"),
    ],
)
def test_invalid_sampling_parameters_are_explained(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.slow  # 1.3e9 token probabilities to sample through: 15-50 s on 2 cores
def test_tail_of_tokens_below_1e8_is_drawn_at_its_rate():
    """A head token plus 2^17 tokens of probability 9.5e-9 each (tail mass 1.25e-3) placed after it:
    the tail is drawn at its rate (within 3 sigma of a binomial count). An inverse-CDF sampler over an
    fp32 cumsum never draws it: past the head the running sum is ~0.9988 and each 9.5e-9 is below
    half an ulp, so the CDF never moves."""
    num_tail, p_tail = 2**17, 9.5e-9
    logits = torch.full((num_tail + 1,), math.log(p_tail))
    logits[0] = math.log(1 - num_tail * p_tail)
    tail = logits.double().softmax(-1)[1:].sum().item()  # of the fp32 logits the sampler sees
    assert logits.double().softmax(-1)[1:].max() < 1e-8
    n = 9600  # ~12 expected tail draws: enough that 0 lies outside the 3-sigma band
    gen = torch.Generator().manual_seed(0)
    hits = 0
    for lo in range(0, n, 320):
        tokens, _ = select_tokens(logits.expand(min(320, n - lo), -1), SamplingParams(), generator=gen)
        hits += int((tokens > 0).sum())
    expected, sigma = n * tail, math.sqrt(n * tail * (1 - tail))
    assert abs(hits - expected) <= 3 * sigma, f"tail drawn {hits} times, expected {expected:.1f} +- {3 * sigma:.1f}"


def test_eager_sampler_matches_the_distribution_and_never_draws_a_removed_token():
    logits = torch.randn(700, generator=torch.Generator().manual_seed(4)) * 2
    threshold = torch.tensor([logits.sort().values[200].item()])  # removes the 200 least likely tokens
    expected = logits.masked_fill(logits < threshold, float("-inf")).double().softmax(-1)
    n = 60_000
    tokens = sample_from_cdf(logits.expand(n, -1), threshold.expand(n), torch.Generator().manual_seed(5))
    freq = torch.bincount(tokens, minlength=700).double() / n
    assert freq[expected == 0].sum() == 0
    top = expected.topk(20).indices
    sigma = (expected[top] * (1 - expected[top]) / n).sqrt()
    assert ((freq[top] - expected[top]).abs() <= 4 * sigma + 1e-12).all()
    # the mass of the 480 least likely survivors, each tiny, as a whole
    rest = expected > 0
    rest[top] = False
    p = expected[rest].sum().item()
    assert abs(freq[rest].sum().item() - p) <= 4 * math.sqrt(p * (1 - p) / n)


def test_a_seeded_generator_reproduces_the_tokens():
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(6))
    params = SamplingParams(temperature=0.9, top_p=0.95)
    draw = lambda seed: select_tokens(logits, params, generator=torch.Generator().manual_seed(seed))[0]  # noqa: E731
    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_threshold_filtering_equals_masking_every_token_below_it():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(9)) * 2
    for top_k, top_p in ((5, 1.0), (-1, 0.8), (10, 0.5), (-1, 1.0)):
        threshold = filter_threshold(logits, top_k, top_p)
        filtered = filter_logits(logits, top_k, top_p)
        if threshold is None:
            assert top_k <= 0 and top_p == 1.0 and torch.equal(filtered, logits)
            continue
        assert torch.equal(torch.isfinite(filtered), logits >= threshold[:, None])
        if top_k <= 0:  # top-p alone: the removed low tail has mass <= 1 - top_p, one more token would exceed it
            probs = logits.double().softmax(-1)
            kept = torch.isfinite(filtered)
            removed_mass = probs.masked_fill(kept, 0).sum(-1)
            smallest_kept = probs.masked_fill(~kept, 2.0).min(-1).values
            largest_removed = probs.masked_fill(kept, -1.0).max(-1).values
            assert (removed_mass <= 1 - top_p + 1e-6).all()
            assert (removed_mass + smallest_kept > 1 - top_p).all()
            assert (largest_removed <= smallest_kept).all()


# ---------------------------------------------------------------------------------- fused kernel
# The CUDA sampler is one Triton kernel. These tests run it on a GPU, or on CPU tensors under
# Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported, e.g.
# `TRITON_INTERPRET=1 pytest tests/workers/rollout/test_rollout_sampling.py -k fused`); they skip
# where neither is available (the CPU CI has no triton).


def _fused_device():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (a CUDA build of torch ships it)")
    if torch.cuda.is_available():
        return get_device()
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU: run with TRITON_INTERPRET=1 to test the kernel's arithmetic on CPU")
    return torch.device("cpu")


def test_fused_greedy_is_the_first_argmax_with_exact_logprobs():
    device = _fused_device()
    from verl.workers.rollout.fused_sampling import fused_select

    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(10)) * 4
    logits[1, 7] = logits[1, 2999] = logits[1].max() + 1  # a tie: the first index wins, as torch.argmax
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(device, dtype)
        tokens, logprobs = fused_select(x, 1.0, False, None, True)
        assert torch.equal(tokens.cpu(), x.float().argmax(-1).cpu()) and tokens[1].item() == 7
        ref = x.double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs.double(), ref, atol=2e-6, rtol=0)


def test_fused_race_follows_the_tempered_filtered_distribution_with_exact_logprobs():
    device = _fused_device()
    from verl.workers.rollout.fused_sampling import fused_select

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -2.0, 0.2, 1.5, -0.5])
    temperature, top_k = 0.7, 4
    scaled = logits * (1.0 / temperature)  # how the kernel tempers (and `select_tokens` thresholds)
    threshold = filter_threshold(scaled[None], top_k, 1.0)
    expected = scaled.masked_fill(scaled < threshold, float("-inf")).softmax(-1)
    assert (expected > 0).sum() == top_k
    n = 1500 if device.type == "cpu" else 400_000  # the interpreter runs one row at a time
    gen = torch.Generator(device=device).manual_seed(11)
    tokens, logprobs = fused_select(
        logits.to(device).expand(n, -1), temperature, True, threshold.to(device).expand(n), True, gen
    )
    freq = torch.bincount(tokens.cpu(), minlength=10).double() / n
    sigma = (expected.double() * (1 - expected.double()) / n).sqrt()
    assert freq[expected == 0].sum() == 0
    assert ((freq - expected.double()).abs() <= 4 * sigma + 1e-12).all(), (freq, expected)
    ref = (logits.double() / temperature).log_softmax(-1)[tokens.cpu()]
    torch.testing.assert_close(logprobs.cpu().double(), ref, atol=2e-6, rtol=0)
    # the seed comes from the generator: the same seed draws the same tokens
    again, _ = fused_select(
        logits.to(device).expand(n, -1),
        temperature,
        True,
        threshold.to(device).expand(n),
        False,
        torch.Generator(device=device).manual_seed(11),
    )
    assert torch.equal(again, tokens)


@pytest.mark.gpu
def test_fused_race_draws_a_152k_vocabulary_tail_of_tokens_below_1e8_at_its_rate():
    """The GPU review's check: a 152k vocabulary whose 1e-3 tail mass is made of tokens below 1e-8,
    drawn 400k times through `select_tokens` (the fused kernel on CUDA)."""
    device = get_device()
    vocab = 151936
    logits = torch.full((vocab,), math.log(1e-3 / (vocab - 1)), device=device)
    logits[0] = math.log(1 - 1e-3)
    probs = logits.double().softmax(-1)
    tail = probs[1:].sum().item()
    assert probs[1:].max() < 1e-8
    gen = torch.Generator(device=device).manual_seed(12)
    n, chunk, hits = 400_000, 50_000, 0
    for _ in range(n // chunk):
        tokens, _ = select_tokens(logits.expand(chunk, -1), SamplingParams(), generator=gen)
        hits += int((tokens > 0).sum())
    expected, sigma = n * tail, math.sqrt(n * tail * (1 - tail))
    print(f"tail drawn {hits} times of {n}, expected {expected:.1f} +- {sigma:.1f}")
    assert abs(hits - expected) <= 3 * sigma, f"tail drawn {hits} times, expected {expected:.1f} +- {3 * sigma:.1f}"
