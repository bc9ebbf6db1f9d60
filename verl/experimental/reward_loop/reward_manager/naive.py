"""Upstream's reward-loop `NaiveRewardManager` ("naive"): one sample per `run_single`, scored by the reward function.

`run_single(data)` takes a one-row DataProto and returns `{"reward_score": float, "reward_extra_info":
{...}}`: the function's result when it is a dict (`{"score": ..., **details}`, every key reported),
else `{"acc": score}`, as upstream. The response is decoded as the driver's managers decode it
(verl.workers.reward_manager.abstract.decode_samples: valid tokens only, special tokens skipped, the
data source from `data.reward_fn_key`, default `data_source`), with the rollout's `num_turns`,
`rollout_reward_scores` and agent-loop fields added to `extra_info` (`ROLLOUT_EXTRA_INFO`), so the scores
equal those of the driver's `reward_model.reward_manager=naive` on the same rows.

`compute_score` may be `async def` (awaited) or plain (run in the event loop's thread pool, so rows score
concurrently). With a generative reward model served (`reward_router_address` not None) it is also given
`reward_router_address` and `reward_model_tokenizer`. Unlike upstream, a result that is not a finite
number (or a dict without "score") is an error naming what came back, not a silent NaN in training.
"""

from __future__ import annotations

import asyncio
import inspect

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.experimental.reward_loop.reward_manager.registry import register
from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager.abstract import Sample, decode_samples, score_and_details

__all__ = ["NaiveRewardManager"]


def _reward_fn_key(config) -> str:
    data = config.get("data") if config is not None and hasattr(config, "get") else None
    return (data.get("reward_fn_key") if data is not None else None) or "data_source"


@register("naive")
class NaiveRewardManager(RewardManagerBase):
    """Scores one sample per call with `compute_score` (see the module docstring)."""

    ROLLOUT_EXTRA_INFO: tuple[str, ...] = ("tool_extra_fields", "num_turns", "rollout_reward_scores")
    """The rollout's per-sample values added to `extra_info` (verl.workers.reward_manager.abstract)."""

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer)
        self.compute_score = compute_score or default_compute_score
        self.is_async_reward_score = inspect.iscoroutinefunction(self.compute_score)
        self.reward_router_address = reward_router_address
        self.reward_model_tokenizer = reward_model_tokenizer
        self.reward_fn_key = _reward_fn_key(config)

    async def decode_one(self, data) -> Sample:
        """The one row of `data`, decoded (in the thread pool: tokenizers are slow on long responses)."""
        if len(data) != 1:
            raise ValueError(f"{type(self).__name__}.run_single scores one sample; got a batch of {len(data)}")
        loop = asyncio.get_running_loop()
        samples = await loop.run_in_executor(
            None, decode_samples, self.tokenizer, data, self.reward_fn_key, self.ROLLOUT_EXTRA_INFO
        )
        return samples[0]

    def score_kwargs(self, sample: Sample) -> dict:
        """The keyword arguments of `compute_score` for `sample`."""
        kwargs = {
            "data_source": sample.data_source,
            "solution_str": sample.solution_str,
            "ground_truth": sample.ground_truth,
            "extra_info": sample.extra_info,
        }
        if self.reward_router_address is not None:
            kwargs.update(
                reward_router_address=self.reward_router_address, reward_model_tokenizer=self.reward_model_tokenizer
            )
        return kwargs

    async def call_score(self, sample: Sample):
        """What `compute_score` returns for `sample` (awaited, or run in the thread pool)."""
        kwargs = self.score_kwargs(sample)
        if self.is_async_reward_score:
            return await self.compute_score(**kwargs)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.compute_score(**kwargs))

    def shape(self, sample: Sample, score: float, extra: dict) -> float:
        """The reward from the function's score (a subclass's shaping, e.g. DAPO's overlong penalty)."""
        return score

    async def run_single(self, data) -> dict:
        sample = await self.decode_one(data)
        result = await self.call_score(sample)
        try:
            score, details = score_and_details(result)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{type(self).__name__} on data_source={sample.data_source!r}: {e}") from e
        extra = details or {"acc": score}
        return {"reward_score": self.shape(sample, score, extra), "reward_extra_info": extra}
