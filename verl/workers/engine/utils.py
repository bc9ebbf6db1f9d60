"""Small helpers every engine backend uses (moved down here so no backend borrows another's)."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

__all__ = ["cast_floating", "plain_section"]


def plain_section(section) -> dict:
    """A config section (DictConfig, dict or None) as a plain dict, interpolations resolved."""
    if section is None:
        return {}
    return OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)


def cast_floating(named_tensors, dtype: torch.dtype):
    """`(name, tensor)` pairs with the floating-point tensors cast to `dtype` (ids and masks kept), lazily."""
    for name, tensor in named_tensors:
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
