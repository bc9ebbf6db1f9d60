"""Agent loops: multi-turn rollouts in which the model calls tools (docs/multi_turn.md).

- `agent_loop`: the interface (`AgentLoopBase.run_episode(engine, sample) -> Trajectory`), the
  registry (`register`, `AGENT_LOOPS`) and `SingleTurnAgentLoop` (`single_turn_agent`).
- `tool_agent_loop.ToolAgentLoop` (`tool_agent`): generate, call tools, append their answers, repeat;
  upstream's state machine (`AgentState`, `AgentData`, the `_handle_*_state` handlers) for subclasses.
- `tool_parser`: tool-call formats (`hermes`, `gpt-oss`): `parse(text)`, and upstream's
  `ToolParser.get_tool_parser(name, tokenizer)` / `extract_tool_calls(ids) -> (content, [FunctionCall])`.
- `engine`: `AsyncRolloutEngine` (one request per call) and `MicroBatchEngine` (batches concurrent
  requests for a batch-synchronous engine).
- `rollout.AgentLoopRollout`: a `BaseRollout` running agent loops over any rollout engine; the actor
  worker uses it when `actor_rollout_ref.rollout.multi_turn.enable=true`.

Importing this package imports torch but not transformers or Ray.
"""

from verl.experimental.agent_loop.agent_loop import (
    AGENT_LOOPS,
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopSettings,
    AgentSample,
    AsyncLLMServerManager,
    DictConfigWrap,
    SingleTurnAgentLoop,
    Trajectory,
    get_agent_loop_class,
    register,
    register_agent_loops_from_file,
)
from verl.experimental.agent_loop.engine import AsyncRolloutEngine, MicroBatchEngine, TokenOutput
from verl.experimental.agent_loop.rollout import AgentLoopRollout, settings_from_config
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import (
    TOOL_PARSERS,
    FunctionCall,
    HermesToolParser,
    ToolCall,
    ToolParser,
    get_tool_parser,
)

__all__ = [
    "AGENT_LOOPS",
    "AgentLoopBase",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "AgentLoopRollout",
    "AgentLoopSettings",
    "AgentSample",
    "AsyncLLMServerManager",
    "AsyncRolloutEngine",
    "DictConfigWrap",
    "FunctionCall",
    "HermesToolParser",
    "MicroBatchEngine",
    "SingleTurnAgentLoop",
    "TOOL_PARSERS",
    "TokenOutput",
    "ToolAgentLoop",
    "ToolCall",
    "ToolParser",
    "Trajectory",
    "get_agent_loop_class",
    "get_tool_parser",
    "register",
    "register_agent_loops_from_file",
    "settings_from_config",
]


def __getattr__(name: str):
    # upstream's `AgentLoopManager` is public here; it drives the trainer's worker groups, so it lives with the
    # trainer (verl.trainer.ppo.agent_loop_manager) and is imported only when asked for (no Ray at import)
    if name == "AgentLoopManager":
        from verl.trainer.ppo.agent_loop_manager import AgentLoopManager

        return AgentLoopManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
