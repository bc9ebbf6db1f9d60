"""Learning-rate schedules and padding helpers.

The loss math (log-probs from logits, entropy, masked means, KL) lives in
`verl.trainer.ppo.core_algos`; this module holds the non-math tensor plumbing the workers share.
Schedules are `LambdaLR`s, so their state is a step counter that checkpoints restore exactly.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "pad_2d_list_to_length",
    "pad_sequence_to_length",
]


def get_constant_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, last_epoch: int = -1
) -> LambdaLR:
    """Linear warm-up from 0 to the base lr over `num_warmup_steps`, then constant."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        return 1.0

    return LambdaLR(optimizer, factor, last_epoch)


def get_cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warm-up, then cosine decay from the base lr to `min_lr_ratio * lr`.

    With the default half cycle the lr reaches `min_lr_ratio * lr` at `num_training_steps`.
    """
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * max(0.0, cosine)

    return LambdaLR(optimizer, factor, last_epoch)


def pad_sequence_to_length(
    tensors: torch.Tensor, max_seq_len: int, pad_token_id, left_pad: bool = False
) -> torch.Tensor:
    """Pad the last dimension of [B, L] to `max_seq_len` (no-op when already that long)."""
    if tensors.shape[-1] >= max_seq_len:
        return tensors
    pad = (max_seq_len - tensors.shape[-1], 0) if left_pad else (0, max_seq_len - tensors.shape[-1])
    return torch.nn.functional.pad(tensors, pad, "constant", pad_token_id)


def pad_2d_list_to_length(response: list[list[int]], pad_token_id, max_length: int | None = None) -> torch.Tensor:
    """Right-pad a list of token lists to a [B, max(len, max_length)] tensor."""
    width = max((len(row) for row in response), default=0)
    if max_length is not None:
        width = max(width, max_length)
    return torch.tensor([list(row) + [pad_token_id] * (width - len(row)) for row in response])
