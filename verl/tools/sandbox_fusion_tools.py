"""`SandboxFusionTool`: the model's code runs on a SandboxFusion service (upstream verl's tool, its names).

Tool config (upstream's keys and defaults):

    - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
      config:
        sandbox_fusion_url: http://localhost:8080/run_code   # required; an http(s) URL of `run_code`
        num_workers: 10              # calls of this tool that run at once (threads of its execution pool)
        enable_global_rate_limit: true
        rate_limit: 10               # calls in flight across the whole Ray cluster (one shared limiter)
        default_timeout: 30          # seconds a program may run (and compile), unless the call gives `timeout`
        default_language: python     # unless the call gives `language`
        memory_limit_mb: 1024
      tool_schema: {type: function, function: {name: code_interpreter, parameters: {... code ...}}}

How a call runs, as upstream's: `execute` sends `execute_code(instance_id, code, timeout, language)`
to `self.execution_pool`, a Ray actor (`ExecutionWorker`, `max_concurrency=num_workers` threads) whose
`execute.remote(fn, *args)` runs `fn` once a token of the cluster-wide limiter (`TokenBucketWorker`,
the named actor "rate-limiter", `rate_limit` tokens) is held. Recipes subclass the tool and call
`self.execution_pool.execute.remote(self.execute_code, ...)` themselves (verl-recipe's ReTool), so
these names are the interface. `execute_code` POSTs the program through the SandboxFusion client
`verl.utils.reward_score.sandbox_fusion.utils.call_sandbox_api` and returns a `ToolResponse` whose
text is what the model reads: stdout then stderr when the program ran (also when it exited non-zero:
the traceback helps the model); the output so far and a note when it ran out of time; the compiler's
message on a compile error; and "Error: ..." naming the URL and the cause when the service cannot
be reached or fails (upstream answers "no stdout here"; a model, and a person reading the rollouts,
learn more from the cause). `execute` returns `(response, None, None)`: no step reward, no metrics.

Differences from upstream, each deliberate:
- The pool is created on first use of `execution_pool`, not in `__init__`: building the tool (the
  tool config is read where the agent loop starts) needs no Ray, and a tool that is never called
  starts no actor. Both actors ask Ray for no CPU (`num_cpus=0`): they only wait on the network, and
  a cluster whose CPUs are all held by placement groups must still schedule them.
- A bad `sandbox_fusion_url` (missing, not http(s)) and non-positive limits are errors when the tool
  is built, naming the key; upstream only checks that the URL is non-empty.
- The agent loop's own limit on one call (`config.timeout`, see `BaseTool`) defaults to what the
  service call may take: (2 x default_timeout + the client's 10 s) per attempt, three attempts on a
  gateway timeout, so the sandbox's own time limit ends a long program first.
- An exception inside `fn` propagates to the caller (the agent loop answers the model "Error: ...");
  upstream logs it and returns None.
- `PoolMode.ProcessMode` is refused as upstream does (not implemented there either).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar
from urllib.parse import urlparse
from uuid import uuid4

import ray

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.reward_score.sandbox_fusion.utils import API_TIMEOUT, MAX_RETRIES, SUPPORTED_LANGUAGES, call_sandbox_api
from verl.utils.rollout_trace import rollout_trace_op

logger = logging.getLogger(__name__)

T = TypeVar("T")

RATE_LIMITER_NAME = "rate-limiter"
"""The Ray name of the cluster-wide limiter (upstream's), shared by every SandboxFusionTool."""


class PoolMode(Enum):
    ThreadMode = 1
    ProcessMode = 2


class TokenBucket:
    """At most `rate_limit` holders at once: `acquire` blocks while all tokens are out, `release`
    returns one. A plain class (testable alone); `TokenBucketWorker` is it as a Ray actor, where
    `acquire` runs in a one-thread concurrency group (waiters queue there) and `release` in another,
    so a release is never stuck behind a blocked acquire."""

    def __init__(self, rate_limit: int):
        if int(rate_limit) < 1:
            raise ValueError(f"rate_limit={rate_limit!r} must be a positive number of calls in flight")
        self.rate_limit = int(rate_limit)
        self.current_count = 0  # for observability, as upstream's
        self._semaphore = threading.Semaphore(self.rate_limit)
        self._lock = threading.Lock()

    @ray.method(concurrency_group="acquire")
    def acquire(self) -> None:
        self._semaphore.acquire()
        with self._lock:
            self.current_count += 1

    @ray.method(concurrency_group="release")
    def release(self) -> None:
        with self._lock:
            if self.current_count == 0:
                raise RuntimeError("TokenBucket.release() without a matching acquire()")
            self.current_count -= 1
        self._semaphore.release()

    def get_current_count(self) -> int:
        return self.current_count

    def get_rate_limit(self) -> int:
        return self.rate_limit


TokenBucketWorker = ray.remote(concurrency_groups={"acquire": 1, "release": 10})(TokenBucket)


class ExecutionWorker:
    """Runs functions under the cluster-wide rate limit; a Ray actor made by `init_execution_pool`."""

    def __init__(self, enable_global_rate_limit: bool = True, rate_limit: int = 10):
        self.rate_limit_worker = self._init_rate_limit(rate_limit) if enable_global_rate_limit else None

    def _init_rate_limit(self, rate_limit: int):
        """The named limiter actor, created by the first worker; later ones share it (and its limit)."""
        limiter = TokenBucketWorker.options(name=RATE_LIMITER_NAME, get_if_exists=True, num_cpus=0).remote(rate_limit)
        existing = ray.get(limiter.get_rate_limit.remote())
        if existing != int(rate_limit):
            logger.warning(
                "the cluster-wide sandbox rate limiter %r already exists with rate_limit=%d; this tool's rate_limit=%d "
                "is not applied (the first tool's limit holds for every tool)",
                RATE_LIMITER_NAME,
                existing,
                int(rate_limit),
            )
        return limiter

    def ping(self) -> bool:
        return True

    def execute(self, fn: Callable[..., T], *fn_args, **fn_kwargs) -> T:
        if self.rate_limit_worker is None:
            return fn(*fn_args, **fn_kwargs)
        ray.get(self.rate_limit_worker.acquire.remote())
        try:
            return fn(*fn_args, **fn_kwargs)
        finally:
            self.rate_limit_worker.release.remote()


def init_execution_pool(
    num_workers: int, enable_global_rate_limit: bool = True, rate_limit: int = 10, mode: PoolMode = PoolMode.ThreadMode
):
    """An `ExecutionWorker` actor running up to `num_workers` calls at once (module docstring)."""
    if mode != PoolMode.ThreadMode:
        raise NotImplementedError(f"init_execution_pool: mode={mode} is not implemented; use PoolMode.ThreadMode")
    if int(num_workers) < 1:
        raise ValueError(f"num_workers={num_workers!r} must be at least 1")
    return (
        ray.remote(ExecutionWorker)
        .options(max_concurrency=int(num_workers), num_cpus=0)
        .remote(enable_global_rate_limit=enable_global_rate_limit, rate_limit=rate_limit)
    )


def check_http_url(where: str, key: str, value, example: str) -> None:
    """`value` must be an http(s) URL; the error names the key and what to point it at (`example`)."""
    url = urlparse(str(value or ""))
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"{where}: {key}={value!r} is not an http(s) URL; set it to {example}")


