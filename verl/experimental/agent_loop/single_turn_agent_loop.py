"""Upstream's module path of `SingleTurnAgentLoop` (`single_turn_agent`), defined in `agent_loop`."""

from verl.experimental.agent_loop.agent_loop import SingleTurnAgentLoop

__all__ = ["SingleTurnAgentLoop"]
