"""`RewardManagerBase`, the base of a custom reward loop class (upstream's import path)."""

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

__all__ = ["RewardManagerBase"]