def check_positive(where: str, owner, keys) -> None:
    """Each of `owner`'s attributes `keys` must be a positive number (a pooled tool's limits)."""
    for key in keys:
        value = getattr(owner, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{where}: {key}={value!r} must be a positive number")


class LazyExecutionPool:
    """A pooled tool's `execution_pool`: the `ExecutionWorker` actor, started on first use from the tool's
    `num_workers`, `enable_global_rate_limit` and `rate_limit` (a test or a subclass may assign one)."""

    _execution_pool = None

    @property
    def execution_pool(self):
        """The `ExecutionWorker` actor, started on first use (module docstring)."""
        if self._execution_pool is None:
            self._execution_pool = init_execution_pool(
                num_workers=self.num_workers,
                enable_global_rate_limit=self.enable_global_rate_limit,
                rate_limit=self.rate_limit,
                mode=PoolMode.ThreadMode,
            )
        return self._execution_pool

    @execution_pool.setter
    def execution_pool(self, pool) -> None:
        self._execution_pool = pool


class SandboxFusionTool(LazyExecutionPool, BaseTool):
    """Executes the `code` argument on a SandboxFusion service (module docstring)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict | None):
        config = dict(config or {})
        self.num_workers = config.get("num_workers", 10)
        self.rate_limit = config.get("rate_limit", 10)
        self.default_timeout = config.get("default_timeout", 30)
        self.default_language = config.get("default_language", "python")
        self.enable_global_rate_limit = config.get("enable_global_rate_limit", True)
        self.sandbox_fusion_url = config.get("sandbox_fusion_url", "")
        self.memory_limit_mb = config.get("memory_limit_mb", 1024)
        where = f"{type(self).__name__} config"
        check_http_url(
            where,
            "sandbox_fusion_url",
            self.sandbox_fusion_url,
            "a SandboxFusion run_code endpoint such as http://localhost:8080/run_code (`python -m "
            "verl.tools.sandbox_fusion_service --port 8080` serves a local, Python-only one)",
        )
        check_positive(where, self, ("num_workers", "rate_limit", "default_timeout", "memory_limit_mb"))
        if self.default_language not in SUPPORTED_LANGUAGES:
            raise ValueError(
                f"{where}: default_language={self.default_language!r} is not a SandboxFusion language; "
                f"one of {list(SUPPORTED_LANGUAGES)}"
            )
        config.setdefault("timeout", MAX_RETRIES * (2 * self.default_timeout + API_TIMEOUT))
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs
    ) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": []}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, None, None]:
        code = parameters.get("code", "")
        timeout = parameters.get("timeout", self.default_timeout)
        language = parameters.get("language", self.default_language)
        if not isinstance(code, str):
            code = str(code)
        result = await self.execution_pool.execute.remote(self.execute_code, instance_id, code, timeout, language)
        if not isinstance(result, ToolResponse):
            result = ToolResponse(text=None if result is None else str(result))
        return result, None, None

    def execute_code(self, instance_id: str, code: str, timeout: int = 30, language: str = "python") -> ToolResponse:
        """Run `code` on the service; the response text is what the model reads (module docstring)."""
        reply, error = call_sandbox_api(
            self.sandbox_fusion_url, code, None, timeout, timeout, self.memory_limit_mb, language
        )
        if error is not None:
            return ToolResponse(text=f"Error: the code sandbox could not run the code: {error}")
        run_result = reply.get("run_result") or {}
        compile_result = reply.get("compile_result") or {}
        output = (run_result.get("stdout") or "") + (run_result.get("stderr") or "")
        if run_result.get("status") == "Finished":
            logger.debug("sandbox output of %s: %s", instance_id, output)
            return ToolResponse(text=output)
        if run_result.get("status") == "TimeLimitExceeded":
            return ToolResponse(text=f"{output}\n[the code ran longer than its {timeout} s time limit]".lstrip("\n"))
        if compile_result.get("status") == "TimeLimitExceeded":
            return ToolResponse(text=f"Error: compiling took longer than {timeout} s")
        if compile_result and compile_result.get("return_code") not in (0, None):
            return ToolResponse(
                text=f"Compile error:\n{compile_result.get('stderr') or compile_result.get('stdout') or ''}"
            )
        message = reply.get("message") or f"status {reply.get('status')!r}"
        return ToolResponse(text=f"Error: the code sandbox failed: {message}")

    async def calc_reward(self, instance_id: str, **kwargs):
        return self._instance_dict[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
