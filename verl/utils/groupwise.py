"""Per-group statistics for group-relative advantages (upstream's `verl.utils.groupwise`).

- `as_torch_index(labels)`: group labels of any kind (ints, near-integer floats, numeric strings,
  uuid strings, mixed objects; a list, numpy array or tensor) as a 1-D int64 tensor of group ids.
  Non-negative integer labels (and floats within 1e-6 of one, and numeric strings) are kept as
  their values; any other labels are numbered by their sorted order (`np.unique`).
- `group_mean_std(scores, gidx, eps=1e-6)`: per group id g in 0..max(gidx), the mean, the unbiased
  standard deviation sqrt(max(var, eps)) and the count, as float32 [G] tensors. A group of one
  gets mean 0 and std 1 (so its normalised advantage is its raw score, as upstream's GRPO does);
  ids that no row uses get count 0.

Sums are taken in float64 and cast to float32 at the end (upstream sums in float32, which loses
the variance of large, close scores). Device: `device` when given, else `VERL_FORCE_DEVICE`, else
the input tensor's device, else verl's device (`verl.utils.device.get_device_name`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

__all__ = ["as_torch_index", "group_mean_std"]


def _resolve_device(explicit, like: Any = None) -> torch.device:
    if explicit is not None:
        return torch.device(explicit)
    forced = os.environ.get("VERL_FORCE_DEVICE")
    if forced:
        return torch.device(forced)
    if isinstance(like, torch.Tensor):
        return like.device
    from verl.utils.device import get_device_name

    return torch.device(get_device_name())


def _as_ids(labels: np.ndarray) -> np.ndarray:
    """int64 group ids of a 1-D label array (see the module docstring)."""
    if labels.dtype != object and (np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_):
        ids = labels.astype(np.int64)
        return ids if ids.size == 0 or ids.min() >= 0 else np.unique(ids, return_inverse=True)[1].astype(np.int64)
    if labels.dtype != object and np.issubdtype(labels.dtype, np.floating):
        rounded = np.rint(labels.astype(np.float64))
        if np.all(np.abs(labels - rounded) <= 1e-6) and (rounded.size == 0 or rounded.min() >= 0):
            return rounded.astype(np.int64)
    else:
        try:
            ids = labels.astype(np.int64)  # numeric strings
        except (TypeError, ValueError, OverflowError):
            ids = None
        if ids is not None and (ids.size == 0 or ids.min() >= 0):
            return ids
    try:
        inverse = np.unique(labels, return_inverse=True)[1]
    except TypeError:  # labels of mixed types do not sort: number them by their text
        inverse = np.unique(np.array([str(x) for x in labels], dtype=object), return_inverse=True)[1]
    return inverse.reshape(-1).astype(np.int64)


def as_torch_index(index: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """Group ids [N] (int64) of the labels `index` (see the module docstring)."""
    target = _resolve_device(device, index)
    if isinstance(index, torch.Tensor):
        flat = index.reshape(-1).detach().cpu()
        labels = flat.numpy() if flat.dtype != torch.bfloat16 else flat.double().numpy()
    else:
        labels = np.asarray(index) if not isinstance(index, np.ndarray) else index
        if labels.ndim != 1:
            labels = labels.reshape(-1)
    return torch.from_numpy(_as_ids(labels)).to(target)


@torch.no_grad()
def group_mean_std(
    scores: torch.Tensor, gidx: torch.Tensor, eps: float = 1e-6, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean [G], std [G], count [G]) of `scores` [N] per group id `gidx` [N] (see the module docstring)."""
    target = _resolve_device(device, scores)
    scores = scores.reshape(-1).to(device=target, dtype=torch.float64)
    gidx = gidx.reshape(-1).to(device=target, dtype=torch.long)
    if scores.numel() != gidx.numel():
        raise ValueError(
            f"scores has {scores.numel()} entries but gidx has {gidx.numel()}; give one group id per score"
        )
    if gidx.numel() == 0:
        empty = torch.empty(0, device=target, dtype=torch.float32)
        return empty, empty, empty
    num_groups = int(gidx.max()) + 1
    zeros = torch.zeros(num_groups, device=target, dtype=torch.float64)
    count = zeros.index_add(0, gidx, torch.ones_like(scores))
    mean = zeros.index_add(0, gidx, scores) / count.clamp(min=1)
    sq_dev = zeros.index_add(0, gidx, (scores - mean[gidx]) ** 2)
    std = torch.sqrt(torch.clamp(sq_dev / (count - 1).clamp(min=1), min=eps))
    single = count <= 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    return mean.float(), std.float(), count.float()
