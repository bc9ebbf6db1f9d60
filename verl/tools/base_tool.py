"""`BaseTool`: the interface of a tool the model can call during a multi-turn rollout.

It is upstream verl's interface, so a tool class written for upstream loads from the same tool
config: `__init__(config, tool_schema)`, and per conversation `create` -> `execute` (any number of
times) -> `release`, each a coroutine. One tool object serves every conversation of a rollout at
once; `create` returns an instance id under which a stateful tool keeps per-conversation state.

Additions, all optional for a subclass:
- `timeout_s` (from `config["timeout"]`, default `DEFAULT_TIMEOUT_S`): the agent loop cancels an
  `execute` that runs longer and answers the model with a timeout error instead. A coroutine is
  cancelled at its next await; a tool that blocks the event loop cannot be interrupted, so blocking
  work belongs in a thread (`asyncio.to_thread`) or a subprocess (see `sandbox_python_tool`).
- `execute` may return a plain string or `{"text": ...}` instead of a `ToolResponse`, and `create`
  a bare instance id (upstream's older signature); the agent loop accepts all of them.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

DEFAULT_TIMEOUT_S = 30.0


class BaseTool:
    """A tool: a name and schema shown to the model, and the coroutine that runs a call."""

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | dict | None):
        self.config = dict(config or {})
        if isinstance(tool_schema, dict):
            tool_schema = OpenAIFunctionToolSchema.model_validate(tool_schema)
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(
                f"{type(self).__name__} has no tool schema: give one in the tool config (tool_schema: ...) or "
                "override get_openai_tool_schema()"
            )
        self.name = self.tool_schema.function.name
        timeout = self.config.get("timeout", DEFAULT_TIMEOUT_S)
        if timeout is None or float(timeout) <= 0:
            raise ValueError(f"tool {self.name!r}: config.timeout={timeout!r} must be a positive number of seconds")
        self.timeout_s = float(timeout)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    def schema_dict(self) -> dict[str, Any]:
        """The schema as the JSON object chat templates receive in `tools=[...]`."""
        return self.tool_schema.model_dump(exclude_none=True)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Start a conversation's use of the tool; `kwargs["create_kwargs"]` holds the sample's
        `extra_info.tools_kwargs[<name>].create_kwargs`."""
        return instance_id or uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run one call; returns (response, step reward, metrics)."""
        raise NotImplementedError(f"{type(self).__name__}.execute")

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """End a conversation's use of the tool (free its state)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, timeout_s={self.timeout_s})"
