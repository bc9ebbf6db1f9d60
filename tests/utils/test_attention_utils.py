"""Upstream's `verl.utils.attention_utils` (flash-attn's padding helpers there) on hand-worked batches."""

from __future__ import annotations

import torch

from verl.utils.attention_utils import index_first_axis, pad_input, rearrange, unpad_input


def test_unpad_and_pad_on_a_hand_worked_batch():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float64).reshape(2, 4, 3)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    rows, indices, cu_seqlens, max_seqlen, used = unpad_input(hidden, mask)
    assert indices.tolist() == [1, 2, 3, 4, 5]
    assert cu_seqlens.tolist() == [0, 3, 5] and cu_seqlens.dtype == torch.int32
    assert max_seqlen == 3 and used.tolist() == [3, 2]
    torch.testing.assert_close(
        rows, torch.stack([hidden[0, 1], hidden[0, 2], hidden[0, 3], hidden[1, 0], hidden[1, 1]])
    )
    back = pad_input(rows, indices, batch=2, seqlen=4)
    torch.testing.assert_close(back, hidden * mask.unsqueeze(-1))


def test_unpad_of_token_ids_as_upstreams_actors_call_it_and_the_gradient_of_pad():
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    mask = (ids != 0).long()
    packed, indices, *_ = unpad_input(ids.unsqueeze(-1), mask)
    assert packed.transpose(0, 1).tolist() == [[5, 6, 7]]  # upstream's (1, total_nnz) packed row
    position_ids = torch.tensor([[0, 1, 2], [0, 1, 2]])
    flat_pos = index_first_axis(rearrange(position_ids.unsqueeze(-1), "b s ... -> (b s) ..."), indices)
    assert flat_pos.transpose(0, 1).tolist() == [[0, 1, 0]]
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (
        pad_input(values.unsqueeze(-1), indices, 2, 3).squeeze(-1) * torch.tensor([[1.0, 10.0, 100.0], [4.0, 5.0, 6.0]])
    ).sum().backward()
    assert values.grad.tolist() == [1.0, 10.0, 4.0]
