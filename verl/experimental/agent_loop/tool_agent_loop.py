"""`ToolAgentLoop` (`agent_name="tool_agent"`): generate, run the tools the model calls, repeat.

Each round: the model generates a turn; if the turn calls tools (`multi_turn.format`, see
tool_parser.py), the calls run concurrently (each with its tool's timeout), their results are
appended as `tool` messages through the chat template, and the model continues. The episode ends
when a turn calls no tool, when the turn did not end on a stop token (the response budget ran out),
at `max_assistant_turns` / `max_user_turns`, or when the tool answers would leave no room for
another model turn (the conversation always ends on a model turn, so the outcome reward sits on a
generated token).

Token-exact by construction: the context of every turn is `prompt_ids + response_ids` so far, where
the model's turns are its sampled ids verbatim and only the tool turns are tokenised. A tool turn's
ids are the chat template's rendering of a fixed two-message conversation plus the tool messages
(with the generation prompt), minus that conversation's rendering up to and including its
end-of-turn token (the token the model's turn ended on). So the tool turn carries exactly what the
template puts between the end of an assistant turn and the start of the next one (Qwen's newline
after `<|im_end|>` included), and the full sequence is what the template renders for the whole
conversation. `tokenization_sanity_check_mode` re-renders each finished conversation from its
messages and reports any difference as the `agent_loop/tokenization_mismatch` metric (with one
warning per process), instead of silently training on drifted ids.

With a simulated user (`multi_turn.interaction_config_path`, verl/interactions/), a turn that calls
no tool goes to the sample's interaction (`interaction_kwargs.name`): its reply becomes a `user`
turn (inserted like a tool turn, mask 0) and the model answers again, until the interaction says
stop or a turn limit is reached. Unlike upstream, the stopping reply is not appended to the ids
(only to the messages): the trained sequence still ends on the model's turn. Each reply's score is
kept in `turn_scores`.

Tool failures never end an episode: an unknown tool, malformed call, exception or timeout becomes
an `Error: ...` tool message, so the model is told what went wrong.

Upstream's internals, for loops that subclass `ToolAgentLoop` (the collabllm recipe): the turn logic
is upstream's state machine (`AgentState`, `AgentData`, `_handle_pending_state`,
`_handle_generating_state`, `_handle_processing_tools_state`, `_handle_interacting_state`, with
upstream's signatures, return states and `AgentData` bookkeeping: `prompt_ids` is the whole sequence
so far, `response_mask` / `response_logprobs` its response part, `response_ids` the last model turn).
Both entry points drive the same handlers, so the turn logic exists once: `run_episode(engine,
sample)` (this project's API, one instance for all episodes: each episode runs on a shallow copy that
holds the episode's server manager) and upstream's `run(sampling_params, **row)` (one instance per
episode, built with upstream's constructor, which reads the tools and interactions from
`multi_turn.tool_config_path` / `interaction_config_path` as upstream does). The rollout treats a
subclass that overrides `run`, or neither entry point, as upstream-style (`uses_upstream_api`).

Where the handlers differ from upstream's, on purpose: a tool or user turn is rendered token-exactly
(above), not by rendering its messages alone; each model turn is asked for at most the tokens left in
the response budget, and a turn that did not end on a stop token ends the episode; every assistant
turn is appended to `messages` (upstream appends it only with an interaction); a reply or tool answer
that would leave no room for another model turn, or an interaction's stopping reply, is appended to
`messages` (as upstream) but not to the ids, and is not counted in `user_turns` (the episode ends on
the model's turn); `metrics["num_preempted"]` is -1 (the engines here do not report preemption).

Tools run through two layers. Upstream's per-call helper `_call_tool(tool_call, tools_kwargs,
agent_data) -> (ToolResponse, reward, metrics)` is what the turn logic calls, once per call of the
turn (concurrently), with the call as upstream's `FunctionCall` (arguments as JSON text); a recipe
subclass overrides it as upstream's do. The base one decodes the arguments and runs this project's
`call_tool(call, tools_kwargs) -> (text, succeeded, reward)` (the traced span, with the tool's
timeout), counts a failed call, and truncates the text as upstream's does. Where it differs from
upstream's: a tool that gave no step reward gives None (not appended to `tool_rewards`), the metrics
dict is empty, and the tool's `execute` is not passed `agent_data`. `agent_data.tool_calls` holds
`FunctionCall`s, as upstream's; `self.tool_parser` is built with the tokenizer, so upstream's
`await self.tool_parser.extract_tool_calls(ids)` works in a subclass (tool_parser.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Sequence
from enum import Enum
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopSettings,
    AgentSample,
    Trajectory,
    register,
)
from verl.experimental.agent_loop.engine import AsyncRolloutEngine
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolCall, get_tool_parser
from verl.experimental.agent_loop.upstream_api import AgentLoopOutput, AsyncLLMServerManager
from verl.interactions.utils.interaction_registry import initialize_interactions_from_config
from verl.tools.schemas import ToolResponse
from verl.tools.utils.tool_registry import initialize_tools_from_config
from verl.utils.rollout_trace import rollout_trace_op

logger = logging.getLogger(__name__)

# The conversation whose rendering anchors a tool turn's ids (see the module docstring).
_ANCHOR = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
_warned_mismatch = False


def truncate_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters: left keeps the beginning, right the end, middle both ends."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half) :]


def _response_text(result) -> str:
    """The text of whatever a tool's execute returned (ToolResponse, dict, str or tuple of them)."""
    if isinstance(result, tuple):
        result = result[0]
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        return str(result.get("text") or "")
    return str(getattr(result, "text", None) or "")


