"""Upstream's reward-loop `RemoteRewardManager` ("remote"): the naive loop, scoring in separate processes.

Some scorers misbehave in the event loop's thread pool (math-verify's signal-based timeouts need a main
thread, upstream issue #3407) and CPU-heavy ones are better spread over processes: this class starts
`reward_model.num_workers` Ray actors (`RewardComputeWorker`, one CPU each, on this node when it can) and
sends each sample's `compute_score` call to the next one, round-robin. Everything else is the naive
loop's (decoding, `extra_info`, the result's form).

`compute_score` must be a plain function (the actors run it synchronously; an `async def` one is refused,
as upstream). A function from `custom_reward_function.path` lives in a module that other processes cannot
import by name, so it is shipped by value.
"""

from __future__ import annotations

import itertools
import sys

import ray

from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.experimental.reward_loop.reward_manager.registry import register
from verl.workers.reward_manager.abstract import Sample

__all__ = ["RemoteRewardManager", "RewardComputeWorker"]


class _ComputeWorker:
    """Runs `compute_score` in its own process; its method is plain (one call at a time per actor)."""

    def __init__(self, compute_score_fn):
        self.compute_score_fn = compute_score_fn

    def compute_score(self, **kwargs):
        return self.compute_score_fn(**kwargs)


RewardComputeWorker = ray.remote(num_cpus=1)(_ComputeWorker)


def _ship_by_value(fn) -> None:
    """Let Ray pickle a function from a file loaded by path (verl.utils.import_utils) by value."""
    from ray import cloudpickle  # the pickler Ray ships arguments with

    from verl.utils.import_utils import EXTERN_MODULE_PREFIX

    target = getattr(fn, "func", fn)  # functools.partial (custom_reward_function.reward_kwargs)
    module = sys.modules.get(getattr(target, "__module__", "") or "")
    if module is not None and module.__name__.startswith(EXTERN_MODULE_PREFIX):
        cloudpickle.register_pickle_by_value(module)


@register("remote")
class RemoteRewardManager(NaiveRewardManager):
    """The naive loop with `compute_score` run in `reward_model.num_workers` Ray actors (module docstring)."""

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        if self.is_async_reward_score:
            raise TypeError(
                "RemoteRewardManager (reward_model.reward_manager=remote) runs compute_score in separate processes, "
                "synchronously, so it cannot take an async def reward function; use reward_manager=naive, which "
                "awaits it"
            )
        num_workers = int((config.get("reward_model") or {}).get("num_workers") or 1)
        if num_workers < 1:
            raise ValueError(f"reward_model.num_workers={num_workers} must be at least 1")
        _ship_by_value(self.compute_score)
        node = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            node_id=ray.get_runtime_context().get_node_id(), soft=True
        )
        self.reward_worker = [
            RewardComputeWorker.options(scheduling_strategy=node).remote(self.compute_score) for _ in range(num_workers)
        ]
        self.reward_worker_pool = itertools.cycle(self.reward_worker)

    def choose_reward_worker(self):
        return next(self.reward_worker_pool)

    async def call_score(self, sample: Sample):
        return await self.choose_reward_worker().compute_score.remote(**self.score_kwargs(sample))

    def shutdown(self) -> None:
        """End the scoring actors (ours; otherwise they end with the process that holds this instance)."""
        for worker in self.reward_worker:
            ray.kill(worker)
        self.reward_worker = []
