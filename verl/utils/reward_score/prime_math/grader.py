"""Lenient equality of a predicted and a reference math answer (upstream's `prime_math.grader`).

`math_equal(prediction, reference)` is True when any of these holds, tried in order:

1. the strings match, ignoring case and spaces (after dropping a leading `$`, a trailing `%`, a
   base subscript `1011_2` -> `1011`, and evaluating `\\pi` expressions with `pi`);
2. both are numbers equal within a relative `tolerance` (with `include_percentage`, the reference
   may also be read as a percentage: 50 matches 0.5 and 5000);
3. intervals and tuples match element by element (`(1, 2]` needs the same bracket kinds, a bare
   `1, 2` matches `(1, 2)`), sympy's `Interval(...)` spelling included, and a column vector
   `\\begin{pmatrix} a \\\\ b \\end{pmatrix}` matches the list `[a, b]`;
4. sympy finds the difference simplifies to 0, or the two evaluate to numbers within `tolerance`
   (`symbolic_equal`), under a deadline of `timeout` seconds.

Nothing from the answers is passed to Python's `eval`: numbers go through `float`, lists through
`ast.literal_eval`, expressions through the checked sympy parser of `_expr`.
"""

from __future__ import annotations

import ast
import math
import re

from verl.utils.reward_score.prime_math import _expr

__all__ = ["format_intervals", "is_digit", "math_equal", "symbolic_equal"]

_MAX_PREDICTION_CHARS = 1000


def is_digit(s) -> tuple[bool, float | None]:
    """(True, value) when `s` reads as a number (thousands commas allowed), else (False, None)."""
    text = str(s)
    try:
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _evaluate_pi(text: str, pi: float):
    """The number an expression with `\\pi` stands for, with `pi` as the value of pi; else the text."""
    spelled = re.sub(r"(?<=\d)\\pi", f"*{pi}", text)
    spelled = spelled.replace("\\pi", f"1*{pi}")
    try:
        value = _expr.within_deadline(lambda t: float(_expr.parse(_expr.latex_to_text(t))), 5.0, spelled)
    except (ValueError, TypeError, TimeoutError):
        return text
    return value


def _normalize(answer, pi: float):
    if not isinstance(answer, str):
        return answer
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"^\d+(\.\d+)?(\\%|%)$", answer):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:  # a base subscript: 1011_2
        head = answer.split("_")[0]
        ok, value = is_digit(head)
        if ok:
            return int(value)
    if "\\pi" in answer:
        return _evaluate_pi(answer, pi)
    return answer


def format_intervals(prediction: str) -> str:
    """sympy's interval spellings as brackets: `Interval(a, b)` -> `[a, b]`, `Interval.Ropen(a, b)`
    -> `[a, b)`, `Interval.Lopen(a, b)` -> `(a, b]`, `Interval.open(a, b)` -> `(a, b)`."""
    for prefix, left, right in (
        ("Interval.Ropen(", "[", ")"),
        ("Interval.Lopen(", "(", "]"),
        ("Interval.open(", "(", ")"),
        ("Interval(", "[", "]"),
    ):
        if prediction.startswith(prefix) and prediction.endswith(")"):
            return f"{left}{prediction[len(prefix) : -1]}{right}"
    return prediction


def _pmatrix_entries(reference: str) -> list | None:
    body = re.search(r"\\begin\{pmatrix\}(.*)\\end\{pmatrix\}", reference, re.S)
    if body is None:
        return None
    rows = [row.strip() for row in re.split(r"\\\\", body.group(1)) if row.strip()]
    return [[cell.strip() for cell in row.split("&")] if "&" in row else row for row in rows]


def _equal_parts(pred_parts, ref_parts, include_percentage: bool, tolerance: float) -> bool:
    return len(pred_parts) == len(ref_parts) and all(
        math_equal(p, r, include_percentage, tolerance) for p, r in zip(pred_parts, ref_parts)
    )


