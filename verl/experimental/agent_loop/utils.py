"""Upstream's agent-loop helpers (`verl.experimental.agent_loop.utils`).

- `resolve_config_path(path)`: an agent-loop config file's absolute path (absolute as given, else found
  in the working directory or the verl checkout; a clear error otherwise), the resolver
  `rollout.agent.agent_loop_config_path` goes through.
- gpt-oss's tool answers written by hand (its chat template renders a tool message only after the
  assistant's call in the same conversation): `format_gpt_oss_tool_response_manually(text, tool_name)`
  -> `<|start|>functions.<tool> to=assistant<|channel|>commentary<|message|><text><|end|>`,
  `add_generation_prompt_for_gpt_oss(text)` appends `<|start|>assistant`, and
  `build_gpt_oss_tool_response_text(messages, tool_names)` joins several answers and adds the prompt.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import resolve_config_path

__all__ = [
    "add_generation_prompt_for_gpt_oss",
    "build_gpt_oss_tool_response_text",
    "format_gpt_oss_tool_response_manually",
    "resolve_config_path",
]


def format_gpt_oss_tool_response_manually(tool_response: str, tool_call_name: str) -> str:
    return f"<|start|>functions.{tool_call_name} to=assistant<|channel|>commentary<|message|>{tool_response}<|end|>"


def add_generation_prompt_for_gpt_oss(message_content: str) -> str:
    return f"{message_content}<|start|>assistant"


def build_gpt_oss_tool_response_text(messages: list[dict[str, Any]], tool_call_names: list[str]) -> str:
    """The tool messages (their `content`), each under the name of the call it answers, then the prompt."""
    if len(tool_call_names) < len(messages):
        raise ValueError(
            f"build_gpt_oss_tool_response_text: {len(messages)} tool messages but {len(tool_call_names)} tool names"
        )
    answers = (format_gpt_oss_tool_response_manually(m["content"], name) for m, name in zip(messages, tool_call_names))
    return add_generation_prompt_for_gpt_oss("".join(answers))
