"""Upstream's `verl.models.transformers.qwen2_vl.get_rope_index`: the M-RoPE position ids of one
Qwen2-VL / Qwen2.5-VL sequence, from its processor (datasets of verl-recipe, e.g. DeepEyes, call it).

The positions are `verl.utils.vision.mrope_positions`' (the ones the dataset, the rollout and the
actors of this project use); this module adapts upstream's calling convention: one sequence, the
token ids and merge size read from the processor, padding positions 1, and text positions in all three
rows when no image or video grid is given. Upstream's FlashAttention and forward patches of Qwen2-VL
are not here: transformers' own model takes these positions (`apply_monkey_patch` covers sdpa).
"""

from __future__ import annotations

import torch

from verl.utils.vision import mrope_positions

# upstream's fixed temporal rate: a video's time index advances by second_per_grid_t * 2 per grid
_TOKENS_PER_SECOND = 2


def get_rope_index(
    processor,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(3, seq_len) M-RoPE positions (time, height, width) of one sequence `input_ids` (seq_len,).

    `processor` is the model's processor (its tokenizer's `<|image_pad|>`, `<|video_pad|>` ids and its
    image processor's `merge_size` are read). Attended tokens take the positions of
    `verl.utils.vision.mrope_positions` (images and videos in prompt order, `image_grid_thw` /
    `video_grid_thw` rows in that order, a video's time index scaled by `second_per_grid_ts[v] * 2`);
    padding (`attention_mask` 0) takes 1, as upstream. Without any grid the sequence is text: attended
    tokens count from 0 in all three rows.
    """
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() != 1:
        raise ValueError(
            f"get_rope_index takes one sequence (input_ids of shape (seq_len,)), got shape {tuple(input_ids.shape)}; "
            "call it per row"
        )
    mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask)
    if mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(mask.shape)} differs from input_ids shape {tuple(input_ids.shape)}"
        )
    attended = mask.to(input_ids.device) == 1
    if image_grid_thw is None and video_grid_thw is None:
        positions = (attended.long().cumsum(-1) - 1).masked_fill(~attended, 1).unsqueeze(0).expand(3, -1)
        return positions.to(input_ids.device)
    tokenizer = processor.tokenizer
    video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    if video_token_id == tokenizer.unk_token_id:  # a vocabulary without videos: no token is a video's
        video_token_id = None
    positions = mrope_positions(
        input_ids[None].cpu(),
        attended[None].cpu(),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=video_token_id,
        spatial_merge_size=processor.image_processor.merge_size,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts,
        tokens_per_second=_TOKENS_PER_SECOND,
    )[:, 0]
    positions[:, ~attended.cpu()] = 1
    return positions.to(device=input_ids.device, dtype=input_ids.dtype)
