"""Name -> reward manager class, so ``reward_model.reward_manager=<name>`` selects one.

Registration is idempotent for the same class (a module imported twice, as happens in Ray workers,
registers again without error); a different class under a taken name is an error.
"""

from __future__ import annotations

from collections.abc import Callable

REWARD_MANAGER_REGISTRY: dict[str, type] = {}


def _identity(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a reward manager available as ``reward_model.reward_manager=<name>``."""

    def decorator(cls: type) -> type:
        existing = REWARD_MANAGER_REGISTRY.get(name)
        if existing is not None and _identity(existing) != _identity(cls):
            raise ValueError(
                f"reward manager name {name!r} is already taken by {_identity(existing)}; register "
                f"{_identity(cls)} under another name"
            )
        REWARD_MANAGER_REGISTRY[name] = cls
        return cls

    return decorator


register_reward_manager = register


def get_reward_manager_cls(name: str) -> type:
    """The reward manager class registered as ``name``."""
    if name not in REWARD_MANAGER_REGISTRY:
        raise ValueError(
            f"Unknown reward manager: {name} (reward_model.reward_manager); registered ones are "
            f"{sorted(REWARD_MANAGER_REGISTRY)}. A custom manager must be imported and decorated with "
            "verl.workers.reward_manager.register(name) before the trainer starts"
        )
    return REWARD_MANAGER_REGISTRY[name]
