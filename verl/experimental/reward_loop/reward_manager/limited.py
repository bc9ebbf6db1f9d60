"""Upstream's reward-loop `RateLimitedRewardManager`: one sample per `run_single`, within shared limits.

The reward-loop form (`RewardManagerBase`: built as `cls(config, tokenizer, compute_score,
reward_router_address, reward_model_tokenizer)`, coroutine `run_single(data)` on a one-row
DataProto) of the driver's `reward_model.reward_manager=rate_limited`
(verl.workers.reward_manager.limited, which scores whole batches). Select it as a custom reward loop:
`reward_model.reward_loop_source=importlib`, `reward_loop_module_path` this file,
`reward_loop_class_name=RateLimitedRewardManager`; or build it in your own loop.

Limits, read from `config.reward_model` as upstream (the same keys and checks as the driver's
manager, RewardModelConfig): `max_concurrent` calls in flight (default 1), `max_rpm` requests and
`max_tpm` tokens per minute (default unlimited; each request charged
`estimated_tokens_per_request`, default 2000), each a token bucket holding one second's worth
(`AsyncTokenBucket`, shared with the driver's manager), and `timeout` seconds per call (default 300).

As upstream, and unlike the driver's manager:
- the limiters are class-level state set by the first `init_class` in the process; a later instance
  asking for other max_rpm / max_tpm keeps the first ones, with a warning that says so (the
  driver's manager refuses instead);
- a call that times out or raises scores 0, with `reward_extra_info` `{"timeout": True, "acc": 0.0}`
  or `{"error": message, "acc": 0.0}`; a float result is also reported as `acc`, a dict result
  (`{"score": ..., ...}`) gives every key as extra info.
`compute_score` may be a coroutine function or a plain one (run in the loop's executor); it defaults
to `default_compute_score`. `reward_router_address` / `reward_model_tokenizer` are passed on to it
when a generative reward model is served (verl.experimental.reward_loop.reward_model).
"""

from __future__ import annotations

import asyncio
import inspect
import logging

from omegaconf import DictConfig

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.experimental.reward_loop.reward_manager.registry import register
from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager.limited import AsyncTokenBucket, resolve_rate_limits

__all__ = ["AsyncTokenBucket", "RateLimitedRewardManager"]

logger = logging.getLogger(__name__)


