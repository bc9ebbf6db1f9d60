"""The calculator: exact arithmetic, refusal of anything else, bounded cost."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from verl.tools.calculator_tool import CalculatorError, CalculatorTool, calculate


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12+34*5", "182"),  # precedence
        ("(12+34)*5", "230"),
        ("7-10", "-3"),
        ("-(3-5)", "2"),
        ("6/3", "2"),  # an integral quotient prints as an integer
        ("7/2", "3.5"),
        ("7//2", "3"),
        ("7%3", "1"),
        ("2**10", "1024"),
        ("99999999999*99999999999", str(99999999999 * 99999999999)),  # exact big integers
        (" 1 + 2 ", "3"),
    ],
)
def test_arithmetic_matches_python(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("__import__('os').system('true')", "unsupported syntax"),
        ("x+1", "unsupported syntax"),
        ("1 < 2", "unsupported syntax"),
        ("'a'*3", "unsupported syntax"),
        ("1+", "cannot parse"),
        ("", "empty"),
        ("1+" * 200 + "1", "longer than 256"),
        ("2**100000", "exponent 100000 is larger than 1000"),
        ("(10**300)**900", "more than 1000 digits"),
        ("1e308*10", "not a finite number"),
    ],
)
def test_anything_but_plain_arithmetic_is_refused_with_a_reason(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


def test_a_huge_power_is_refused_before_it_is_computed():
    # Measured in memory, not time (a time bound depends on the machine's load): the value has about
    # 950,000 digits, ~420 KB as a Python int (~1.9 MB peak while computing), whereas refusing it from
    # the operands' sizes allocates a few KB.
    calculate("1+1")  # first-call imports and caches stay out of the measurement
    tracemalloc.start()
    try:
        with pytest.raises(CalculatorError, match="more than 1000 digits"):
            calculate("(9**999)**999")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, f"refusing the power allocated {peak} bytes at peak: it was computed first"


def test_tool_returns_the_value_and_names_a_missing_argument():
    tool = CalculatorTool()
    assert tool.name == "calculator" and tool.schema_dict()["function"]["parameters"]["required"] == ["expression"]
    response, reward, metrics = asyncio.run(tool.execute("id", {"expression": "2*21"}))
    assert response.text == "42" and reward == 0.0
    with pytest.raises(CalculatorError, match="missing argument 'expression'"):
        asyncio.run(tool.execute("id", {"expr": "1"}))
