"""`verl.workers.rollout.schemas.Message`: upstream's chat message model, which agent loops and
reward managers written against upstream (the collabllm recipe) import to hold a conversation.

Only `Message` is here. Upstream's module also holds the request state of its SGLang multi-turn
rollout (`AsyncRolloutRequest` and its enums); this project's multi-turn rollout is the agent loop
(verl/experimental/agent_loop), which has no such request object, so those are left out.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from verl.tools.schemas import OpenAIFunctionToolCall, ToolResponse


class Message(BaseModel):
    """One chat message: `role` (system, user, assistant, tool), its `content` (text, or structured
    content) and the assistant's parsed `tool_calls`, if any."""

    role: str
    content: str | dict[str, Any] | list[dict[str, Any]] | ToolResponse
    tool_calls: list[OpenAIFunctionToolCall] | None = None


__all__ = ["Message"]
