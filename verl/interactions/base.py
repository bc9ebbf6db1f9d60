"""`BaseInteraction`: a simulated user that answers the model between its turns.

The tool agent loop (`agent_name="tool_agent"`) calls an interaction when a model turn calls no
tool: `generate_response` sees the conversation so far and returns whether to stop, the user's
reply (appended as a `user` turn, masked out of training), a turn score and metrics. One instance
serves every episode of a rollout concurrently, so per-episode state is keyed by `instance_id`
(started by `start_interaction`, dropped by `finalize_interaction`). The method names and their
return shapes are upstream verl's, so an interaction written for upstream runs here unchanged.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4


class BaseInteraction:
    """A simulated user (module docstring). `config` is the YAML entry's `config`, plus its `name`."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        """Begin one episode; kwargs are the sample's `interaction_kwargs`. Returns the episode's id."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate_sequence, user reply, turn score, metrics) for the conversation so far."""
        return False, "Your current result seems acceptable.", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        """The episode's score so far."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        """Release the episode's state."""
