"""`WeatherInteraction`: upstream verl's demo user for weather queries; rewards a conversation that used a tool.

When the model ends a turn without a tool call, the interaction looks back for the last `tool`
message of the conversation: if there is one, the episode scores 1.0 and the user replies
`THANKS`; if the model never called a tool, it scores 0.0 and the user replies `USE_THE_TOOL`.
Either way the episode ends (upstream's behaviour: the reminder is said, but not acted on). The
tool's content is not checked, only that a tool answered. `ground_truth` from `interaction_kwargs`
is kept with the episode, as upstream does, and not used.

    interaction:
      - name: weather
        class_name: verl.interactions.weather_interaction.WeatherInteraction
        config: {}
"""

from __future__ import annotations

from typing import Any

from verl.interactions.base import BaseInteraction

THANKS = "Thank you for your weather query!"
USE_THE_TOOL = "Please use the weather tool to get the weather information."
NO_TOOL_CALL = "no tool call"
"""The episode's recorded response when the conversation has no tool message (upstream's marker)."""


class WeatherInteraction(BaseInteraction):
    """Scores 1.0 when a tool answered during the conversation, else 0.0, and ends it (module docstring)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> str:
        instance_id = await super().start_interaction(instance_id)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        last_tool = next((m.get("content") for m in reversed(messages) if m.get("role") == "tool"), NO_TOOL_CALL)
        self._instance_dict[instance_id]["response"] = last_tool
        reward = await self.calculate_score(instance_id)
        return True, (THANKS if reward == 1.0 else USE_THE_TOOL), reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0 if self._instance_dict[instance_id]["response"] == NO_TOOL_CALL else 1.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
