"""Upstream's per-episode agent-loop API, served by this project's rollout.

Upstream verl writes an agent loop as a class built once per episode with
`(trainer_config, server_manager, tokenizer, processor, dataset_cls, dataset_config, **kwargs)`
whose `async run(sampling_params, **row) -> AgentLoopOutput` talks to the model through
`server_manager.generate(request_id, prompt_ids=..., sampling_params=...)`. This project's own
interface is `AgentLoopBase.run_episode(engine, sample) -> Trajectory` with one instance for all
episodes (agent_loop.py). Loops written against upstream's API run here unchanged: `AgentLoopBase`
accepts either style, and `AgentLoopRollout` runs an upstream-style class through
`UpstreamLoopRunner` (agent_loop.py), which builds it per episode with the objects below.

What the objects here are, against upstream's:
- `AgentLoopOutput` / `AgentLoopMetrics`: the same pydantic models and fields. The rollout turns an
  output into its batch row as upstream does: `reward_score` (when every episode of the call has one)
  becomes `rm_scores` at the last response token, so no reward function runs for that batch; each
  `extra_fields` key becomes a non-tensor column (None where an episode lacks it), `turn_scores`
  included; `metrics` are averaged into `agent_loop/generate_sequences` and `agent_loop/tool_calls`.
  `multi_modal_data` and `routed_experts` are refused (neither is supported by this rollout).
- `AsyncLLMServerManager`: upstream balances requests over several inference servers and keeps a
  conversation on one (`request_id`); here one engine per rollout worker serves every episode, so the
  manager forwards to that engine and `request_id` only has to be given. Sampling keys: `temperature`,
  `top_k`, `top_p`, `max_tokens` / `max_new_tokens` (default: `rollout.response_length`, since longer
  turns are cut to it anyway), `logprobs` (the engine computes them with
  `rollout.calculate_log_probs`), `repetition_penalty` (only 1.0); any other key is refused.
- `DictConfigWrap`: the same holder. `trainer_config.config` is the worker's view of the run:
  `actor_rollout_ref` in full, `data` with what the worker has of it (`apply_chat_template_kwargs`);
  other sections are absent (the worker is not given them).

Loops that subclass upstream's `ToolAgentLoop` and drive its internals (`AgentData`, `AgentState`,
the `_handle_*_state` methods) run too: this project's `ToolAgentLoop` is upstream's state machine
(tool_agent_loop.py). Not served: images or videos (`processor` is None).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from verl.experimental.agent_loop.engine import AsyncRolloutEngine, TokenOutput

SAMPLING_PARAMS = ("temperature", "top_k", "top_p", "max_tokens", "max_new_tokens", "logprobs", "repetition_penalty")
"""The keys of upstream's `sampling_params` this rollout serves."""


class AgentLoopMetrics(BaseModel):
    """Timing of one episode (seconds), as upstream reports it."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    num_preempted: int = -1
    """-1: the engine does not say (upstream's value when unavailable)."""


class AgentLoopOutput(BaseModel):
    """What an upstream-style loop's `run` returns (module docstring)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: list[int]
    response_ids: list[int]
    """Everything after the prompt: the model's tokens and the tokens the loop inserted."""
    response_mask: list[int]
    """1 on the model's tokens, 0 on inserted ones."""
    response_logprobs: list[float] | None = None
    routed_experts: Any | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics = Field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = Field(default_factory=dict)


class DictConfigWrap:
    """Holds a config so that it is passed as one object (upstream's name and attribute)."""

    def __init__(self, config):
        self.config = config


class AsyncLLMServerManager:
    """Upstream's `server_manager` over this rollout's engine for one episode (module docstring)."""

    def __init__(self, engine: AsyncRolloutEngine, episode_sampling: Mapping[str, Any], response_length: int):
        self.engine = engine
        self.episode_sampling = dict(episode_sampling)
        """The call's own sampling keys (`do_sample`, `validate`, ...), passed with every turn."""
        self.response_length = int(response_length)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any],
        image_data: Any = None,
        video_data: Any = None,
    ) -> TokenOutput:
        """Continue `prompt_ids` with the loop's sampling params; returns the engine's `TokenOutput`
        (`token_ids`, `log_probs`, and `stop_reason` as upstream's)."""
        if request_id is None:
            raise ValueError("server_manager.generate needs a request_id (upstream keeps a conversation on it)")
        if image_data is not None or video_data is not None:
            raise ValueError(
                "images and videos are not supported by this rollout's agent loops (multi-modal prompts are "
                "left out; see docs/multi_turn.md)"
            )
        sampling, max_new_tokens = self.sampling(sampling_params)
        return await self.engine.generate(list(prompt_ids), sampling, max_new_tokens)

    def sampling(self, sampling_params: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """(the engine's sampling dict, max new tokens) from upstream-style `sampling_params`."""
        unknown = sorted(set(sampling_params) - set(SAMPLING_PARAMS))
        if unknown:
            raise ValueError(
                f"sampling_params keys {unknown} are not supported by this rollout's engines; supported: "
                f"{list(SAMPLING_PARAMS)}"
            )
        penalty = sampling_params.get("repetition_penalty", 1.0)
        if penalty is not None and float(penalty) != 1.0:
            raise ValueError(
                f"sampling_params repetition_penalty={penalty} is not supported by this rollout's engines (only 1.0)"
            )
        sampling = dict(self.episode_sampling)
        for key in ("temperature", "top_k", "top_p"):
            if sampling_params.get(key) is not None:
                sampling[key] = sampling_params[key]
        limit = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
        max_new_tokens = self.response_length if limit is None else min(int(limit), self.response_length)
        return sampling, max(0, max_new_tokens)


def upstream_sampling_params(rollout_config, validate: bool, with_logprobs: bool) -> dict[str, Any]:
    """The `sampling_params` upstream gives `run`: the rollout's temperature, top_p and top_k (its
    `val_kwargs` ones in validation), repetition_penalty 1.0 and whether log-probs are computed."""
    source = rollout_config.val_kwargs if validate else rollout_config
    return {
        "temperature": source.temperature,
        "top_p": source.top_p,
        "top_k": source.top_k,
        "repetition_penalty": 1.0,
        "logprobs": bool(with_logprobs),
    }


__all__ = [
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "AsyncLLMServerManager",
    "DictConfigWrap",
    "upstream_sampling_params",
]
