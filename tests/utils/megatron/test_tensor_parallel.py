"""Upstream's vocab-parallel helpers (`verl.utils.megatron.tensor_parallel`): on 2 gloo ranks holding
half the vocabulary each, entropy and log-probs (and their gradients) equal a float64 full-softmax
reference; the packed (rmpad) variant picks the response columns as a hand-worked batch says; the
parameter-attribute helpers read megatron's marks and refuse an unmarked parameter."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed

VOCAB = 6


def _logits() -> torch.Tensor:
    return torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3


def _check_vocab_parallel(rank, world_size):
    from verl.utils.megatron.parallel_state import initialize_model_parallel
    from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy, vocab_parallel_log_probs_from_logits

    initialize_model_parallel(tensor_model_parallel_size=world_size)
    full = _logits()
    labels = torch.tensor([0, 5, 2, 3, 4])  # ranks 0 and 1 each own some labels
    half = VOCAB // world_size
    local = full[:, rank * half : (rank + 1) * half].clone().requires_grad_(True)

    reference = full.clone().requires_grad_(True)
    log_p = torch.log_softmax(reference, dim=-1)
    want_entropy = -(log_p.exp() * log_p).sum(-1)
    want_log_probs = log_p.gather(-1, labels[:, None])[:, 0]

    entropy = vocab_parallel_entropy(local)
    torch.testing.assert_close(entropy, want_entropy.detach(), atol=1e-12, rtol=0)
    assert entropy.dtype == torch.float64
    (grad_local,) = torch.autograd.grad(entropy.sum(), local)
    (grad_full,) = torch.autograd.grad(want_entropy.sum(), reference, retain_graph=True)
    torch.testing.assert_close(grad_local, grad_full[:, rank * half : (rank + 1) * half], atol=1e-12, rtol=0)

    log_probs = vocab_parallel_log_probs_from_logits(local, labels)
    torch.testing.assert_close(log_probs, want_log_probs.detach(), atol=1e-12, rtol=0)
    (grad_local,) = torch.autograd.grad(log_probs.sum(), local)
    (grad_full,) = torch.autograd.grad(want_log_probs.sum(), reference)
    torch.testing.assert_close(grad_local, grad_full[:, rank * half : (rank + 1) * half], atol=1e-12, rtol=0)


def test_vocab_parallel_entropy_and_log_probs_equal_full_softmax_on_two_ranks():
    pytest.importorskip("megatron.core")
    run_distributed(_check_vocab_parallel, 2)


def _check_response_rmpad(rank, world_size):
    from verl.utils.megatron.parallel_state import initialize_model_parallel
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits_response_rmpad

    initialize_model_parallel()
    # row 0: one left pad, tokens 1 2 3; row 1: tokens 4 5 6 7
    input_ids = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1]])
    attention_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    packed = torch.tensor([1, 2, 3, 4, 5, 0, 1])
    # logits whose log-softmax is known: a one-hot-ish bump of 2.0 at column (t + 3) % VOCAB
    logits = torch.zeros(7, VOCAB, dtype=torch.float64)
    logits[torch.arange(7), (torch.arange(7) + 3) % VOCAB] = 2.0
    log_z = torch.log(torch.tensor(torch.e**2 + VOCAB - 1, dtype=torch.float64))
    out = vocab_parallel_log_probs_from_logits_response_rmpad(input_ids, attention_mask, logits, response_length=2)
    # the label of packed token t is packed[t + 1] (wrapping); row 0's columns 1, 2 are packed 0, 1
    # and row 1's columns 1, 2 are packed 4, 5
    labels = torch.roll(packed, -1)
    per_token = torch.where(labels == (torch.arange(7) + 3) % VOCAB, 2.0, 0.0).double() - log_z
    want = torch.stack([per_token[[0, 1]], per_token[[4, 5]]])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_response_rmpad_log_probs_read_the_packed_tokens_next_label():
    pytest.importorskip("megatron.core")
    run_distributed(_check_response_rmpad, 1)


def test_partition_helpers_read_megatron_marks_and_refuse_plain_parameters():
    from verl.utils.megatron.tensor_parallel import (
        get_tensor_parallel_partition_dim,
        get_tensor_parallel_partition_stride,
        is_tensor_parallel_param,
    )

    param = torch.nn.Parameter(torch.zeros(2, 3))
    assert not is_tensor_parallel_param(param)
    with pytest.raises(ValueError, match="not tensor-parallel"):
        get_tensor_parallel_partition_dim(param)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 1, 1
    assert is_tensor_parallel_param(param)
    assert get_tensor_parallel_partition_dim(param) == 1
    assert get_tensor_parallel_partition_stride(param) == 1


def test_default_parallel_linear_kwargs_build_megatron_configs():
    pytest.importorskip("megatron.core")
    from verl.utils.megatron.tensor_parallel import (
        get_default_kwargs_for_column_parallel_linear,
        get_default_kwargs_for_parallel_embedding,
        update_kwargs_with_config,
    )

    column = get_default_kwargs_for_column_parallel_linear()
    assert column["stride"] == 1 and column["config"].async_tensor_model_parallel_allreduce is False
    assert column["config"].params_dtype is torch.float32
    assert get_default_kwargs_for_parallel_embedding()["init_method"] is torch.nn.init.xavier_normal_
    kwargs = {"a": 1}
    assert update_kwargs_with_config(kwargs, "cfg") is kwargs and kwargs == {"a": 1, "config": "cfg"}
