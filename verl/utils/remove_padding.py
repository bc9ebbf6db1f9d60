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

One exception: transformers' gpt-oss (`GptOssModel`, 5.24) builds its masks without the
`position_ids`, so it cannot detect the packing and would let each packed row attend to the rows
before it. For such a model `packed_model_inputs` builds the per-layer-type masks itself with the
same transformers mask builders given the position ids (block-diagonal causal, and sliding-window
for its sliding layers) and passes them as the mask mapping that the model accepts in place of a
2-D mask.
"""

from __future__ import annotations

import torch

__all__ = ["pad_input", "packed_model_inputs", "unpad_input", "unpad_position_ids"]

# model types whose HF forward builds its attention masks without the position ids (see the module docstring)
_MASKS_WITHOUT_POSITIONS = ("gpt_oss",)


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
    """Positions [B, L] -> packed positions [1, T] aligned with `unpad_input`.

    A vision-language model's positions [B, C, L] (upstream's layout: C=4, row 0 the text positions,
    rows 1-3 M-RoPE's, see `verl.utils.vision.vl_position_ids`) -> [C, 1, T], the layout the model's
    forward takes. Qwen2-VL's language model detects the packing from row 0 (it restarts at 0 in each
    sequence) exactly as a text model does from its positions, and rotates with rows 1-3.
    """
    if position_ids.dim() == 3:
        channels = position_ids.shape[1]
        flat = position_ids.transpose(0, 1).reshape(channels, -1)
        return flat.index_select(1, indices).unsqueeze(1)
    return position_ids.reshape(-1).index_select(0, indices).unsqueeze(0)


def pad_input(packed: torch.Tensor, indices: torch.Tensor, batch_size: int, seqlen: int) -> torch.Tensor:
    """Scatter a packed [T, ...] tensor back to [B, L, ...], zeros at pad positions."""
    out = packed.new_zeros(batch_size * seqlen, *packed.shape[1:])
    out.index_copy_(0, indices, packed)
    return out.view(batch_size, seqlen, *packed.shape[1:])


def packed_model_inputs(model, packed_ids: torch.Tensor, packed_pos: torch.Tensor) -> dict:
    """Keyword arguments of an HF causal LM's forward on one packed row [1, T] (with `use_cache=False`):
    the ids and position ids ([1, T], or [C, 1, T] for a vision-language model), and for a model in
    `_MASKS_WITHOUT_POSITIONS` its block-diagonal masks."""
    inputs = {"input_ids": packed_ids, "position_ids": packed_pos}
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _MASKS_WITHOUT_POSITIONS:
        return inputs
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    dtype = model.get_input_embeddings().weight.dtype
    # the builders read the batch size, length, dtype and device of the embeddings, never their values
    embeds = torch.empty((*packed_ids.shape, 1), dtype=dtype, device=packed_ids.device)
    common = {
        "config": config,
        "inputs_embeds": embeds,
        "attention_mask": None,
        "cache": None,
        "position_ids": packed_pos,
    }
    inputs["attention_mask"] = {
        "full_attention": create_causal_mask(**common),
        "sliding_attention": create_sliding_window_causal_mask(**common),
    }
    return inputs
