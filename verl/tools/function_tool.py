"""`FunctionTool`: any Python function or async callable as a tool.

    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    tool = FunctionTool(add, config={"timeout": 5})

The schema is derived from the signature when none is given: the function's name, the first
paragraph of its docstring, one parameter per argument (JSON type from the annotation: int ->
integer, float -> number, bool -> boolean, str -> string, list -> array, dict -> object; anything
else is left untyped), required when it has no default. A tool config may also name a function as
its `class_name`; its `tool_schema` then wins over the derived one.

Calls: a coroutine function is awaited in the event loop; a plain function runs in the tool's own
thread pool (`config.max_workers` threads, default 8), so a slow function never stalls the other
conversations. A thread cannot be killed: a plain function that overruns its timeout keeps running
in the background while the conversation moves on (in the tool's pool, so it never holds up the end
of a rollout); use an async function or a subprocess for work that must really stop. The return value becomes
the tool message: a string as is, anything else as JSON (falling back to `str`). An exception
becomes an `Error: ...` message for the model.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}


def _json_type(annotation) -> str | None:
    origin = typing.get_origin(annotation) or annotation
    return _JSON_TYPES.get(origin)


def schema_from_function(fn: Callable, name: str | None = None) -> OpenAIFunctionToolSchema:
    """An OpenAI function schema from `fn`'s signature, type hints and docstring."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: fall back to untyped parameters
        hints = {}
    properties, required = {}, []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = {}
        json_type = _json_type(hints.get(pname))
        if json_type:
            prop["type"] = json_type
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    doc = inspect.getdoc(fn) or ""
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": name or fn.__name__,
                "description": doc.split("\n\n")[0].strip(),
                "parameters": {"type": "object", "properties": properties, "required": required},
            },
        }
    )


def format_result(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


class FunctionTool(BaseTool):
    """A stateless tool that calls `fn(**arguments)`."""

    def __init__(self, fn: Callable, config: dict | None = None, tool_schema=None, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"FunctionTool needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self._pool = None
        # an async def, or an object whose __call__ is one
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        super().__init__(config, tool_schema or schema_from_function(fn, name))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        if self._is_async:
            result = await self.fn(**parameters)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(int(self.config.get("max_workers", 8)), thread_name_prefix=self.name)
            call = functools.partial(self.fn, **parameters)
            result = await asyncio.get_running_loop().run_in_executor(self._pool, call)
        return ToolResponse(text=format_result(result)), 0.0, {}
