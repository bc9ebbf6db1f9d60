"""`SearchTool`: the model's queries go to a Search-R1 style retrieval service (upstream verl's tool, its names).

Tool config (upstream's `search_tool_config.yaml`; keys and defaults are upstream's):

    - class_name: verl.tools.search_tool.SearchTool
      config:
        retrieval_service_url: http://127.0.0.1:8000/retrieve   # required; an http(s) URL
        topk: 3                      # hits per query
        timeout: 30                  # seconds one HTTP request may take
        num_workers: 120             # searches of this tool that run at once (threads of its pool)
        enable_global_rate_limit: true
        rate_limit: 120              # calls in flight across the Ray cluster (the shared limiter)
      tool_schema: {type: function, function: {name: search, parameters: {... query_list: array ...}}}

`execute(instance_id, {"query_list": [...]})` sends `execute_search` to `self.execution_pool`, the
same Ray execution pool and cluster-wide limiter as `SandboxFusionTool` (`init_execution_pool` from
`verl.tools.sandbox_fusion_tools`; `SearchExecutionWorker` and `init_search_execution_pool` are
upstream's names for them), which calls `perform_single_search_batch`
(`verl.tools.utils.search_r1_like_utils`). It returns `(ToolResponse(text=<JSON {"result": ...}>), 0.0,
metrics)` with metrics `query_count`, `status`, `total_results`, `api_request_error`; a missing or
empty `query_list` and a failed search are answered in the same JSON form (the model reads why).
`calc_reward` returns the list of result texts the instance received (upstream's). For a local service,
`python -m verl.tools.retrieval_service --corpus F --port 8000` (BM25; upstream's is dense e5+faiss).

Differences from upstream, each deliberate (as for `SandboxFusionTool`):
- The pool starts on first use, not in `__init__` (building the tool needs no Ray), and its actors
  ask for no CPU.
- A missing or non-http(s) `retrieval_service_url` and non-positive limits are errors when the tool
  is built, naming the key.
- `config.timeout` is upstream's per-request timeout; the agent loop's limit on the whole call
  (`BaseTool.timeout_s`) is what the retries may take: `MAX_RETRIES` x `timeout` plus the delays
  between attempts, so the retry loop, not the agent loop, ends a call to a dead service.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.sandbox_fusion_tools import (
    RATE_LIMITER_NAME,
    ExecutionWorker,
    LazyExecutionPool,
    PoolMode,
    TokenBucketWorker,
    check_http_url,
    check_positive,
    init_execution_pool,
)
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.tools.utils import search_r1_like_utils
from verl.tools.utils.search_r1_like_utils import perform_single_search_batch
from verl.utils.rollout_trace import rollout_trace_op

logger = logging.getLogger(__name__)

__all__ = [
    "RATE_LIMITER_NAME",
    "PoolMode",
    "SearchExecutionWorker",
    "SearchTool",
    "TokenBucketWorker",
    "init_search_execution_pool",
]

SearchExecutionWorker = ExecutionWorker
init_search_execution_pool = init_execution_pool


class SearchTool(LazyExecutionPool, BaseTool):
    """Searches a retrieval service for each query of `query_list` (module docstring)."""

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | dict | None):
        config = dict(config or {})
        self.num_workers = config.get("num_workers", 120)
        self.rate_limit = config.get("rate_limit", 120)
        self.timeout = config.get("timeout", 30)
        self.enable_global_rate_limit = config.get("enable_global_rate_limit", True)
        self.retrieval_service_url = config.get("retrieval_service_url")
        self.topk = config.get("topk", 3)
        where = f"{type(self).__name__} config"
        check_http_url(
            where,
            "retrieval_service_url",
            self.retrieval_service_url,
            "a retrieval service's /retrieve endpoint such as http://127.0.0.1:8000/retrieve (`python -m "
            "verl.tools.retrieval_service --corpus corpus.jsonl --port 8000` serves a local BM25 one)",
        )
        check_positive(where, self, ("num_workers", "rate_limit", "timeout", "topk"))
        super().__init__(config, tool_schema)
        retries = search_r1_like_utils.MAX_RETRIES
        delays = search_r1_like_utils.INITIAL_RETRY_DELAY * retries * (retries - 1) / 2
        self.timeout_s = float(retries * self.timeout + delays)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "reward": []}
        return instance_id, ToolResponse()

    def execute_search(
        self, instance_id: str, query_list: list, retrieval_service_url: str, topk: int, timeout: int
    ) -> tuple[str, dict[str, Any]]:
        """(result text, metadata) of one batch of queries; runs on the execution pool."""
        result_text, metadata = perform_single_search_batch(
            retrieval_service_url=retrieval_service_url,
            query_list=query_list,
            topk=topk,
            concurrent_semaphore=None,  # the pool bounds concurrency
            timeout=timeout,
        )
        logger.debug("search result of %s: %s", instance_id, result_text)
        return result_text, metadata

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        query_list = parameters.get("query_list")
        if not query_list or not isinstance(query_list, list):
            message = f"Error: 'query_list' is missing, empty, or not a list in parameters (got {query_list!r})."
            return ToolResponse(text=json.dumps({"result": message})), 0.0, {}
        try:
            result_text, metadata = await self.execution_pool.execute.remote(
                self.execute_search,
                instance_id,
                [str(q) for q in query_list],
                self.retrieval_service_url,
                self.topk,
                self.timeout,
            )
        except Exception as e:
            logger.warning("search of %s failed: %r", instance_id, e)
            return ToolResponse(text=json.dumps({"result": f"Search execution failed: {e}"})), 0.0, {"error": str(e)}
        if instance_id in self._instance_dict:
            self._instance_dict[instance_id]["reward"].append(result_text.strip())
        metrics = {key: metadata.get(key) for key in ("query_count", "status", "total_results", "api_request_error")}
        return ToolResponse(text=result_text), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs) -> list[str]:
        return self._instance_dict[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
