"""Reward manager for rate-limited reward APIs (LLM judges): ``reward_model.reward_manager=rate_limited``.

``RateLimitedRewardManager`` scores the samples of a batch concurrently, within three limits, as
upstream's manager of the same name and registry key:

- ``max_concurrent``: reward calls in flight at once (default 1);
- ``max_rpm``: requests per minute (default None: unlimited), a token bucket holding one second's
  worth of requests (so at most ``max_rpm / 60`` start back to back, then one every
  ``60 / max_rpm`` seconds);
- ``max_tpm``: tokens per minute (default None), a bucket charged ``estimated_tokens_per_request``
  (default 2000) per request; a request larger than the bucket waits for the missing tokens and
  leaves the bucket in debt, so the average rate still holds.

The limits are shared by every instance in the process (the train and validation reward functions
draw on one API quota), and so is one event loop, run in a daemon thread, that all scoring goes
through: asyncio's semaphore is bound to one loop, and callers may come from any thread. A second
instance asking for different limits is an error rather than silently getting the first one's.

``compute_score`` may be a coroutine function (awaited on that loop) or a plain function (run in
the loop's thread pool). A call taking longer than ``timeout`` seconds (default 300) scores 0 and
is flagged in ``reward_extra_info["reward_timeout"]``; the call itself cannot be cancelled if it is
a plain function, so it finishes in the background. Any other failure follows ``on_error`` as in
every manager here (``"raise"`` by default; upstream's manager always scores failures 0, which is
``on_error="zero"``).

The limits come from keyword arguments (``reward_model.reward_kwargs.max_rpm=...``) or, as
upstream reads them, from ``config.reward_model.{max_concurrent, max_rpm, max_tpm,
estimated_tokens_per_request, timeout}``; keyword arguments win. Those five keys are fields of
``RewardModelConfig`` (their defaults and checks live there): a partial ``reward_model`` section is
built into it, and keyword arguments replace its fields, so both routes are checked the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable

from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config.reward_model import RewardModelConfig
from verl.workers.reward_manager.abstract import AbstractRewardManager, Sample, ScoreOutcome
from verl.workers.reward_manager.registry import register

__all__ = ["AsyncTokenBucket", "RateLimitedRewardManager", "resolve_rate_limits"]

# the rate limits: fields of RewardModelConfig (upstream reads them from the reward_model section)
_LIMIT_KEYS = ("max_concurrent", "max_rpm", "max_tpm", "estimated_tokens_per_request", "timeout")


class AsyncTokenBucket:
    """A token bucket: `rate_limit` tokens per second flow in, up to `max_tokens` (default: one
    second's worth); `await acquire(n)` takes n tokens, sleeping until they are there.

    Taking more than `max_tokens` at once waits until the missing tokens have flowed in and leaves
    the balance negative. Safe across event loops and threads: the lock guards only the
    arithmetic, never a sleep.
    """

    def __init__(self, rate_limit: float, max_tokens: float | None = None):
        if not rate_limit > 0:
            raise ValueError(f"rate_limit must be positive (tokens per second), got {rate_limit!r}")
        self.rate_limit = float(rate_limit)
        self.max_tokens = float(max_tokens) if max_tokens else self.rate_limit
        self.tokens = self.max_tokens
        self.last_update: float | None = None
        self._lock = threading.Lock()

    def _refill(self, now: float) -> None:
        if self.last_update is not None:
            self.tokens = min(self.max_tokens, self.tokens + (now - self.last_update) * self.rate_limit)
        self.last_update = now

    async def acquire(self, num_tokens: float = 1.0) -> None:
        if num_tokens > self.max_tokens:
            with self._lock:
                self._refill(time.monotonic())
                wait = max(0.0, (num_tokens - self.tokens) / self.rate_limit)
                self.tokens -= num_tokens
            if wait > 0:
                await asyncio.sleep(wait)
            return
        while True:
            with self._lock:
                self._refill(time.monotonic())
                if self.tokens >= num_tokens:
                    self.tokens -= num_tokens
                    return
                wait = (num_tokens - self.tokens) / self.rate_limit
            await asyncio.sleep(wait)


def resolve_rate_limits(config, limits: dict) -> dict:
    """The five limits: `config.reward_model`'s (typed: RewardModelConfig, the YAML's defaults for keys it
    leaves out), replaced by the keyword arguments in `limits`, each checked by RewardModelConfig."""
    section = config.get("reward_model") if config is not None else None
    typed = dataclasses.replace(omega_conf_to_dataclass(section, RewardModelConfig), **limits)
    return {key: getattr(typed, key) for key in _LIMIT_KEYS}


class _SharedLimits:
    """The process-wide loop thread and limiters of `RateLimitedRewardManager`."""

    def __init__(self, limits: dict):
        self.limits = limits
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="verl-rate-limited-reward", daemon=True)
        self.thread.start()
        self.semaphore = self.run(self._make_semaphore(limits["max_concurrent"]))
        rpm, tpm = limits["max_rpm"], limits["max_tpm"]
        self.rpm_bucket = AsyncTokenBucket(rpm / 60.0) if rpm is not None else None
        self.tpm_bucket = AsyncTokenBucket(tpm / 60.0) if tpm is not None else None

    @staticmethod
    async def _make_semaphore(value: int) -> asyncio.Semaphore:
        return asyncio.Semaphore(value)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


@register("rate_limited")
class RateLimitedRewardManager(AbstractRewardManager):
    """Concurrent, rate-limited scoring (see the module docstring).

    Args:
        config: optional trainer config; its ``reward_model`` section may hold the limits.
        tokenizer: decodes the responses (required).
        compute_score: ``fn(data_source, solution_str, ground_truth, extra_info)``, sync or async;
            defaults to ``default_compute_score``.
        reward_router_address, reward_model_tokenizer: upstream's reward-model router arguments;
            this implementation has no router, so giving one is an error.
        num_examine, reward_fn_key, on_error: as every reward manager here.
        max_concurrent, max_rpm, max_tpm, estimated_tokens_per_request, timeout: the limits.
    """

    ROLLOUT_EXTRA_INFO = ("tool_extra_fields",)  # upstream's rate-limited manager adds only the loop's fields
    _shared: _SharedLimits | None = None
    _shared_lock = threading.Lock()

    def __init__(
        self,
        config=None,
        tokenizer=None,
        compute_score: Callable | None = None,
        reward_router_address: str | None = None,
        reward_model_tokenizer=None,
        num_examine: int = 0,
        reward_fn_key: str = "data_source",
        on_error: str = "raise",
        **limits,
    ):
        if tokenizer is None:
            raise TypeError("RateLimitedRewardManager needs a tokenizer to decode the responses")
        if reward_router_address is not None or reward_model_tokenizer is not None:
            raise NotImplementedError(
                "RateLimitedRewardManager: reward_router_address / reward_model_tokenizer route scoring through "
                "upstream's reward-model router, which this implementation does not have; call your judge from "
                "compute_score instead"
            )
        unknown = sorted(set(limits) - set(_LIMIT_KEYS))
        if unknown:
            raise TypeError(
                f"RateLimitedRewardManager got unexpected keyword arguments {unknown}; limits are {list(_LIMIT_KEYS)}"
            )
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, on_error)
        self.limits = resolve_rate_limits(config, limits)
        self.timeout = self.limits["timeout"]
        self.is_async_reward_score = inspect.iscoroutinefunction(self.compute_score)
        self._shared_state = self._acquire_shared(self.limits)

    @classmethod
    def _acquire_shared(cls, limits: dict) -> _SharedLimits:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = _SharedLimits(limits)
            elif cls._shared.limits != limits:
                raise ValueError(
                    f"RateLimitedRewardManager's limits are shared by the whole process and were set to "
                    f"{cls._shared.limits}; this instance asks for {limits}. Give every instance the same limits "
                    "(or call RateLimitedRewardManager.reset_shared_limits() first, e.g. between tests)"
                )
            return cls._shared

    @classmethod
    def reset_shared_limits(cls) -> None:
        """Forget the process-wide limiters (stops their loop thread); the next instance sets new ones."""
        with cls._shared_lock:
            if cls._shared is not None:
                cls._shared.loop.call_soon_threadsafe(cls._shared.loop.stop)
                cls._shared.thread.join(timeout=10)
                cls._shared = None

    async def _call(self, sample: Sample):
        kwargs = {
            "data_source": sample.data_source,
            "solution_str": sample.solution_str,
            "ground_truth": sample.ground_truth,
            "extra_info": sample.extra_info,
        }
        if self.is_async_reward_score:
            return await self.compute_score(**kwargs)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.compute_score(**kwargs))

    async def _score_one(self, sample: Sample) -> ScoreOutcome:
        shared = self._shared_state
        if shared.rpm_bucket is not None:
            await shared.rpm_bucket.acquire(1.0)
        if shared.tpm_bucket is not None:
            await shared.tpm_bucket.acquire(float(self.limits["estimated_tokens_per_request"]))
        async with shared.semaphore:
            try:
                return ScoreOutcome(result=await asyncio.wait_for(self._call(sample), timeout=self.timeout))
            except asyncio.TimeoutError:
                return ScoreOutcome(timed_out=True)
            except Exception as e:
                return ScoreOutcome(error=f"{type(e).__name__}: {e}", cause=e)

    async def _score_all(self, samples: list[Sample]) -> list[ScoreOutcome]:
        return list(await asyncio.gather(*(self._score_one(s) for s in samples)))

    def compute_scores(self, samples: list[Sample]) -> list[ScoreOutcome]:
        if not samples:
            return []
        return self._shared_state.run(self._score_all(samples))
