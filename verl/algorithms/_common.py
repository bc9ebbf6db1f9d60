"""Small helpers shared by the algorithm modules: shape checks and the unknown-name error."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# Log-ratios are clamped before exp() so one far-off-policy token cannot overflow the loss.
_LOG_RATIO_CLAMP = 20.0


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"these tensors must have the same [batch, response_length] shape, got {shapes}")


def _unknown_name_error(kind: str, name: Any, valid: Iterable[str]) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}; valid names are: {', '.join(sorted(valid))}")
