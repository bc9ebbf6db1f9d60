"""Float64 references written as plain Python loops over rows and tokens, deliberately unlike the
vectorised implementations under test (no torch reductions, no masks multiplied in)."""

from __future__ import annotations

import math
import statistics

import torch


def rows(t: torch.Tensor | list) -> list[list[float]]:
    """A [B, R] tensor (or nested list) as Python floats."""
    return t if isinstance(t, list) else t.detach().double().tolist()


def valid_positions(mask_row: list[float]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m != 0]


def agg_reference(loss_mat: torch.Tensor | list, mask: torch.Tensor, mode: str, norm: float | None = None) -> float:
    """The four `loss_agg_mode`s by explicit loops; empty responses are skipped by seq-mean modes."""
    losses, masks = rows(loss_mat), rows(mask)
    if mode == "token-mean":
        vals = [losses[i][t] for i in range(len(losses)) for t in valid_positions(masks[i])]
        return sum(vals) / len(vals) if vals else 0.0
    if mode == "seq-mean-token-sum-norm":
        total = sum(losses[i][t] for i in range(len(losses)) for t in valid_positions(masks[i]))
        return total / (len(losses) * (len(masks[0]) if norm is None else norm))
    per_seq = []
    for i in range(len(losses)):
        pos = valid_positions(masks[i])
        if not pos:
            continue
        s = sum(losses[i][t] for t in pos)
        per_seq.append(s if mode == "seq-mean-token-sum" else s / len(pos))
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


def agg_weights(mask: torch.Tensor, mode: str) -> list[list[float]]:
    """d(aggregated loss)/d(token loss) for each token: the weight each token gets."""
    masks = rows(mask)
    batch, length = len(masks), len(masks[0])
    non_empty = sum(1 for m in masks if valid_positions(m))
    n_tokens = sum(len(valid_positions(m)) for m in masks)
    out = []
    for m in masks:
        pos = valid_positions(m)
        w = [0.0] * length
        for t in pos:
            if mode == "token-mean":
                w[t] = 1.0 / n_tokens
            elif mode == "seq-mean-token-sum":
                w[t] = 1.0 / non_empty
            elif mode == "seq-mean-token-mean":
                w[t] = 1.0 / (non_empty * len(pos))
            else:
                w[t] = 1.0 / (batch * length)
        out.append(w)
    return out


def whiten_reference(values: list[list[float]], masks: list[list[float]]) -> list[list[float]]:
    """(x - mean) / sqrt(unbiased var + 1e-8) over valid positions; 0 at padded positions."""
    flat = [values[i][t] for i in range(len(values)) for t in valid_positions(masks[i])]
    mean = sum(flat) / len(flat)
    var = statistics.variance(flat) if len(flat) > 1 else 0.0
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [
        [(values[i][t] - mean) * scale if masks[i][t] != 0 else 0.0 for t in range(len(values[i]))]
        for i in range(len(values))
    ]
