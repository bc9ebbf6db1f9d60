"""Simulated users for multi-turn rollouts (`multi_turn.interaction_config_path`), upstream's interface."""

from verl.interactions.base import BaseInteraction

__all__ = ["BaseInteraction"]
