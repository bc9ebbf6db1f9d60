"""The base of a custom reward loop class, at upstream's import path and with upstream's interface.

A subclass is built as `cls(config, tokenizer, compute_score, reward_router_address,
reward_model_tokenizer)` (a subclass's own `__init__` takes those five and calls
`super().__init__(config, tokenizer)`) and implements the coroutine `run_single(data)`: `data` is a
one-row DataProto, the result `{"reward_score": float, "reward_extra_info": {name: value}}`.
`self.loop` is the event loop the instance was built in, for `self.loop.run_in_executor(...)` of
blocking work; `init_class` runs once per class, for state its instances share.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod


class RewardManagerBase(ABC):
    """Upstream's reward-loop manager base (see the module docstring)."""

    _class_initialized = False

    def __init__(self, config, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:  # built outside a running loop: one of its own
            self.loop = asyncio.new_event_loop()
        self.init_class(config, tokenizer)

    @classmethod
    def init_class(cls, config, tokenizer) -> None:
        """Set up state shared by all instances of the class; runs once per class."""
        if cls._class_initialized:
            return
        cls._class_initialized = True

    @abstractmethod
    async def run_single(self, data) -> dict:
        """Score the one sample of `data`: {"reward_score": float, "reward_extra_info": dict}."""
        raise NotImplementedError
