"""The interface every actor implements; `verl.workers.actor.ppo_actor.PPOActor` is the one the backends share."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BasePPOActor(ABC):
    """A policy that scores responses and improves itself from advantages.

    `config` is the `actor_rollout_ref.actor` section; `PPOActor` stores it built (an `ActorConfig`).
    """

    def __init__(self, config):
        self.config = config

    @abstractmethod
    def compute_log_prob(self, data, calculate_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, R] of `data.batch["responses"]` (and entropies [B, R] when asked)."""

    @abstractmethod
    def update_policy(self, data) -> dict[str, list[float]]:
        """Run the PPO epochs over `data`; return metrics as lists of per-micro-batch/step values."""
