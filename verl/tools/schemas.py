"""Tool schemas in the OpenAI function-calling format, as upstream verl's tools declare them.

`OpenAIFunctionToolSchema` is what a tool config's `tool_schema:` entry parses into and what the
chat template receives as `tools=[...]` (after `model_dump(exclude_unset=True, exclude_none=True)`).
Pydantic models, like upstream's, so tool code written for upstream (`schema.function.name`,
`OpenAIFunctionToolSchema.model_validate(d)`) runs unchanged. Parameter schemas accept any extra JSON-schema
keys (`items`, `minimum`, ...) so a schema copied from an OpenAI tool definition is not rejected.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter: a JSON-schema type plus optional description and enum."""

    model_config = ConfigDict(extra="allow")

    type: str | list[str] | None = None
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """The parameters object of a function: `{"type": "object", "properties": {...}, "required": [...]}`."""

    model_config = ConfigDict(extra="allow")

    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    """A function the model may call: its name, what it does, its parameters."""

    name: str
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """`{"type": "function", "function": {...}}`."""

    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as the model wrote it: the function name and its arguments as a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionToolCall(BaseModel):
    """A parsed tool call in the OpenAI message format."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionParsedSchema


class ToolResponse(BaseModel):
    """What a tool returns to the conversation. Only text is supported (no images or video)."""

    text: str | None = None
