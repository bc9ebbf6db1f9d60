"""Option tables owned by the agent loop, for config keys of the rollout section.

The field-metadata helpers (`doc`, the status values and the other option tables) live in
`verl.workers.config._fields`, low enough for `verl.workers.config` to use. These two tables come
from `verl.experimental` (above the workers), so only a config module in the trainer layer may
name them: `validate.py` and `docgen.py` do, for `rollout.multi_turn.format`, and `validate.py` for
`rollout.agent.default_agent_loop` (whose names also come from `agent.agent_loop_config_path`).
"""

from __future__ import annotations


def tool_format_choices() -> tuple[str, ...]:
    """`rollout.multi_turn.format` names: the agent loop's tool-parser table."""
    from verl.experimental.agent_loop.tool_parser import TOOL_PARSERS

    return tuple(TOOL_PARSERS)


def agent_loop_choices() -> tuple[str, ...]:
    """`rollout.agent.default_agent_loop` names: the agent-loop registry."""
    from verl.experimental.agent_loop import AGENT_LOOPS

    return tuple(AGENT_LOOPS)


def agent_loop_file_names(path: str) -> list[str]:
    """The loop names an `agent.agent_loop_config_path` file registers (OSError/ValueError when it
    cannot be found or read as a list of loops)."""
    from verl.experimental.agent_loop.agent_loop import read_agent_loop_config

    return [str(entry["name"]) for entry in read_agent_loop_config(path)]