def _add_time(metrics: dict, key: str, start: float) -> None:
    """Add the seconds since `start` to `metrics[key]` (upstream's `simple_timer` accumulates the same way)."""
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


class AgentState(Enum):
    """Upstream's states of one episode's state machine."""

    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"
    INTERACTING = "interacting"


class AgentData:
    """One episode's state, as upstream's (its constructor, fields and their meaning), plus this
    project's bookkeeping (the last four fields). Subclasses may keep their own data in `extra_fields`."""

    def __init__(
        self,
        messages: list[dict[str, Any]] | None,
        image_data: Any = None,
        video_data: Any = None,
        metrics: dict[str, Any] | None = None,
        request_id: str | None = None,
        tools_kwargs: dict[str, Any] | None = None,
        interaction: Any = None,
        interaction_kwargs: dict[str, Any] | None = None,
    ):
        if image_data or video_data:
            raise ValueError(
                "images and videos are not supported by this rollout's agent loops (multi-modal prompts are left "
                "out; see docs/multi_turn.md)"
            )
        self.messages = messages
        self.image_data = image_data
        self.video_data = video_data
        self.metrics = {} if metrics is None else metrics
        self.request_id = request_id or uuid4().hex
        self.tools_kwargs = tools_kwargs or {}
        self.interaction = interaction
        self.interaction_kwargs = interaction_kwargs or {}

        self.prompt_ids: list[int] = []
        """The whole sequence so far: the prompt, then every model and inserted turn."""
        self.response_ids: list[int] = []
        """The last model turn's tokens."""
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.turn_scores: list[float] = []
        self.tool_rewards: list[float] = []
        self.user_turns = 0
        self.assistant_turns = 0
        self.tool_calls: list[FunctionCall] = []
        """The well-formed calls of the last model turn (upstream's type: arguments as JSON text)."""
        self.extra_fields: dict[str, Any] = {}

        self.tool_call_errors: list[str] = []
        """The last model turn's malformed calls (each answered with an error message)."""
        self.end_of_turn: int | None = None
        """The stop token the last model turn ended on (None: it ran out of tokens)."""
        self.num_tool_calls = 0
        self.num_tool_errors = 0


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Multi-turn tool calling and simulated users (module docstring)."""

    def _init_episodes(self, tokenizer, settings: AgentLoopSettings, tools: Sequence = (), interactions=None):
        super()._init_episodes(tokenizer, settings, tools, interactions)
        self._init_tool_loop()

    def _init_upstream(self, trainer_config, server_manager, tokenizer, processor=None, dataset_cls=None,
                       dataset_config=None, **kwargs):  # fmt: skip
        super()._init_upstream(trainer_config, server_manager, tokenizer, processor, dataset_cls, dataset_config)
        self.settings = AgentLoopSettings.from_rollout_config(
            self.config.actor_rollout_ref.rollout, self.apply_chat_template_kwargs
        )
        path = self.config.actor_rollout_ref.rollout.multi_turn.tool_config_path
        self.tools = {tool.name: tool for tool in (initialize_tools_from_config(path) if path else [])}
        self.interactions = self._initialize_interactions(self.settings.interaction_config_path)
        self._init_tool_loop()

    def _init_tool_loop(self):
        """Upstream's attributes, from the settings (both constructors)."""
        s = self.settings
        self.parser = get_tool_parser(s.format, self.tokenizer)
        self.tool_parser, self.tool_parser_name = self.parser, s.format
        self.tool_schemas = [tool.schema_dict() for tool in self.tools.values()]
        self.max_user_turns, self.max_assistant_turns = s.max_user_turns, s.max_assistant_turns
        self.max_parallel_calls = s.max_parallel_calls
        self.max_tool_response_length = s.max_tool_response_length
        self.tool_response_truncate_side = s.tool_response_truncate_side
        self.prompt_length, self.response_length = s.prompt_length, s.response_length
        self.interaction_config_file = s.interaction_config_path
        self.interaction_map = self.interactions
        self._anchor_cache: dict[int, tuple[list[int], int]] = {}

    def _initialize_interactions(self, interaction_config_file) -> dict:
        """Upstream's helper: the interactions of a config file by name ({} without a file)."""
        if not interaction_config_file:
            return {}
        return initialize_interactions_from_config(interaction_config_file)

    # ------------------------------------------------------------------------------ templates
    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tool_schemas or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.settings.apply_chat_template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, sample: AgentSample) -> list[int]:
        """The dataset's prompt, re-rendered with the tool schemas when there are tools to show."""
        if sample.messages is not None and self.tool_schemas:
            return self._encode(self._render([dict(m) for m in sample.messages], add_generation_prompt=True))
        return list(sample.prompt_ids)

    def _anchor(self, end_of_turn: int) -> tuple[list[int], int]:
        """The anchor conversation's ids and the index just past its last `end_of_turn` token."""
        if end_of_turn not in self._anchor_cache:
            ids = self._encode(self._render(_ANCHOR, add_generation_prompt=False))
            cut = max((i + 1 for i, t in enumerate(ids) if t == end_of_turn), default=len(ids))
            self._anchor_cache[end_of_turn] = (ids, cut)
        return self._anchor_cache[end_of_turn]

    def tool_turn_ids(self, tool_messages: list[dict], end_of_turn: int) -> list[int]:
        """Ids of the tool messages + generation prompt that follow a model turn ending on `end_of_turn`."""
        anchor, cut = self._anchor(end_of_turn)
        full = self._encode(self._render(_ANCHOR + tool_messages, add_generation_prompt=True))
        if full[:cut] != anchor[:cut] and self.settings.tokenization_sanity_check_mode != "disable":
            raise ValueError(
                "the chat template renders the conversation before a tool message differently once the tool "
                "message is added, so tool turns cannot be appended token-exactly; use a template whose renderings "
                "of a conversation prefix are prefixes of each other, or set "
                "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=disable to append them anyway"
            )
        return full[cut:]

    # ---------------------------------------------------------------------------------- tools
    @rollout_trace_op
    async def call_tool(self, call: ToolCall, tools_kwargs: dict) -> tuple[str, bool, float | None]:
        """(text for the model, whether the call succeeded, the tool's step reward); a traced span per call."""
        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return f"Error: unknown tool {call.name!r}; available tools: {available}", False, None
        kwargs = tools_kwargs.get(call.name) or {}
        instance_id = None
        try:
            created = await asyncio.wait_for(tool.create(create_kwargs=kwargs.get("create_kwargs", {})), tool.timeout_s)
            instance_id = created[0] if isinstance(created, tuple) else created
            result = await asyncio.wait_for(
                tool.execute(instance_id, call.arguments, **kwargs.get("execute_kwargs", {})), tool.timeout_s
            )
            reward = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            return _response_text(result), True, None if reward is None else float(reward)
        except (asyncio.TimeoutError, TimeoutError):
            return f"Error: tool {call.name!r} timed out after {tool.timeout_s:g} s", False, None
        except Exception as e:
            logger.debug("tool %s raised", call.name, exc_info=True)
            return (f"Error: {e}" if str(e) else f"Error: {type(e).__name__}"), False, None
        finally:
            if instance_id is not None:
                try:
                    await asyncio.wait_for(tool.release(instance_id), tool.timeout_s)
                except Exception:
                    logger.warning("releasing tool %s instance %s failed", call.name, instance_id, exc_info=True)

    async def _call_tool(
        self, tool_call: FunctionCall, tools_kwargs: dict[str, Any], agent_data: AgentData | None = None
    ) -> tuple[ToolResponse, float | None, dict]:
        """Upstream's per-call helper: the turn logic calls it for each call (module docstring).

        Runs `call_tool` on the decoded call and returns its text (truncated to
        `max_tool_response_length`), the tool's step reward (None: it gave none) and an empty metrics
        dict; a failed call is counted in `agent_data.num_tool_errors`.
        """
        try:
            arguments = json.loads(tool_call.arguments) if tool_call.arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = None
        if isinstance(arguments, dict):
            text, succeeded, reward = await self.call_tool(ToolCall(tool_call.name, arguments), tools_kwargs)
        else:
            text, succeeded, reward = (
                f"Error: the arguments of the call to {tool_call.name!r} are not a JSON object: "
                f"{tool_call.arguments[:200]}",
                False,
                None,
            )
        if not succeeded and agent_data is not None:
            agent_data.num_tool_errors += 1
        text = truncate_text(text, self.max_tool_response_length, self.tool_response_truncate_side)
        return ToolResponse(text=text), reward, {}

    async def answer_tool_calls(self, agent_data: AgentData) -> tuple[list[dict], list[float]]:
        """The tool messages answering the last turn, in call order, and the step rewards the tools gave.

        The first `max_parallel_calls` calls run concurrently through `_call_tool`; calls past that
        limit and malformed calls are answered with an error message (counted in `num_tool_errors`).
        """
        limit = self.max_parallel_calls
        run, skipped = agent_data.tool_calls[:limit], agent_data.tool_calls[limit:]
        answers = await asyncio.gather(*(self._call_tool(call, agent_data.tools_kwargs, agent_data) for call in run))
        errors = [f"Error: at most {limit} tool call(s) per turn are run; {c.name!r} was skipped" for c in skipped]
        errors += [f"Error: {message}" for message in agent_data.tool_call_errors]
        agent_data.num_tool_errors += len(errors)
        texts = [response.text or "" for response, _, _ in answers]
        texts += [truncate_text(e, self.max_tool_response_length, self.tool_response_truncate_side) for e in errors]
        rewards = [float(reward) for _, reward, _ in answers if reward is not None]
        return [{"role": "tool", "content": text} for text in texts], rewards

    # ------------------------------------------------------------------------ state machine
    async def _handle_pending_state(self, agent_data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        """Render the prompt messages (with the tool schemas) into `prompt_ids`; next: GENERATING."""
        agent_data.prompt_ids = self._encode(self._render(list(agent_data.messages), add_generation_prompt=True))
        return AgentState.GENERATING

    async def _handle_generating_state(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        """One model turn; next: TERMINATED (budget, turn limits, or nothing to answer), PROCESSING_TOOLS
        (it called tools) or INTERACTING (a simulated user answers). `ignore_termination` skips the
        budget check only, as upstream's."""
        params = dict(sampling_params)
        budget = self.response_length - len(agent_data.response_mask)
        limit = params.pop("max_tokens", params.pop("max_new_tokens", None))
        params["max_tokens"] = max(1, budget if limit is None else min(int(limit), budget))
        start = time.perf_counter()
        out = await self.server_manager.generate(
            request_id=agent_data.request_id, prompt_ids=list(agent_data.prompt_ids), sampling_params=params
        )
        _add_time(agent_data.metrics, "generate_sequences", start)
        agent_data.metrics.setdefault("num_preempted", -1)
        agent_data.assistant_turns += 1
        agent_data.response_ids = list(out.token_ids)
        agent_data.prompt_ids += agent_data.response_ids
        agent_data.response_mask += [1] * len(out.token_ids)
        if out.log_probs:
            agent_data.response_logprobs += list(out.log_probs)
        agent_data.end_of_turn = out.token_ids[-1] if out.stopped and out.token_ids else None
        body = out.token_ids[:-1] if agent_data.end_of_turn is not None else out.token_ids
        if agent_data.messages is not None:
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            agent_data.messages.append({"role": "assistant", "content": text})

        if not ignore_termination and (
            agent_data.end_of_turn is None or len(agent_data.response_mask) >= self.response_length
        ):
            return AgentState.TERMINATED
        if self.max_assistant_turns and agent_data.assistant_turns >= self.max_assistant_turns:
            return AgentState.TERMINATED
        if self.max_user_turns and agent_data.user_turns >= self.max_user_turns:
            return AgentState.TERMINATED
        parsed = self.parser.parse(self.tokenizer.decode(body, skip_special_tokens=not self.parser.keep_special_tokens))
        agent_data.tool_calls = [
            FunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)) for c in parsed.tool_calls
        ]
        agent_data.tool_call_errors = list(parsed.errors)
        if parsed.wants_tools:
            return AgentState.PROCESSING_TOOLS
        if agent_data.interaction is not None:
            return AgentState.INTERACTING
        return AgentState.TERMINATED

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        """Run the last turn's calls and append their answers (mask 0); next: GENERATING, or TERMINATED
        when the answers would leave no room for another model turn."""
        start = time.perf_counter()
        messages, rewards = await self.answer_tool_calls(agent_data)
        _add_time(agent_data.metrics, "tool_calls", start)
        agent_data.num_tool_calls += len(messages)
        agent_data.tool_rewards += rewards
        return self._append_turn(agent_data, messages)

    async def _handle_interacting_state(self, agent_data: AgentData) -> AgentState:
        """The simulated user's reply (its score into `turn_scores`); next: TERMINATED when it says stop
        or no room is left, else GENERATING with the reply appended (mask 0)."""
        stop, reply, score, _ = await agent_data.interaction.generate_response(
            agent_data.request_id, agent_data.messages, **agent_data.interaction_kwargs
        )
        if score is not None:
            agent_data.turn_scores.append(float(score))
        message = {"role": "user", "content": reply}
        if stop:
            if agent_data.messages is not None:
                agent_data.messages.append(message)
            return AgentState.TERMINATED
        return self._append_turn(agent_data, [message])

    def _append_turn(self, agent_data: AgentData, messages: list[dict]) -> AgentState:
        """Append tool or user messages after the last model turn (module docstring)."""
        if agent_data.messages is not None:
            agent_data.messages.extend(messages)
        inserted = self.tool_turn_ids(messages, end_of_turn=agent_data.end_of_turn)
        if len(agent_data.response_mask) + len(inserted) >= self.response_length:
            return AgentState.TERMINATED  # no room left for the model to answer: end on its own turn
        agent_data.prompt_ids += inserted
        agent_data.response_mask += [0] * len(inserted)
        if agent_data.response_logprobs:
            agent_data.response_logprobs += [0.0] * len(inserted)
        agent_data.user_turns += 1
        return AgentState.GENERATING

    async def _run_states(self, agent_data: AgentData, sampling_params: dict[str, Any], state: AgentState) -> None:
        """Drive the handlers from `state` until TERMINATED."""
        while state != AgentState.TERMINATED:
            if state == AgentState.PENDING:
                state = await self._handle_pending_state(agent_data, sampling_params)
            elif state == AgentState.GENERATING:
                state = await self._handle_generating_state(agent_data, sampling_params)
            elif state == AgentState.PROCESSING_TOOLS:
                state = await self._handle_processing_tools_state(agent_data)
            elif state == AgentState.INTERACTING:
                state = await self._handle_interacting_state(agent_data)
            else:
                raise ValueError(f"unknown agent state {state!r}")

    def _interaction(self, name, where: str):
        if name not in self.interactions:
            raise ValueError(
                f"{where} asks for interaction {name!r} (extra_info.interaction_kwargs.name), but the "
                f"interaction config defines {sorted(self.interactions)}; set the name in the data or add the "
                "interaction to actor_rollout_ref.rollout.multi_turn.interaction_config_path"
            )
        return self.interactions[name]

    # ---------------------------------------------------------------------------- entry points
    def interaction_for(self, sample: AgentSample):
        """The sample's simulated user, or None when no interactions are configured."""
        if not self.interactions:
            return None
        return self._interaction((sample.interaction_kwargs or {}).get("name"), f"sample {sample.index}")

    async def run_episode(self, engine: AsyncRolloutEngine, sample: AgentSample) -> Trajectory:
        interaction = self.interaction_for(sample)
        messages = None if sample.messages is None else [dict(m) for m in sample.messages]
        if interaction is not None and messages is None:
            messages = []  # the interaction reads the conversation; without the prompt's messages, the model's turns
        agent_data = AgentData(
            messages,
            tools_kwargs=sample.tools_kwargs,
            interaction=interaction,
            interaction_kwargs=dict(sample.interaction_kwargs or {}) if interaction is not None else None,
        )
        agent_data.prompt_ids = self.prompt_ids(sample)
        episode = copy.copy(self)  # this episode's view: the shared loop plus the episode's server manager
        episode.server_manager = AsyncLLMServerManager(engine, sample.sampling, self.settings.response_length)
        if interaction is None:
            await episode._run_states(agent_data, {}, AgentState.GENERATING)
        else:
            await interaction.start_interaction(agent_data.request_id, **agent_data.interaction_kwargs)
            try:
                await episode._run_states(agent_data, {}, AgentState.GENERATING)
            finally:
                await interaction.finalize_interaction(agent_data.request_id)
        return self._trajectory(agent_data)

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        """Upstream's entry point: one episode of the row's `raw_prompt` from PENDING."""
        interaction, interaction_kwargs = None, {}
        if self.interaction_config_file:
            interaction_kwargs = dict(kwargs["extra_info"]["interaction_kwargs"])
            interaction = self._interaction(interaction_kwargs.get("name"), "the row")
        agent_data = AgentData(
            list(kwargs["raw_prompt"]),
            tools_kwargs=kwargs.get("tools_kwargs") or {},
            interaction=interaction,
            interaction_kwargs=interaction_kwargs,
        )
        if interaction is not None:
            await interaction.start_interaction(agent_data.request_id, **interaction_kwargs)
        try:
            await self._run_states(agent_data, sampling_params, AgentState.PENDING)
        finally:
            if interaction is not None:
                await interaction.finalize_interaction(agent_data.request_id)
        return self.agent_loop_output(agent_data)

    def agent_loop_output(self, agent_data: AgentData) -> AgentLoopOutput:
        """The `AgentLoopOutput` of a finished episode, as upstream's `run` builds it."""
        n = len(agent_data.prompt_ids) - len(agent_data.response_mask)
        length = self.response_length
        return AgentLoopOutput(
            prompt_ids=agent_data.prompt_ids[:n],
            response_ids=agent_data.prompt_ids[n:][:length],
            response_mask=agent_data.response_mask[:length],
            response_logprobs=agent_data.response_logprobs[:length] if agent_data.response_logprobs else None,
            num_turns=agent_data.user_turns + agent_data.assistant_turns + 1,
            metrics=agent_data.metrics,
            extra_fields={"turn_scores": agent_data.turn_scores, "tool_rewards": agent_data.tool_rewards},
        )

    def _trajectory(self, agent_data: AgentData) -> Trajectory:
        """This project's `Trajectory` of a finished episode (with the tokenization sanity check)."""
        n = len(agent_data.prompt_ids) - len(agent_data.response_mask)
        s = self.settings
        metrics = {
            "tool_calls": float(agent_data.num_tool_calls),
            "tool_errors": float(agent_data.num_tool_errors),
            "tool_s": float(agent_data.metrics.get("tool_calls", 0.0)),
        }
        messages = agent_data.messages
        if (
            messages is not None
            and agent_data.end_of_turn is not None
            and s.tokenization_sanity_check_mode != "disable"
        ):
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            same = self._matches_template(messages[: last + 1], agent_data.prompt_ids, agent_data.end_of_turn)
            metrics["tokenization_mismatch"] = float(not same)
        return Trajectory(
            prompt_ids=agent_data.prompt_ids[:n],
            response_ids=agent_data.prompt_ids[n:],
            response_mask=list(agent_data.response_mask),
            response_logprobs=list(agent_data.response_logprobs) or None,
            num_turns=1 + agent_data.assistant_turns + agent_data.user_turns,
            messages=messages,
            metrics=metrics,
            turn_scores=list(agent_data.turn_scores),
            tool_rewards=list(agent_data.tool_rewards),
        )

    def _matches_template(self, messages: list[dict], ids: list[int], end_of_turn: int) -> bool:
        """Whether the ids equal the template's rendering of the messages (see sanity check mode).

        The rendering may go on after the last end-of-turn token (Qwen's newline after `<|im_end|>`),
        which the model never generates; that template suffix is appended to the ids before comparing.
        """
        global _warned_mismatch
        anchor, cut = self._anchor(end_of_turn)
        ids = ids + anchor[cut:]
        reference = self._encode(self._render(messages, add_generation_prompt=False))
        if self.settings.tokenization_sanity_check_mode == "ignore_strippable":
            same = "".join(self.tokenizer.decode(reference).split()) == "".join(self.tokenizer.decode(ids).split())
        else:
            same = reference == ids
        if not same and not _warned_mismatch:
            _warned_mismatch = True
            first = next((i for i, (a, b) in enumerate(zip(reference, ids)) if a != b), min(len(reference), len(ids)))
            logger.warning(
                "multi-turn tokenization differs from the chat template's rendering of the same messages at token %d: "
                "rollout %r vs template %r (training uses the rollout's ids; reported as agent_loop/tokenization_mismatch)",
                first,
                self.tokenizer.decode(ids[max(0, first - 8) : first + 8]),
                self.tokenizer.decode(reference[max(0, first - 8) : first + 8]),
            )
        return same
