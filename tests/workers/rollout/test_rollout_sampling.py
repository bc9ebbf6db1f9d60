"""Token selection: top-k/top-p follow transformers' warpers, sampling draws from the filtered
distribution, log-probs come from logits / temperature."""

from __future__ import annotations

import math

import pytest
import torch

from verl.workers.rollout.sampling import SamplingParams, filter_logits, select_tokens

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


def test_logprobs_are_log_softmax_of_tempered_unfiltered_logits():
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9)
    tokens, logprobs = select_tokens(logits, params, want_logprobs=True, generator=torch.Generator().manual_seed(2))
    ref = [math.log(torch.softmax(logits[i].double() / 0.5, -1)[t]) for i, t in enumerate(tokens.tolist())]
    torch.testing.assert_close(logprobs.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=0)


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
