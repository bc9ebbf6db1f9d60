"""`verl.trainer.config.{CheckpointConfig, RewardManagerConfig, ModuleConfig, CustomRewardFunctionConfig}`:
upstream's import path of the checkpoint section and the driver's reward sections.

`CheckpointConfig` lives with the actor and critic sections that hold it (`verl.workers.config.checkpoint`):
a section class in the trainer layer could not be named by them without an upward import. The reward
sections are the driver's (`verl.trainer.ppo.reward` builds them once and reads them by attribute);
`CustomRewardFunctionConfig` is ours (upstream reads that section untyped). Upstream's
`RewardManagerConfig.__post_init__` asserts that a registered name exists; here the validator checks
`name` against the registry (with user registrations) and `get_reward_manager_cls` says the same when
the manager is built, so the class does not import the reward managers.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.workers.config._fields import REWARD_MANAGER_SOURCES, REWARD_ON_ERROR, doc
from verl.workers.config.checkpoint import CheckpointConfig
from verl.workers.config.reward import ModuleConfig, reward_manager_choices

__all__ = ["CheckpointConfig", "CustomRewardFunctionConfig", "ModuleConfig", "RewardManagerConfig"]


@dataclass
class RewardManagerConfig(BaseConfig):
    """Which reward manager turns scores into token-level rewards (upstream's reward_manager section)."""

    source: str = doc(
        "register: the registered manager `name`; importlib: the class module.name from the file module.path.",
        choices=REWARD_MANAGER_SOURCES,
        default="register",
    )
    name: str = doc(
        "Registered manager (follows reward_model.reward_manager).", choices=reward_manager_choices, default="naive"
    )
    module: ModuleConfig = doc("The class for source=importlib.", default_factory=ModuleConfig)


@dataclass
class CustomRewardFunctionConfig(BaseConfig):
    """A user reward function `fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`."""

    path: str | None = doc(
        "Python file defining the function; null uses verl.utils.reward_score.default_compute_score. The file "
        "is imported and run in the trainer's processes with your permissions: point it only at code you trust.",
        default=None,
    )
    name: str = doc("Function name inside `path`.", default="compute_score")
    reward_kwargs: dict = doc(
        "Keyword arguments bound to the function at every call (e.g. {format_score: 0.1}).", default_factory=dict
    )
    on_error: str = doc(
        "A reward function that raises, or returns NaN, infinity or a non-number (custom or built-in): raise stops "
        "the run showing the failing sample; zero scores that sample 0 and counts it in reward/num_errors.",
        choices=REWARD_ON_ERROR,
        default="raise",
    )
