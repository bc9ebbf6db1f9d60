"""The rate limiter of MCP calls and the conversion of an MCP tool's description to an OpenAI function schema."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any


class TokenBucket:
    """At most `rate_limit` calls a second on average, with bursts of up to `rate_limit` calls.

    The bucket holds up to `rate_limit` tokens and refills continuously at `rate_limit` tokens a second;
    `acquire()` takes one token when there is one (True) and otherwise takes nothing (False). Safe to share
    between threads. `clock` (seconds, monotonic) is replaceable for tests.
    """

    def __init__(self, rate_limit: float, clock=time.monotonic):
        rate = float(rate_limit) if rate_limit is not None else float("nan")
        if not rate > 0:
            raise ValueError(f"MCP tool config.rate_limit={rate_limit!r} must be a positive number of calls per second")
        self.rate_limit = rate
        self.tokens = rate
        self._clock = clock
        self.last_update = clock()
        self.lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self.tokens = min(self.rate_limit, self.tokens + (now - self.last_update) * self.rate_limit)
        self.last_update = now

    def acquire(self) -> bool:
        with self.lock:
            self._refill()
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False

    def seconds_until_available(self) -> float:
        """How long until `acquire()` can succeed (0 when it can now)."""
        with self.lock:
            self._refill()
            return max(0.0, (1 - self.tokens) / self.rate_limit)


def mcp2openai(mcp_tool: Any) -> dict:
    """An MCP `Tool` (name, description, input JSON schema) as an OpenAI function tool schema (a dict, `strict`
    off, `required` always present). The input schema is copied: the server's object is not modified."""
    schema = getattr(mcp_tool, "input_schema", None)  # MCP SDK 2's name
    if schema is None:
        schema = getattr(mcp_tool, "inputSchema", None)
    parameters = copy.deepcopy(dict(schema or {"type": "object", "properties": {}}))
    if not parameters.get("required"):
        parameters["required"] = []
    return {
        "type": "function",
        "function": {
            "name": mcp_tool.name,
            "description": mcp_tool.description or "",
            "parameters": parameters,
            "strict": False,
        },
    }
