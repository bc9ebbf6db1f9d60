"""Tools from upstream's tool-config YAML: classes, plain functions, and the errors a user can make."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from verl.tools.calculator_tool import CalculatorTool
from verl.tools.function_tool import FunctionTool
from verl.tools.utils.tool_registry import initialize_tools_from_config


def multiply(a: int, b: int = 2) -> int:
    """Multiply two integers.

    More text that is not part of the description."""
    return a * b


async def shout(text: str) -> str:
    return text.upper()


def write(tmp_path, text: str):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_upstream_format_with_a_tool_class_and_its_schema(tmp_path):
    path = write(
        tmp_path,
        """
        tools:
          - class_name: verl.tools.calculator_tool.CalculatorTool
            config: {timeout: 3, argument: expr}
            tool_schema:
              type: function
              function:
                name: calc
                description: Evaluate arithmetic.
                parameters:
                  type: object
                  properties:
                    expr: {type: string, description: an expression}
                  required: [expr]
        """,
    )
    (tool,) = initialize_tools_from_config(path)
    assert isinstance(tool, CalculatorTool) and tool.name == "calc" and tool.timeout_s == 3.0
    assert tool.schema_dict()["function"]["parameters"]["properties"]["expr"]["type"] == "string"
    assert asyncio.run(tool.execute("i", {"expr": "2+3"}))[0].text == "5"


def test_functions_become_tools_with_a_schema_from_their_signature(tmp_path):
    path = write(
        tmp_path,
        f"""
        tools:
          - class_name: {__name__}.multiply
          - class_name: {__name__}.shout
            config: {{timeout: 1}}
        """,
    )
    mul, loud = initialize_tools_from_config(path)
    assert isinstance(mul, FunctionTool) and isinstance(loud, FunctionTool)
    fn = mul.schema_dict()["function"]
    assert fn["name"] == "multiply" and fn["description"] == "Multiply two integers."
    assert fn["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert fn["parameters"]["required"] == ["a"]
    assert asyncio.run(mul.execute("i", {"a": 21}))[0].text == "42"
    assert asyncio.run(loud.execute("i", {"text": "hi"}))[0].text == "HI"


def test_builtin_tools_need_no_schema(tmp_path):
    path = write(
        tmp_path,
        """
        tools:
          - class_name: verl.tools.calculator_tool.CalculatorTool
          - class_name: verl.tools.sandbox_python_tool.PythonSandboxTool
            config: {timeout: 2, memory_mb: 128}
        """,
    )
    assert [t.name for t in initialize_tools_from_config(path)] == ["calculator", "python"]


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("tools:\n  - class_name: nope_pkg.Tool\n", ImportError, "cannot import 'nope_pkg'"),
        ("tools:\n  - class_name: verl.tools.calculator_tool.Nope\n", AttributeError, "has no 'Nope'"),
        ("tools:\n  - class_name: Calculator\n", ValueError, "must be an import path"),
        ("tools:\n  - config: {}\n", ValueError, "needs a class_name"),
        ("tools:\n  - class_name: verl.tools.calculator_tool.CalculatorTool\n    confg: {}\n", ValueError, "confg"),
        ("tool:\n  - class_name: x.y\n", ValueError, "top-level `tools:` list"),
        (
            "tools:\n  - class_name: verl.tools.calculator_tool.CalculatorTool\n"
            "  - class_name: verl.tools.calculator_tool.CalculatorTool\n",
            ValueError,
            r"more than once: \['calculator'\]",
        ),
        (
            "tools:\n  - class_name: verl.tools.calculator_tool.CalculatorTool\n    config: {timeout: 0}\n",
            ValueError,
            "config.timeout=0 must be a positive",
        ),
        (
            "tools:\n  - class_name: verl.tools.image_zoom_in_tool.ImageZoomInTool\n",
            NotImplementedError,
            r"ImageZoomInTool answers with images \(ToolResponse.image\)",
        ),
        (
            "tools:\n  - class_name: verl.tools.calculator_tool.CalculatorTool\n    config: {type: nativ}\n",
            ValueError,
            "config.type='nativ' is not a tool type",
        ),
    ],
)
def test_mistakes_in_the_file_are_explained(tmp_path, text, error, match):
    with pytest.raises(error, match=match):
        initialize_tools_from_config(write(tmp_path, text))


def test_a_missing_file_names_the_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="multi_turn.tool_config_path"):
        initialize_tools_from_config(str(tmp_path / "missing.yaml"))
