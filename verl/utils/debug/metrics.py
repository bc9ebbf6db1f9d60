"""How far the rollout engine's token probabilities are from the actor's (upstream's
`verl.utils.debug.metrics`).

The rollout engine samples with its own kernels and precision, so its log-probs of the sampled
tokens (`rollout_log_probs`) differ from the training engine's recomputation (`old_log_probs`).
`calculate_debug_metrics(batch)` reports, over valid response tokens, the absolute difference of
the two *probabilities* (max, mean, std) and their Pearson correlation (arXiv:2506.13585 uses it
to spot a broken weight sync or a precision mismatch: it should be close to 1).

Metric names are upstream's: `training/rollout_probs_diff_{valid,max,mean,std}` and
`training/rollout_actor_probs_pearson_corr`.
"""

from __future__ import annotations

import torch

__all__ = [
    "calculate_debug_metrics",
    "calculate_log_prob_diff",
    "calculate_token_list_diff",
    "pearson_correlation_coefficient",
]


def calculate_token_list_diff(tensor1: torch.Tensor, tensor2: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row [B]: how many valid positions (`mask` == 1) hold different tokens in the two [B, T]
    tensors. Empty inputs give zeros."""
    if tensor1.numel() == 0 or tensor2.numel() == 0:
        return torch.zeros(tensor1.shape[0], dtype=torch.long, device=tensor1.device)
    if not tensor1.shape == tensor2.shape == mask.shape:
        raise ValueError(
            f"calculate_token_list_diff needs equal shapes, got {tuple(tensor1.shape)}, {tuple(tensor2.shape)} and "
            f"mask {tuple(mask.shape)}"
        )
    different = (tensor1 != tensor2.to(tensor1.device)) & (mask.to(tensor1.device) == 1)
    return different.sum(dim=1)


def pearson_correlation_coefficient(tensor1: torch.Tensor, tensor2: torch.Tensor, mask: torch.Tensor) -> float:
    """Pearson correlation of the two tensors' entries where the boolean `mask` is True."""
    if not tensor1.shape == tensor2.shape == mask.shape:
        raise ValueError(
            f"pearson_correlation_coefficient needs equal shapes, got {tuple(tensor1.shape)}, {tuple(tensor2.shape)} "
            f"and mask {tuple(mask.shape)}"
        )
    x = torch.masked_select(tensor1, mask).double()
    y = torch.masked_select(tensor2, mask).double()
    return torch.corrcoef(torch.stack([x, y]))[0, 1].item()


def calculate_log_prob_diff(log_probs1: torch.Tensor, log_probs2: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|log_probs1 - log_probs2| at the positions where the boolean `mask` is True (1-D)."""
    return torch.masked_select(torch.abs(log_probs1 - log_probs2), mask)


def calculate_debug_metrics(data) -> dict:
    """The rollout-vs-actor probability metrics of a DataProto with `rollout_log_probs`,
    `old_log_probs` and `responses` [B, R]; valid tokens come from `response_mask`, else the
    response part of `attention_mask`, else every token."""
    batch = data.batch
    rollout_log_probs = batch["rollout_log_probs"]
    actor_log_probs = batch["old_log_probs"]
    response_length = batch["responses"].shape[1]
    keys = batch.keys()
    if "response_mask" in keys:
        mask = batch["response_mask"]
    elif "attention_mask" in keys:
        mask = batch["attention_mask"]
    else:
        mask = torch.ones_like(rollout_log_probs)
    mask = mask[:, -response_length:].bool()
    actor_probs = torch.exp(actor_log_probs)
    rollout_probs = torch.exp(rollout_log_probs)
    diff = calculate_log_prob_diff(actor_probs, rollout_probs, mask)
    return {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": diff.max().item(),
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_std": diff.std().item(),
        "training/rollout_actor_probs_pearson_corr": pearson_correlation_coefficient(actor_probs, rollout_probs, mask),
    }
