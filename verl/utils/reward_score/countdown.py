"""Countdown scoring: an equation that uses each given number exactly once and reaches the target.

The response must put its equation in ``<answer>...</answer>`` tags (the last pair counts); an optional
trailing ``= result`` is ignored. The equation is parsed with ``ast`` and evaluated by walking the tree:
only integer literals, ``+ - * /``, unary minus and parentheses are accepted, so nothing in a response
is ever executed. Arithmetic is exact (``fractions.Fraction``): ``(6/4)*4`` reaches 6, there is no
floating-point tolerance to tune.

Scores (as in TinyZero's countdown task): ``score`` (1.0) for a correct equation, ``format_score`` (0.1)
when an answer is present but wrong (numbers misused, target missed, unparsable), 0.0 when there is
no ``<answer>`` at all.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_EQUATION_CHARS = 256  # a real answer is a few dozen characters; bounds parsing cost


def extract_solution(solution_str: str) -> str | None:
    """The equation in the last ``<answer>...</answer>`` of the response, or None."""
    matches = _ANSWER_RE.findall(solution_str or "")
    if not matches:
        return None
    return matches[-1].split("=")[0].strip()


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand, used)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left / right  # ZeroDivisionError is handled by the caller
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:80]}")


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integer literals used) of an equation, or None when it is not plain arithmetic."""
    if len(equation) > _MAX_EQUATION_CHARS:
        return None
    try:
        tree = ast.parse(equation, mode="eval")
        used: list[int] = []
        return _evaluate(tree, used), used
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def compute_score(solution_str: str, ground_truth, format_score: float = 0.1, score: float = 1.0) -> float:
    """Score a countdown response; ``ground_truth`` is ``{"target": int, "numbers": [int, ...]}``."""
    try:
        target = Fraction(int(ground_truth["target"]))
        numbers = [int(n) for n in ground_truth["numbers"]]
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"countdown ground_truth must be a dict {{'target': int, 'numbers': [int, ...]}}, got {ground_truth!r}; "
            "check reward_model.ground_truth (examples/data_preprocess/countdown.py writes it)"
        ) from None
    equation = extract_solution(solution_str)
    if equation is None:
        return 0.0
    result = evaluate_equation(equation)
    if result is None:
        return float(format_score)
    value, used = result
    if Counter(used) != Counter(numbers) or value != target:
        return float(format_score)
    return float(score)