def math_equal(
    prediction,
    reference,
    include_percentage: bool = True,
    tolerance: float = 1e-4,
    timeout: float = 10.0,
    pi: float = math.pi,
) -> bool:
    """Whether `prediction` and `reference` are the same answer (see the module docstring)."""
    prediction = _normalize(prediction, pi)
    reference = _normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > _MAX_PREDICTION_CHARS:
        prediction = prediction[:_MAX_PREDICTION_CHARS]

    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True

    pred_is_number, pred_value = is_digit(prediction)
    ref_is_number, ref_value = is_digit(reference)
    if pred_is_number and ref_is_number:
        candidates = [ref_value / 100, ref_value, ref_value * 100] if include_percentage else [ref_value]
        return any(math.isclose(c, pred_value, rel_tol=tolerance) for c in candidates)

    if not prediction and prediction not in (0, False):
        return False

    reference = str(reference).strip()
    prediction = format_intervals(str(prediction).strip())

    pred_bare, ref_bare = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_bare, ref_bare = pred_bare.strip("[]()"), ref_bare.strip("[]()")
    for char in "{}()":
        pred_bare, ref_bare = pred_bare.replace(char, ""), ref_bare.replace(char, "")
    if pred_bare == ref_bare:
        return True

    if (
        prediction[:1] in ("(", "[")
        and prediction[-1:] in (")", "]")
        and prediction[:1] == reference[:1]
        and prediction[-1:] == reference[-1:]
        and _equal_parts(prediction[1:-1].split(","), reference[1:-1].split(","), include_percentage, tolerance)
    ):
        return True

    if "," in prediction and "," in reference:
        pred_parts = [p.strip() for p in prediction.split(",")]
        ref_parts = [r.strip() for r in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return _equal_parts(pred_parts, ref_parts, include_percentage, tolerance)

    if prediction.startswith("Point") and reference[:1] == "(" and reference[-1:] == ")":
        inner = prediction[prediction.find("(") + 1 : -1]
        if _equal_parts(inner.split(","), reference[1:-1].split(","), include_percentage, tolerance):
            return True

    entries = _pmatrix_entries(reference)
    if entries is not None and prediction.startswith("[") and prediction.endswith("]"):
        try:
            predicted = ast.literal_eval(prediction)
        except (ValueError, SyntaxError):
            predicted = None
        if isinstance(predicted, list) and _equal_parts(predicted, entries, include_percentage, tolerance):
            return True

    return symbolic_equal(prediction, reference, tolerance, timeout)


def _to_sympy(text: str):
    try:
        return _expr.parse(text)
    except ValueError:
        return _expr.parse(_expr.latex_to_text(text))


def _symbolically_equal(a: str, b: str, tolerance: float) -> bool:
    import sympy

    try:
        left, right = _to_sympy(a), _to_sympy(b)
    except ValueError:
        return False
    try:
        if sympy.simplify(left - right) == 0:
            return True
    except Exception:  # sympy raises assorted errors on expressions it cannot subtract or simplify
        pass
    try:
        return math.isclose(
            complex(sympy.N(left)).real, complex(sympy.N(right)).real, rel_tol=tolerance
        ) and math.isclose(
            complex(sympy.N(left)).imag, complex(sympy.N(right)).imag, rel_tol=tolerance, abs_tol=tolerance
        )
    except (TypeError, ValueError):  # not numbers (free symbols left)
        return False


def symbolic_equal(a, b, tolerance: float = 1e-4, timeout: float = 10.0) -> bool:
    """Whether sympy shows `a - b` simplifies to 0, or both evaluate to numbers within `tolerance`;
    False when either does not parse or the check takes longer than `timeout` seconds."""
    try:
        return bool(_expr.within_deadline(_symbolically_equal, float(timeout), str(a), str(b), tolerance))
    except TimeoutError:
        return False
