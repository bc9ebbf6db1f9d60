"""DAPO's helpers (arXiv:2503.14476): soft overlong reward shaping and the dynamic-sampling
group filter. Both run on the driver between reward and advantage."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def compute_overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    r"""DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476), added to each response's reward.

    With $L_{max}$ = `max_response_length` and buffer $L_b$ = `overlong_buffer.len`:
    $p(L) = \min(0,\ -\frac{L - (L_{max} - L_b)}{L_b}\cdot\mathrm{penalty\_factor})$: 0 up to
    $L_{max} - L_b$ tokens, then falling linearly to -penalty_factor at $L_{max}$.
    Shapes: response_lengths [B] (valid token counts) -> [B] float penalties (<= 0).
    Config: `reward_model.overlong_buffer.{len,penalty_factor}`, `data.max_response_length`.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len={overlong_buffer_len} must be in (0, data.max_response_length="
            f"{max_response_length}]: it is the number of tokens before the limit over which the penalty ramps"
        )
    lengths = response_lengths.to(torch.promote_types(response_lengths.dtype, torch.float32))
    exceed = lengths - (max_response_length - overlong_buffer_len)
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)


def filter_groups_by_metric_variance(metric_values: Any, uids: Any) -> tuple[np.ndarray, list]:
    """DAPO's dynamic-sampling filter (`algorithm.filter_groups`, arXiv:2503.14476).

    Keeps the groups (responses sharing a uid) whose metric (e.g. `acc` or `score`) varies, i.e.
    has non-zero standard deviation, plus groups of one response; groups whose responses all score
    the same carry no GRPO signal and are dropped.

    metric_values: [B] numbers (list, numpy array or tensor); uids: [B]. Returns (keep mask [B]
    bool numpy array, kept uids in first-seen order).
    """
    if isinstance(metric_values, torch.Tensor):
        metric_values = metric_values.detach().cpu().numpy()
    values = np.asarray(metric_values, dtype=np.float64)
    if len(values) != len(uids):
        raise ValueError(f"metric_values has {len(values)} entries but uids has {len(uids)}; pass one per response")
    groups: dict[Any, list[float]] = {}
    for uid, value in zip(uids, values):
        groups.setdefault(uid, []).append(value)
    kept = [uid for uid, vals in groups.items() if len(vals) == 1 or np.std(vals) > 0]
    kept_set = set(kept)
    keep = np.array([uid in kept_set for uid in uids], dtype=bool)
    return keep, kept
