"""Rule-based reward managers, selected by name with ``reward_model.reward_manager``.

``naive`` (default, one call per sample), ``batch`` (one call for the batch), ``dapo`` (naive + overlong
length penalty), ``prime`` (parallel processes with a per-sample timeout), ``rate_limited`` (concurrent
calls of a rate-limited reward API, within concurrency, requests-per-minute and tokens-per-minute limits). Register another with
``@register("name")`` on a subclass of ``AbstractRewardManager``.
"""

from verl.workers.reward_manager.abstract import AbstractRewardManager, RewardFunctionError
from verl.workers.reward_manager.batch import BatchRewardManager
from verl.workers.reward_manager.dapo import DAPORewardManager
from verl.workers.reward_manager.limited import RateLimitedRewardManager
from verl.workers.reward_manager.naive import NaiveRewardManager
from verl.workers.reward_manager.prime import PrimeRewardManager
from verl.workers.reward_manager.registry import (
    REWARD_MANAGER_REGISTRY,
    get_reward_manager_cls,
    register,
    register_reward_manager,
)

__all__ = [
    "REWARD_MANAGER_REGISTRY",
    "AbstractRewardManager",
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "RateLimitedRewardManager",
    "RewardFunctionError",
    "get_reward_manager_cls",
    "register",
    "register_reward_manager",
]
