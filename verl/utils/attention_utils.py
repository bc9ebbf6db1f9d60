"""Upstream's padding helpers for packed (remove-padding) forwards: `unpad_input`, `pad_input`,
`index_first_axis`, `rearrange`.

Upstream dispatches to flash-attn's `bert_padding` (CUDA) or transformers' NPU copies; these are the same
functions in plain torch (and einops' `rearrange`), so they run on every device and without flash-attn,
with flash-attn 2.7's results: `unpad_input(hidden_states, attention_mask, unused_mask=None)` returns
(the real rows flattened over batch x sequence, their indices in the flattened batch, `cu_seqlens`
int32 [B + 1], the longest row's length, each row's length int32 [B]); `pad_input(hidden_states, indices,
batch, seqlen)` scatters them back, zeros elsewhere; `index_first_axis(x, indices)` is `x[indices]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows `indices` of `input` along its first axis."""
    return input.index_select(0, indices)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """(rows [T, ...], indices [T], cu_seqlens [B + 1] int32, max_seqlen_in_batch, seqused [B] int32) of the
    positions `attention_mask` (and `unused_mask`, counted as tokens but not as used) marks in
    `hidden_states` [B, S, ...]."""
    keep = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """[batch, seqlen, ...] with `hidden_states` [T, ...] at `indices` of the flattened batch, zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_copy(0, indices, hidden_states)
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def rearrange(tensor, pattern: str, **axes_lengths):
    """einops' `rearrange`."""
    from einops import rearrange as _rearrange

    return _rearrange(tensor, pattern, **axes_lengths)
