"""Math answer checking of the PRIME project, for the NuminaMath data sources (`numina_*`).

`compute_score(model_output, ground_truth) -> (is_correct, format_correct, extracted_answer)`, as
upstream's `prime_math.compute_score`; `default_compute_score` turns it into 1.0 / 0.0.

1. The answer is extracted from the response (`match_answer`): the text after the last "answer:",
   "answer is" or "answers are"; the text before "is the answer" and similar; the content of the
   last `\\boxed{...}`; then the last sentence, and what follows its last "is", "be", "are",
   "=", ": " or "get". It counts as matched only when it contains a digit.
2. `grade_answer` (the PRM800K grader): equal after MATH normalisation
   (`math_normalize.normalize_answer`), or after a second normalisation that drops units, `\\text`,
   dollar and percent signs, reads "million" as `*10^6`, turns LaTeX into plain math and reads
   mixed numbers (`7 3/4` -> `7+3/4`); then tuples element by element, where an unreduced
   fraction must match exactly, an integer answer must match an integer exactly, and anything
   else is compared by sympy (`simplify(a - b) == 0`, under a 10 s deadline, and only for short
   expressions with at most two unknown letters and no towering powers).
3. Failing that, `grader.math_equal` (numeric tolerance 1e-4, percentages, intervals, matrices,
   symbolic equality); with `\\pi` in either answer it is tried with pi = 3.14159... and 3.14.

`format_correct` is True when the response has a "Step 2:" and a `\\box`; a correct answer found
by `grade_answer` reports True for it, as upstream does.

sympy is imported on first use (it is a dependency of torch, so always installed); LaTeX is
converted by our own small converter instead of pylatexenc (see `_expr`).
"""

from __future__ import annotations

import math
import re

from verl.utils.reward_score.prime_math import _expr, math_normalize
from verl.utils.reward_score.prime_math.grader import math_equal

__all__ = ["compute_score", "grade_answer", "last_boxed_only_string", "match_answer", "remove_boxed"]

_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"
_UNITS = (
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
    "liter",
)
_SYMPY_TIMEOUT_S = 10.0


def remove_boxed(s: str) -> str | None:
    """`\\boxed{x}` -> `x`; None when `s` is not exactly one boxed answer."""
    prefix = "\\boxed{"
    if s.startswith(prefix) and s.endswith("}"):
        return s[len(prefix) : -1]
    return None


def last_boxed_only_string(string: str) -> str | None:
    """The content of the last `\\boxed{...}` (else `\\fbox{...}`), braces balanced, stripped; None
    when there is none or its braces never close."""
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    start = string.find("{", idx)
    if start < 0:
        return None
    depth = 0
    for pos in range(start, len(string)):
        if string[pos] == "{":
            depth += 1
        elif string[pos] == "}":
            depth -= 1
            if depth == 0:
                return string[start + 1 : pos].strip()
    return None


def match_answer(response: str) -> tuple[bool, str]:
    """(matched, extracted answer) of a response (step 1 of the module docstring)."""
    matched = False
    text = response
    for marker in ("answer:", "answer is", "answers are"):
        pos = text.lower().rfind(marker)
        if pos != -1:
            matched = True
            text = text[pos + len(marker) :].strip()
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        pos = text.lower().rfind(marker)
        if pos != -1:
            matched = True
            text = text[:pos].strip()
    boxed = last_boxed_only_string(text)
    if boxed:
        matched = True
        text = boxed
    if ". " in text:
        text = text[: text.rfind(". ")].strip()
    for marker in ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"):
        pos = text.lower().rfind(marker)
        if pos != -1:
            matched = True
            text = text[pos + len(marker) :].strip()
    return matched and any(char.isdigit() for char in text), text


# ------------------------------------------------------------------------------------------------
# the PRM800K grader


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _strip_thousands_commas(expr: str) -> str:
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        stripped = pattern.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _str_is_int(text: str) -> bool:
    try:
        value = float(_strip_thousands_commas(text))
    except ValueError:
        return False
    return math.isfinite(value) and abs(value - round(value)) <= 1e-7


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def _normalize(expr: str | None) -> str | None:
    """The grader's own normalisation (step 2 of the module docstring)."""
    if expr is None:
        return None
    match = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if match is not None:
        expr = match.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _str_is_int(expr):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        expr = _expr.latex_to_text(expr.replace("\\frac", " \\frac"))
    expr = re.sub("- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # mixed numbers: 7 3/4 -> 7+3/4
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(round(float(_strip_thousands_commas(expr)))))
    return expr


def _sympy_eval_allowed(expr: str) -> bool:
    letters = {char for char in expr.replace("sqrt", "").replace("frac", "") if char.isalpha()}
    if len(letters) > 2:
        return False
    if any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return not any(regex.search(expr) for regex in _BAD_REGEXES)


def _difference_is_zero(ground_truth: str, given: str) -> bool:
    import sympy

    expr = f"({ground_truth})-({given})"
    if not _sympy_eval_allowed(expr):
        return False
    try:
        return sympy.simplify(_expr.parse(expr)) == 0
    except Exception:  # a parse failure, or sympy failing on the expression: not shown equal
        return False


def _are_equal_under_sympy(ground_truth: str, given: str) -> bool:
    try:
        return bool(_expr.within_deadline(_difference_is_zero, _SYMPY_TIMEOUT_S, ground_truth, given))
    except TimeoutError:
        return False


def _split_tuple(expr: str) -> list[str]:
    expr = _strip_thousands_commas(expr)
    if not expr:
        return []
    bracketed = len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS
    if bracketed and not any(char in expr[1:-1] for char in _TUPLE_CHARS):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given_answer: str | None, ground_truth: str) -> bool:
    """Whether `given_answer` equals `ground_truth` under the PRM800K rules (step 2 above)."""
    if given_answer is None:
        return False
    if math_normalize.normalize_answer(ground_truth) == math_normalize.normalize_answer(given_answer):
        return True
    truth = _normalize(ground_truth)
    given = _normalize(given_answer)
    if truth is None:
        return False
    if truth == given:
        return True
    if not given:
        return False
    truth_elems, given_elems = _split_tuple(truth), _split_tuple(given)
    if len(truth_elems) != len(given_elems):
        return False
    if len(truth_elems) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # (a, b] is not [a, b]
    for truth_elem, given_elem in zip(truth_elems, given_elems):
        if _is_frac(truth_elem) and _is_frac(given_elem):
            correct = truth_elem == given_elem  # an unreduced fraction is not the reduced one's equal
        elif _str_is_int(truth_elem) != _str_is_int(given_elem):
            correct = False
        else:
            correct = _are_equal_under_sympy(truth_elem, given_elem)
        if not correct:
            return False
    return True


def compute_score(model_output: str, ground_truth: str) -> tuple[bool, bool, str]:
    """(is_correct, format_correct, extracted_answer) of a response (see the module docstring)."""
    model_output, ground_truth = str(model_output), str(ground_truth)
    _, extracted = match_answer(model_output)
    format_correct = "Step 2:" in model_output and "\\box" in model_output
    if grade_answer(extracted, ground_truth):
        return True, True, extracted
    if "\\pi" in extracted or "\\pi" in ground_truth:
        is_correct = any(math_equal(extracted, ground_truth, timeout=_SYMPY_TIMEOUT_S, pi=pi) for pi in (math.pi, 3.14))
    else:
        is_correct = math_equal(extracted, ground_truth, timeout=_SYMPY_TIMEOUT_S)
    return is_correct, format_correct, extracted
