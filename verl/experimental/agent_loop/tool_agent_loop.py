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
stop or a turn limit is reached. Unlike upstream, the stopping reply is not appended: the
conversation still ends on the model's turn. Each reply's score is kept in `turn_scores`.

Tool failures never end an episode: an unknown tool, malformed call, exception or timeout becomes
an `Error: ...` tool message, so the model is told what went wrong.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopSettings,
    AgentSample,
    Trajectory,
    register,
)
from verl.experimental.agent_loop.engine import AsyncRolloutEngine
from verl.experimental.agent_loop.tool_parser import ParsedTurn, ToolCall, get_tool_parser
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


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Multi-turn tool calling (module docstring)."""

    def __init__(self, tokenizer, settings: AgentLoopSettings, tools: Sequence = (), interactions: dict | None = None):
        super().__init__(tokenizer, settings, tools, interactions)
        self.parser = get_tool_parser(settings.format)
        self.tool_schemas = [tool.schema_dict() for tool in tools]
        self._anchor_cache: dict[int, tuple[list[int], int]] = {}

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
    async def call_tool(self, call: ToolCall, tools_kwargs: dict) -> tuple[str, bool]:
        """(text for the model, whether the call succeeded); a traced span per call."""
        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return f"Error: unknown tool {call.name!r}; available tools: {available}", False
        kwargs = tools_kwargs.get(call.name) or {}
        instance_id = None
        try:
            created = await asyncio.wait_for(tool.create(create_kwargs=kwargs.get("create_kwargs", {})), tool.timeout_s)
            instance_id = created[0] if isinstance(created, tuple) else created
            result = await asyncio.wait_for(
                tool.execute(instance_id, call.arguments, **kwargs.get("execute_kwargs", {})), tool.timeout_s
            )
            return _response_text(result), True
        except (asyncio.TimeoutError, TimeoutError):
            return f"Error: tool {call.name!r} timed out after {tool.timeout_s:g} s", False
        except Exception as e:
            logger.debug("tool %s raised", call.name, exc_info=True)
            return f"Error: {e}" if str(e) else f"Error: {type(e).__name__}", False
        finally:
            if instance_id is not None:
                try:
                    await asyncio.wait_for(tool.release(instance_id), tool.timeout_s)
                except Exception:
                    logger.warning("releasing tool %s instance %s failed", call.name, instance_id, exc_info=True)

    async def answer_tool_calls(self, parsed: ParsedTurn, tools_kwargs: dict) -> tuple[list[dict], int]:
        """The tool messages answering a turn, in call order, and how many of them are errors."""
        limit = self.settings.max_parallel_calls
        run, skipped = parsed.tool_calls[:limit], parsed.tool_calls[limit:]
        results = list(await asyncio.gather(*(self.call_tool(call, tools_kwargs) for call in run)))
        results += [
            (f"Error: at most {limit} tool call(s) per turn are run; {c.name!r} was skipped", False) for c in skipped
        ]
        results += [(f"Error: {message}", False) for message in parsed.errors]
        s = self.settings
        messages = [
            {"role": "tool", "content": truncate_text(text, s.max_tool_response_length, s.tool_response_truncate_side)}
            for text, _ in results
        ]
        return messages, sum(1 for _, ok in results if not ok)

    # -------------------------------------------------------------------------------- episode
    def interaction_for(self, sample: AgentSample):
        """The sample's simulated user, or None when no interactions are configured."""
        if not self.interactions:
            return None
        kwargs = sample.interaction_kwargs or {}
        name = kwargs.get("name")
        if name not in self.interactions:
            raise ValueError(
                f"sample {sample.index} asks for interaction {name!r} (extra_info.interaction_kwargs.name), but the "
                f"interaction config defines {sorted(self.interactions)}; set the name in the data or add the "
                "interaction to actor_rollout_ref.rollout.multi_turn.interaction_config_path"
            )
        return self.interactions[name]

    async def run_episode(self, engine: AsyncRolloutEngine, sample: AgentSample) -> Trajectory:
        interaction = self.interaction_for(sample)
        if interaction is None:
            return await self._run_episode(engine, sample, None, None)
        kwargs = dict(sample.interaction_kwargs)
        instance_id = await interaction.start_interaction(None, **kwargs)
        try:
            return await self._run_episode(engine, sample, interaction, instance_id)
        finally:
            await interaction.finalize_interaction(instance_id)

    async def _run_episode(self, engine, sample: AgentSample, interaction, instance_id) -> Trajectory:
        s = self.settings
        prompt_ids = self.prompt_ids(sample)
        messages = None if sample.messages is None else [dict(m) for m in sample.messages]
        response_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] | None = []
        assistant_turns = user_turns = num_calls = num_errors = 0
        turn_scores: list[float] = []
        if interaction is not None and messages is None:
            messages = []  # the interaction reads the conversation; without the prompt's messages, the model's turns
        tool_s = 0.0
        while True:
            out = await engine.generate(
                prompt_ids + response_ids, sample.sampling, s.response_length - len(response_ids)
            )
            response_ids += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs = None if logprobs is None or out.log_probs is None else logprobs + list(out.log_probs)
            assistant_turns += 1
            body = out.token_ids[:-1] if out.stopped else out.token_ids
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            if messages is not None:
                messages.append({"role": "assistant", "content": text})
            if not out.stopped or len(response_ids) >= s.response_length:
                break
            if (s.max_assistant_turns and assistant_turns >= s.max_assistant_turns) or (
                s.max_user_turns and user_turns >= s.max_user_turns
            ):
                break
            parsed = self.parser.parse(
                self.tokenizer.decode(body, skip_special_tokens=not self.parser.keep_special_tokens)
            )
            if not parsed.wants_tools and interaction is None:
                break
            if parsed.wants_tools:
                start = time.perf_counter()
                tool_messages, errors = await self.answer_tool_calls(parsed, sample.tools_kwargs)
                tool_s += time.perf_counter() - start
                num_calls += len(tool_messages)
                num_errors += errors
            else:
                stop, reply, score, _ = await interaction.generate_response(
                    instance_id, messages, **sample.interaction_kwargs
                )
                if score is not None:
                    turn_scores.append(float(score))
                if stop:
                    break
                tool_messages = [{"role": "user", "content": reply}]
            inserted = self.tool_turn_ids(tool_messages, end_of_turn=out.token_ids[-1])
            if len(response_ids) + len(inserted) >= s.response_length:
                break  # no room left for the model to answer: end on its own turn
            response_ids += inserted
            mask += [0] * len(inserted)
            if logprobs is not None:
                logprobs += [0.0] * len(inserted)
            if messages is not None:
                messages.extend(tool_messages)
            user_turns += 1

        metrics = {"tool_calls": float(num_calls), "tool_errors": float(num_errors), "tool_s": tool_s}
        if messages is not None and out.stopped and s.tokenization_sanity_check_mode != "disable":
            ids = prompt_ids + response_ids
            metrics["tokenization_mismatch"] = float(not self._matches_template(messages, ids, out.token_ids[-1]))
        return Trajectory(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
            response_logprobs=logprobs if logprobs else None,
            num_turns=1 + assistant_turns + user_turns,
            messages=messages,
            metrics=metrics,
            turn_scores=turn_scores,
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
