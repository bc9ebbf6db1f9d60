"""Masked statistics (padding ignored exactly) and chunked log-prob / entropy against float64
references computed another way (numpy, Python loops, plain autograd)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from verl.utils.device import get_device_name
from verl.utils.torch_functional import (
    entropy_from_logits,
    entropy_from_logits_with_chunking,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)


def padded(seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[0, 4:] = 0
    mask[2, :] = 0
    mask[3, 1] = 0
    values[mask == 0] = float("nan")  # padding must never leak, even as NaN
    valid = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    return values, mask, valid


def test_masked_sum_and_mean_ignore_padding_exactly():
    values, mask, valid = padded()
    assert masked_sum(values, mask).item() == pytest.approx(sum(valid), rel=1e-12)
    assert masked_mean(values, mask).item() == pytest.approx(statistics.mean(valid), rel=1e-12)


def test_masked_mean_per_row_is_zero_for_an_empty_row():
    values, mask, _ = padded()
    per_row = masked_mean(values, mask, axis=-1)
    for i in range(4):
        vals = [v for v, m in zip(values[i].tolist(), mask[i].tolist()) if m]
        assert per_row[i].item() == pytest.approx(statistics.mean(vals) if vals else 0.0, rel=1e-12)


def test_masked_mean_accepts_bool_masks_and_an_empty_mask_gives_zero():
    values, mask, valid = padded()
    assert masked_mean(values, mask.bool()).item() == pytest.approx(statistics.mean(valid), rel=1e-12)
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_matches_statistics_and_is_zero_below_two_elements():
    values, mask, valid = padded()
    assert masked_var(values, mask).item() == pytest.approx(statistics.variance(valid), rel=1e-12)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(statistics.pvariance(valid), rel=1e-12)
    one = torch.zeros_like(mask)
    one[1, 2] = 1
    assert masked_var(values, one).item() == 0.0
    assert masked_var(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_whiten_matches_reference_zeroes_padding_and_maps_constants_to_zero():
    values, mask, valid = padded()
    out = masked_whiten(values, mask)
    mean, var = statistics.mean(valid), statistics.variance(valid)
    expected = [
        [(v - mean) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(rv, rm)]
        for rv, rm in zip(values.tolist(), mask.tolist())
    ]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    kept_mean = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(kept_mean[mask != 0], out[mask != 0] + mean)
    constant = masked_whiten(torch.full((2, 3), 5.0), torch.ones(2, 3))
    assert torch.all(constant == 0)


def numpy_log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    top = z.max(axis=-1, keepdims=True)
    return z - top - np.log(np.exp(z - top).sum(axis=-1, keepdims=True))


def numpy_entropy(logits: np.ndarray) -> np.ndarray:
    logp = numpy_log_softmax(logits)
    p = np.exp(logp)
    return -(np.where(p > 0, p * logp, 0.0)).sum(axis=-1)


LARGE_VOCAB = (3, 5, 32_000)


@pytest.fixture(scope="module")
def large_logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(LARGE_VOCAB, generator=g, dtype=torch.float64) * 3


def test_chunked_entropy_equals_direct_and_numpy_on_a_large_vocabulary(large_logits):
    expected = torch.from_numpy(numpy_entropy(large_logits.numpy()))
    torch.testing.assert_close(entropy_from_logits(large_logits), expected)
    torch.testing.assert_close(entropy_from_logits_with_chunking(large_logits, chunk_size=4), expected)
    torch.testing.assert_close(entropy_from_logits_with_chunking(large_logits), expected)


def test_chunked_entropy_gradient_equals_autograd_through_the_direct_formula():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 4, 300, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(7, 4, generator=g, dtype=torch.float64)
    (entropy_from_logits_with_chunking(logits, chunk_size=3) * weights).sum().backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None
    (entropy_from_logits(logits) * weights).sum().backward()
    torch.testing.assert_close(chunked_grad, logits.grad)


def test_entropy_is_stable_for_huge_and_minus_infinite_logits():
    logits = torch.tensor([[1e4, 1e4, -1e4, -float("inf")], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    expected = torch.tensor([math.log(2), math.log(4)])
    for fn in (entropy_from_logits, entropy_from_logits_with_chunking):
        torch.testing.assert_close(fn(logits), expected)


def test_chunked_logprobs_equal_numpy_log_softmax_and_autograd_gradient():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 5, 1000, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 1000, (6, 5), generator=g)
    out = logprobs_from_logits(logits, labels, chunk_size=7)
    expected = np.take_along_axis(numpy_log_softmax(logits.detach().numpy()), labels.numpy()[..., None], -1)[..., 0]
    torch.testing.assert_close(out, torch.from_numpy(expected))
    weights = torch.randn(6, 5, generator=g, dtype=torch.float64)
    (out * weights).sum().backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    torch.testing.assert_close(chunked_grad, logits.grad)


def test_bf16_logits_are_computed_in_float32():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 2000, generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 2000, (4,), generator=g)
    exact = logits.double().numpy()
    logp = logprobs_from_logits(logits, labels)
    ent = entropy_from_logits_with_chunking(logits)
    assert logp.dtype == ent.dtype == torch.float32
    expected_logp = numpy_log_softmax(exact)[np.arange(4), labels.numpy()]
    np.testing.assert_allclose(logp.numpy(), expected_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent.numpy(), numpy_entropy(exact), rtol=1e-5, atol=1e-5)


def test_labels_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.gpu
def test_chunked_logprobs_and_entropy_on_the_accelerator_match_float64_cpu():
    device = get_device_name()
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 32_000, generator=g) * 3
    labels = torch.randint(0, 32_000, (64,), generator=g)
    dev_logits = logits.to(device=device, dtype=torch.bfloat16).requires_grad_(True)
    logp = logprobs_from_logits(dev_logits, labels.to(device), chunk_size=16)
    ent = entropy_from_logits_with_chunking(dev_logits, chunk_size=16)
    (logp.sum() + ent.sum()).backward()
    exact = dev_logits.detach().double().cpu().requires_grad_(True)
    ref_logp = torch.log_softmax(exact, -1).gather(-1, labels[:, None]).squeeze(-1)
    ref_ent = entropy_from_logits(exact)
    (ref_logp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(logp.double().cpu(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double().cpu(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev_logits.grad.double().cpu(), exact.grad, rtol=2e-2, atol=1e-3)


def test_sliced_logits_are_read_in_place_and_give_the_same_values_and_gradients():
    from verl.utils.torch_functional import _row_blocks

    g = torch.Generator().manual_seed(5)
    full = torch.randn(3, 9, 50, generator=g, dtype=torch.float64, requires_grad=True)
    sliced = full[:, 2:-1, :]  # how an actor takes the response logits; not flattenable as a view
    labels = torch.randint(0, 50, sliced.shape[:-1], generator=g)
    assert _row_blocks(sliced).untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    out = logprobs_from_logits(sliced, labels, chunk_size=4) + entropy_from_logits_with_chunking(sliced, chunk_size=4)
    out.sum().backward()
    chunked_grad = full.grad.clone()
    full.grad = None
    ref_logits = full[:, 2:-1, :]
    ref = torch.log_softmax(ref_logits, -1).gather(-1, labels[..., None]).squeeze(-1) + entropy_from_logits(ref_logits)
    torch.testing.assert_close(out, ref)
    ref.sum().backward()
    torch.testing.assert_close(chunked_grad, full.grad)


# ------------------------------------------------------------------ jagged broadcast and group statistics


def test_expand_as_nested_repeats_each_rows_value_over_its_length():
    from verl.utils.torch_functional import expand_as_nested

    nested = torch.nested.as_nested_tensor([torch.zeros(2), torch.zeros(3), torch.zeros(1)], layout=torch.jagged)
    out = expand_as_nested(torch.tensor([1.0, 2.0, 3.0]), nested)
    assert out.is_nested and [r.tolist() for r in out.unbind()] == [[1.0, 1.0], [2.0, 2.0, 2.0], [3.0]]
    with pytest.raises(ValueError, match="one value per row"):
        expand_as_nested(torch.tensor([1.0]), nested)


def _distributed_stats(rank, world_size):
    from verl.utils.torch_functional import distributed_masked_mean, distributed_mean_max_min_std

    values = [
        torch.tensor([1.0, 2.0, float("nan")], dtype=torch.float64),
        torch.tensor([4.0, 8.0, 16.0], dtype=torch.float64),
    ]
    masks = [torch.tensor([1, 1, 0]), torch.tensor([1, 0, 1])]
    mean = distributed_masked_mean(values[rank], masks[rank])
    assert mean.item() == pytest.approx((1 + 2 + 4 + 16) / 4, rel=1e-15)  # the masked NaN is ignored
    data = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([4.0, 8.0, 16.0], dtype=torch.float64)]
    all_values = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    mean, largest, smallest, std = distributed_mean_max_min_std(data[rank])
    assert mean.item() == pytest.approx(all_values.mean(), rel=1e-15)
    assert (largest.item(), smallest.item()) == (16.0, 1.0)
    assert std.item() == pytest.approx(all_values.std(ddof=1), rel=1e-12)
    assert distributed_mean_max_min_std(data[rank], compute_max=False, compute_min=False, compute_std=False)[1:] == (
        None,
        None,
        None,
    )


def test_distributed_statistics_over_two_gloo_ranks():
    from tests.distributed_helpers import run_distributed

    run_distributed(_distributed_stats, 2)
