"""Megatron's load-balanced context-parallel layout of one sequence, as plain tensor functions.

The sequence (padded to a multiple of `2 * cp`) is cut into `2 * cp` equal chunks and rank r holds
chunks r and `2cp - 1 - r`, so every rank gets the same share of the causal mask's work. Kept here,
below `verl.models`, because both the model's context-parallel attention
(`verl.models.mcore.context_parallel`) and the CPU patch of megatron's rotary embedding
(`verl.utils.megatron.cpu_compat`) slice by it; it imports neither torch.distributed nor megatron.
"""

from __future__ import annotations

import torch


def own_chunks(size: int, rank: int) -> tuple[int, int]:
    """The two of the `2 * size` chunks that rank `rank` holds."""
    return rank, 2 * size - 1 - rank


def split_sequence(tensor: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of `tensor` along `dim` (length divisible by `2 * size`): chunks r and 2size-1-r."""
    if size == 1:
        return tensor
    length = tensor.shape[dim]
    if length % (2 * size):
        raise ValueError(f"sequence length {length} is not divisible by 2 x context_parallel_size={size}")
    chunks = tensor.chunk(2 * size, dim=dim)
    first, second = own_chunks(size, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)
