"""Reading tool calls out of a model's turn (`actor_rollout_ref.rollout.multi_turn.format`).

The format is a property of the model's chat template: the template shows the tools to the model
and teaches it how to write a call. `hermes` (Qwen2.5/Qwen3, Hermes, and the bundled tiny model's
examples) writes each call as

    <tool_call>{"name": "calculator", "arguments": {"expression": "12+34*5"}}</tool_call>

A parser returns the turn's text without the calls (`content`), the well-formed calls, and one
error message per malformed call. The agent loop answers an error with a tool message saying what
was wrong, so the model learns from it instead of the conversation silently ending: a call that is
not valid JSON, not an object, has no string `name`, has `arguments` that are neither an object
nor a JSON string of one, or a `<tool_call>` that is never closed. Text without any `<tool_call>`
is a final answer. `gpt-oss` reads OpenAI's harmony format (`GptOssToolParser`).

Upstream's interface sits beside `parse(text)`: a parser built with a tokenizer
(`ToolParser.get_tool_parser(name, tokenizer)`, the same registry; `@ToolParser.register(name)` adds
one) answers `await parser.extract_tool_calls(responses_ids)` with `(content, [FunctionCall])`, the
ids decoded with the parser's tokenizer as upstream decodes them (special tokens kept; gpt-oss also
drops the pad token) and the text read by `parse`. So the calls it finds are the ones the agent
loop runs; a malformed call is logged and left out, as upstream's. Where it differs from upstream's:
`content` is stripped of surrounding whitespace and, for gpt-oss, the call's arguments must be a JSON
object (upstream hands on whatever the model wrote).
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments object."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """An assistant turn split into its text, its tool calls and its malformed calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def wants_tools(self) -> bool:
        """Whether the turn asked for any tool (well-formed or not), i.e. expects an answer."""
        return bool(self.tool_calls or self.errors)


class FunctionCall(BaseModel):
    """Upstream's type of one extracted call: the function's name and its arguments as the JSON text of
    an object (what an OpenAI-style tool call carries)."""

    arguments: str
    name: str


class ToolParser(ABC):
    """Splits a decoded assistant turn into text and tool calls."""

    keep_special_tokens = False
    """Whether the turn is decoded with its special tokens (formats whose markers are special tokens)."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        """Decodes the ids `extract_tool_calls` is given (`parse` needs none)."""

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn: ...

    async def extract_tool_calls(self, responses_ids: list[int]) -> tuple[str, list[FunctionCall]]:
        """Upstream's interface: (content, calls) of a turn's token ids, decoded with the parser's tokenizer."""
        if self.tokenizer is None:
            raise ValueError(
                f"{type(self).__name__}.extract_tool_calls decodes token ids, but the parser has no tokenizer; build "
                "it with ToolParser.get_tool_parser(name, tokenizer), or call parse(text) on decoded text"
            )
        text = self.tokenizer.decode(list(responses_ids), skip_special_tokens=False)
        pad = getattr(self.tokenizer, "pad_token", None)
        if self.keep_special_tokens and pad:  # the harmony markers are read with the special tokens, minus padding
            text = text.replace(pad, "")
        turn = self.parse(text)
        for error in turn.errors:
            logger.warning("%s: left out a malformed tool call: %s", type(self).__name__, error)
        calls = [
            FunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)) for c in turn.tool_calls
        ]
        return turn.content, calls

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer) -> ToolParser:
        """Upstream's constructor by name: the registered parser `name` with `tokenizer`."""
        if name not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool parser {name!r}; the registered parsers are {sorted(TOOL_PARSERS)} (add one with "
                "@ToolParser.register(name))"
            )
        return TOOL_PARSERS[name](tokenizer)

    @classmethod
    def register(cls, name: str):
        """Class decorator: register a parser under `name` (a `multi_turn.format` value), as upstream's."""

        def decorator(subclass: type[ToolParser]) -> type[ToolParser]:
            TOOL_PARSERS[name] = subclass
            return subclass

        return decorator


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for body in self._block.findall(text):
            call = _parse_call(body.strip())
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                errors.append(call)
        rest = self._block.sub("", text)
        if self.open_tag in rest:
            errors.append(f"{self.open_tag} without a closing {self.close_tag}")
            rest = rest[: rest.index(self.open_tag)]
        return ParsedTurn(content=rest.strip(), tool_calls=calls, errors=errors)


def _parse_call(body: str) -> ToolCall | str:
    """A ToolCall, or the error message for a malformed one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {body[:200]}"
    if not isinstance(obj, dict):
        return f'the tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {body[:200]}'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'the tool call has no "name" string: {body[:200]}'
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f'the "arguments" of the call to {name!r} are a string that is not a JSON object: {arguments[:200]}'
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f'the "arguments" of the call to {name!r} must be a JSON object, got {json.dumps(arguments)[:200]}'
    return ToolCall(name=name, arguments=arguments)


class GptOssToolParser(ToolParser):
    """OpenAI's harmony format (gpt-oss): a call is a message on the commentary channel addressed to
    `functions.<name>`, its body the arguments as JSON, ended by `<|call|>`:

        <|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "1+2"}<|call|>

    The markers are special tokens, so the turn is decoded with them kept (`keep_special_tokens`).
    Reasoning (the analysis channel) is dropped first: a call written there is not a call. The
    engine stops at `<|call|>` and the loop hands the text without its stop token, so the last
    call may end at the end of the text. The content is the final channel's message, else the
    text left without calls and reasoning.
    """

    keep_special_tokens = True
    _analysis = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>.*?(?:<\|end\|>|$)", re.DOTALL)
    _call = re.compile(
        r"(?:<\|start\|>assistant)?<\|channel\|>[^<]*?to=functions\.([^\s<]+)\s*(?:<\|constrain\|>\s*\w+\s*)?"
        r"<\|message\|>(.*?)(?:<\|call\|>|$)",
        re.DOTALL,
    )
    _final = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        text = self._analysis.sub("", text)
        calls, errors = [], []
        for name, body in self._call.findall(text):
            call = _parse_call(json.dumps({"name": name, "arguments": body.strip()}))
            (calls if isinstance(call, ToolCall) else errors).append(call)
        final = self._final.search(text)
        content = final.group(1) if final else re.sub(r"<\|[a-z_]+\|>", "", self._call.sub("", text))
        return ParsedTurn(content=content.strip(), tool_calls=calls, errors=errors)


# multi_turn.format -> parser class; the one place every supported format is listed (upstream's names)
TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "gpt-oss": GptOssToolParser}


def get_tool_parser(name: str, tokenizer=None) -> ToolParser:
    """The parser of `multi_turn.format` `name` (with `tokenizer` for `extract_tool_calls`)."""
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"actor_rollout_ref.rollout.multi_turn.format={name!r} is not a known tool-call format; "
            f"choose one of {sorted(TOOL_PARSERS)}"
        )
    return TOOL_PARSERS[name](tokenizer)