@register("rate_limited")
class RateLimitedRewardManager(RewardManagerBase):
    """Rate-limited scoring of one sample per call (see the module docstring).

    Args:
        config: the trainer config; its `reward_model` section holds the limits (None: defaults).
        tokenizer: decodes the response (required).
        compute_score: `fn(data_source, solution_str, ground_truth, extra_info, **kw)`, sync or async.
        reward_router_address, reward_model_tokenizer: a served reward model's, passed to compute_score.
        num_examine, reward_fn_key: accepted for the driver managers' signature, unused (as upstream).
    """

    _semaphore: asyncio.Semaphore | None = None
    _max_concurrent: int | None = None
    _rpm_limiter: AsyncTokenBucket | None = None
    _max_rpm: int | None = None
    _tpm_limiter: AsyncTokenBucket | None = None
    _max_tpm: int | None = None
    _estimated_tokens_per_request: int | None = None
    _class_initialized = False

    @classmethod
    def init_class(cls, config, tokenizer) -> None:
        """Set the process-wide limiters from the first config seen (see the module docstring)."""
        limits = resolve_rate_limits(config, {})
        if cls._class_initialized:
            if (limits["max_rpm"], limits["max_tpm"]) != (cls._max_rpm, cls._max_tpm):
                logger.warning(
                    "RateLimitedRewardManager has already been initialized and its rate limiters are shared by "
                    "every instance in this process, so the incoming max_rpm=%s, max_tpm=%s are ignored (in force: "
                    "max_rpm=%s, max_tpm=%s). Build the first instance with the limits you want.",
                    limits["max_rpm"],
                    limits["max_tpm"],
                    cls._max_rpm,
                    cls._max_tpm,
                )
            return
        cls._max_concurrent = limits["max_concurrent"]
        cls._semaphore = asyncio.Semaphore(cls._max_concurrent)
        cls._max_rpm, cls._max_tpm = limits["max_rpm"], limits["max_tpm"]
        cls._estimated_tokens_per_request = limits["estimated_tokens_per_request"]
        cls._rpm_limiter = AsyncTokenBucket(cls._max_rpm / 60.0) if cls._max_rpm is not None else None
        cls._tpm_limiter = AsyncTokenBucket(cls._max_tpm / 60.0) if cls._max_tpm is not None else None
        logger.info(
            "RateLimitedRewardManager limits (shared by the process): max_concurrent=%s, max_rpm=%s, max_tpm=%s, "
            "estimated_tokens_per_request=%s",
            cls._max_concurrent,
            cls._max_rpm,
            cls._max_tpm,
            cls._estimated_tokens_per_request,
        )
        cls._class_initialized = True

    def __init__(
        self,
        config=None,
        tokenizer=None,
        compute_score=None,
        reward_router_address=None,
        reward_model_tokenizer=None,
        num_examine: int | None = None,
        reward_fn_key: str | None = None,
        **kwargs,
    ):
        if tokenizer is None:
            raise TypeError("RateLimitedRewardManager needs a tokenizer to decode the responses")
        if config is None:
            config = DictConfig({"reward_model": {}})
        super().__init__(config, tokenizer)
        self.compute_score = compute_score or default_compute_score
        self.is_async_reward_score = inspect.iscoroutinefunction(self.compute_score)
        self.reward_router_address = reward_router_address
        self.reward_model_tokenizer = reward_model_tokenizer
        self.timeout = resolve_rate_limits(config, {})["timeout"]

    async def _compute_reward(self, **kwargs):
        if self.reward_router_address is not None:
            kwargs.update(
                reward_router_address=self.reward_router_address, reward_model_tokenizer=self.reward_model_tokenizer
            )
        if self.is_async_reward_score:
            return await self.compute_score(**kwargs)
        return await self.loop.run_in_executor(None, lambda: self.compute_score(**kwargs))

    async def run_single(self, data) -> dict:
        if len(data) != 1:
            raise ValueError(f"RateLimitedRewardManager.run_single scores one sample; got a batch of {len(data)}")
        item = data[0]
        response_ids = item.batch["responses"]
        valid_length = int(item.batch["attention_mask"][-response_ids.shape[-1] :].sum())
        non_tensor = item.non_tensor_batch
        data_source = non_tensor["data_source"]
        extra_info = dict(non_tensor.get("extra_info") or {})
        extra_info.update(dict(non_tensor.get("tool_extra_fields") or {}))
        solution_str = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(response_ids[:valid_length], skip_special_tokens=True)
        )
        cls = type(self)
        if cls._rpm_limiter is not None:
            await cls._rpm_limiter.acquire(1.0)
        if cls._tpm_limiter is not None:
            await cls._tpm_limiter.acquire(float(cls._estimated_tokens_per_request))
        async with cls._semaphore:
            try:
                result = await asyncio.wait_for(
                    self._compute_reward(
                        data_source=data_source,
                        solution_str=solution_str,
                        ground_truth=non_tensor["reward_model"]["ground_truth"],
                        extra_info=extra_info,
                    ),
                    timeout=self.timeout,
                )
            except asyncio.TimeoutError:
                logger.warning("reward call timed out after %ss (data_source=%s)", self.timeout, data_source)
                return {"reward_score": 0.0, "reward_extra_info": {"timeout": True, "acc": 0.0}}
            except Exception as e:  # upstream's rule: a failing call scores 0 and says why
                logger.error("reward call failed (data_source=%s): %s", data_source, e)
                return {"reward_score": 0.0, "reward_extra_info": {"error": str(e), "acc": 0.0}}
        if isinstance(result, dict):
            return {"reward_score": result["score"], "reward_extra_info": dict(result)}
        return {"reward_score": result, "reward_extra_info": {"acc": result}}
