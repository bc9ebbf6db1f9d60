"""The interface every critic backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BasePPOCritic(ABC):
    """A value function over response tokens. `config` is the `critic` section."""

    def __init__(self, config):
        self.config = config

    @abstractmethod
    def compute_values(self, data) -> torch.Tensor:
        """Values [B, R] for the response tokens of `data` (0 at padding)."""

    @abstractmethod
    def update_critic(self, data) -> dict[str, list[float]]:
        """Regress values towards `data.batch["returns"]`; return metrics lists."""
