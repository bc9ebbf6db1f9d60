"""`CalculatorTool`: exact arithmetic on an expression string, the built-in tool of the examples.

`calculate("12+34*5")` -> "182". The expression is parsed with `ast` and evaluated node by node:
numbers (int, float), `+ - * / // % **`, unary `+`/`-` and parentheses; nothing else (no names,
calls, attributes or comparisons), so the model cannot run code through it. Integers stay exact
(Python big ints); a float result that is integral prints as an integer ("6/3" -> "2"), others with
`repr` precision. Limits keep one call cheap whatever the model writes: at most
`MAX_EXPRESSION_CHARS` characters, exponents up to `MAX_EXPONENT`, results up to `MAX_RESULT_DIGITS`
digits. Every failure is a `CalculatorError` whose message is what the model reads back
("Error: division by zero").
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

MAX_EXPRESSION_CHARS = 256
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 1000
_MAX_RESULT_BITS = int(MAX_RESULT_DIGITS * math.log2(10)) + 1

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value cannot be computed."""


def _check_size(value):
    if isinstance(value, int) and value.bit_length() > _MAX_RESULT_BITS:
        raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > _MAX_RESULT_BITS:
                raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result is too large") from None
    raise CalculatorError(f"unsupported syntax {ast.unparse(node)!r}; use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if not expression.strip():
        raise CalculatorError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r} as arithmetic") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 12+34*5"}},
            "required": ["expression"],
        },
    },
}


class CalculatorTool(BaseTool):
    """The calculator as a tool; the argument is `expression` (configurable as `config.argument`)."""

    def __init__(self, config: dict | None = None, tool_schema: OpenAIFunctionToolSchema | dict | None = None):
        super().__init__(config, tool_schema or CALCULATOR_SCHEMA)
        self.argument = self.config.get("argument", "expression")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        if self.argument not in parameters:
            raise CalculatorError(f"missing argument {self.argument!r}")
        return ToolResponse(text=calculate(parameters[self.argument])), 0.0, {}
