"""Name -> reward-loop class, so `reward_model.reward_manager=<name>` selects one (upstream's registry).

The reward loop's own table, beside the driver's (verl.workers.reward_manager.registry): its classes
score one sample per `run_single` call (`RewardManagerBase`), the driver's score a batch. A class
registered here is also usable by the trainer (verl.trainer.ppo.reward: a name the driver's table lacks
is looked up here and run through verl.workers.reward_manager.reward_loop).

As upstream: a second class under a taken name is a ValueError, and so is an unknown name. Registering
the same class again is not an error, judged by its source file and qualified name, since a file
imported twice (by module name and by path, e.g. `reward_loop_module_path` pointing at a built-in
class's file) builds its classes twice; the first one stays registered.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

__all__ = ["REWARD_LOOP_MANAGER_REGISTRY", "get_reward_manager_cls", "register"]

REWARD_LOOP_MANAGER_REGISTRY: dict[str, type] = {}


def _identity(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _definition(cls: type) -> tuple[str, str]:
    """Where the class is defined: its source file (its module when it has none) and qualified name."""
    try:
        where = os.path.realpath(inspect.getfile(cls))
    except (TypeError, OSError):
        where = cls.__module__
    return where, cls.__qualname__


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a reward-loop class available as `reward_model.reward_manager=<name>`."""

    def decorator(cls: type) -> type:
        existing = REWARD_LOOP_MANAGER_REGISTRY.get(name)
        if existing is not None and _definition(existing) == _definition(cls):
            return cls  # the same definition imported again: the first one stays registered
        if existing is not None:
            raise ValueError(
                f"reward manager {name} has already been registered: {_identity(existing)} vs {_identity(cls)}; "
                "register the new class under another name"
            )
        REWARD_LOOP_MANAGER_REGISTRY[name] = cls
        return cls

    return decorator


def get_reward_manager_cls(name: str) -> type:
    """The reward-loop class registered as `name`."""
    if name not in REWARD_LOOP_MANAGER_REGISTRY:
        raise ValueError(
            f"Unknown reward manager: {name} (reward_model.reward_manager); the reward loop's registered ones are "
            f"{sorted(REWARD_LOOP_MANAGER_REGISTRY)}. Register a custom class with "
            "@verl.experimental.reward_loop.reward_manager.register(name) in the custom_reward_function.path file, "
            "or use reward_model.reward_loop_source=importlib"
        )
    return REWARD_LOOP_MANAGER_REGISTRY[name]
