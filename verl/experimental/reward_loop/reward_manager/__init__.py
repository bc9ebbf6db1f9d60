"""Upstream's reward-loop classes: one sample per `async run_single(data)`, chosen by name.

- `register(name)` / `get_reward_manager_cls(name)`: the reward loop's registry (registry.py).
- `RewardManagerBase`: the base of every class, built as `cls(config, tokenizer, compute_score,
  reward_router_address, reward_model_tokenizer)` (base.py).
- Built in: "naive" (`NaiveRewardManager`), "dapo" (`DAPORewardManager`, plus the overlong penalty),
  "remote" (`RemoteRewardManager`, scoring in Ray processes), "rate_limited" (`RateLimitedRewardManager`).
"""

from verl.experimental.reward_loop.reward_manager.registry import get_reward_manager_cls, register  # noqa: I001
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.experimental.reward_loop.reward_manager.dapo import DAPORewardManager
from verl.experimental.reward_loop.reward_manager.limited import RateLimitedRewardManager
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.experimental.reward_loop.reward_manager.remote import RemoteRewardManager

__all__ = [
    "DAPORewardManager",
    "NaiveRewardManager",
    "RateLimitedRewardManager",
    "RemoteRewardManager",
    "RewardManagerBase",
    "get_reward_manager_cls",
    "register",
]
