"""Packed ("remove padding") forward passes for HF decoder models.

A padded batch [B, L] wastes compute on pad tokens. The packed form concatenates the real tokens
of every row into one sequence [1, T] (T = number of non-pad tokens) with `position_ids` that
restart at 0 for each original row, and no attention mask.

How attention stays per-sequence: transformers (>= 4.53, checked on 5.23) detects packing from
`position_ids` when `attention_mask is None` and no KV cache is used. With
`attn_implementation="flash_attention_2"` it calls the varlen kernel with `cu_seqlens` derived
from the position resets; with `"sdpa"` (the CPU path) it builds a block-diagonal causal mask.
Both give the same numbers as the padded forward up to float rounding (a test checks this in
float64). We therefore only need the index bookkeeping here, with no dependency on flash-attn's
`bert_padding` module; callers must pass `use_cache=False` so no cache disables the detection.

The one requirement on the input is that each row's real tokens have contiguous positions
starting at 0, which `compute_position_id_with_mask` produces for left- and right-padded rows.
"""

from __future__ import annotations

import torch

__all__ = ["pad_input", "unpad_input", "unpad_position_ids"]


def unpad_input(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the real tokens of a padded batch, packed into one row.

    Args:
        input_ids: [B, L] (or [B, L, ...]) padded tensor.
        attention_mask: [B, L], 1 for real tokens.

    Returns:
        (packed [1, T, ...], indices [T]): `indices` are positions in the flattened [B*L] batch,
        the argument `pad_input` needs to scatter results back.
    """
    indices = attention_mask.reshape(-1).nonzero(as_tuple=False).squeeze(-1)
    flat = input_ids.reshape(-1, *input_ids.shape[2:])
    return flat.index_select(0, indices).unsqueeze(0), indices


def unpad_position_ids(position_ids: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Positions [B, L] -> packed positions [1, T] aligned with `unpad_input`."""
    return position_ids.reshape(-1).index_select(0, indices).unsqueeze(0)


def pad_input(packed: torch.Tensor, indices: torch.Tensor, batch_size: int, seqlen: int) -> torch.Tensor:
    """Scatter a packed [T, ...] tensor back to [B, L, ...], zeros at pad positions."""
    out = packed.new_zeros(batch_size * seqlen, *packed.shape[1:])
    out.index_copy_(0, indices, packed)
    return out.view(batch_size, seqlen, *packed.shape[1:])
