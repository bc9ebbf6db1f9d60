"""MATH scoring: the last ``\\boxed{...}`` of a response against the reference answer.

The answer is the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or the ``\\boxed 5`` form),
with nested braces matched. A response without one scores 0: the preprocessed prompt asks for the
final answer "within \\boxed{}".

Equivalence is decided by a small pure-Python normaliser (no sympy), in two stages:

1. Textual normalisation removes what does not change the value: spaces and LaTeX spacing,
   ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac`` (-> ``\\frac``), dollar signs, percent signs, degrees
   (``^\\circ``), trailing units (``5\\text{ cm}``, ``5 cm``), thousands separators (``1,000``,
   ``1{,}000``), a variable prefix (``x = 5`` -> ``5``), shorthand (``\\frac12``, ``\\sqrt2``), a bare
   leading point (``.5``) and a trailing ``.0``.
2. When both sides are then a single exact rational (integer, decimal, ``a/b`` or ``\\frac{a}{b}``,
   signed), they are compared as ``fractions.Fraction``: ``\\frac{1}{2}``, ``1/2`` and ``0.5`` are equal,
   ``0.33`` and ``\\frac{1}{3}`` are not (no tolerance: only exact forms are the same answer).

Anything else (expressions, intervals, matrices) must match textually after stage 1. This is what the
MATH benchmark's own answer checker does, slightly more forgiving; symbolic equivalence
(``2\\sqrt{2}`` vs ``\\sqrt{8}``) is deliberately out of scope.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")

# Units dropped when they trail a number; a short list of words the MATH answers actually use.
_UNIT_WORDS = (
    "cm|mm|km|m|meters?|centimeters?|kilometers?|inches|inch|in|feet|foot|ft|yards?|miles?|units?|"
    "degrees?|dollars?|cents?|seconds?|minutes?|hours?|days?|weeks?|years?|sq|square|cubic|pounds?|"
    "ounces?|grams?|kg|g|liters?|ml|mph|people|students|marbles|cookies"
)
_TRAILING_UNIT_RE = re.compile(rf"(?<=[\d}}])\s*(?:\\,|\\;|\\ )*\s*(?:(?:{_UNIT_WORDS})\s*)+(?:\^\{{?\d\}}?)?$")
_TRAILING_TEXT_RE = re.compile(r"(?<=\S)\s*\\(?:text|mbox|mathrm|textrm)\{\s*[A-Za-z .]*\}\s*(?:\^\{?\d\}?)?$")
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)\{([^{}]*)\}")
_VARIABLE_RE = re.compile(r"[A-Za-z](?:_\{?\w+\}?)?|\\[A-Za-z]+")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = r"-?\d+(?:\.\d+)?"
_DECIMAL_RE = re.compile(_NUMBER)
_FRAC_RE = re.compile(rf"(-?)\\frac\{{({_NUMBER})\}}\{{({_NUMBER})\}}")
_SLASH_RE = re.compile(rf"({_NUMBER})/({_NUMBER})")


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` (braces balanced) of ``string``, including the command; None when absent."""
    idx = max(string.rfind(command) for command in _BOX_COMMANDS)
    if idx < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if string.startswith(c, idx))
    rest = string[idx + len(command) :]
    if rest.startswith(" "):
        # "\boxed 5$" form: the answer runs to the next "$" (or the end).
        return command + " " + rest[1:].split("$")[0].strip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for pos, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return command + rest[: pos + 1]
    return None  # unbalanced braces: the response was cut off inside the box


def remove_boxed(boxed: str) -> str:
    """``\\boxed{x}`` -> ``x`` (also ``\\fbox{x}`` and ``\\boxed x``)."""
    for command in _BOX_COMMANDS:
        if boxed.startswith(command + " "):
            return boxed[len(command) + 1 :]
        if boxed.startswith(command + "{") and boxed.endswith("}"):
            return boxed[len(command) + 1 : -1]
    raise ValueError(f"not a boxed answer: {boxed!r}")


def normalize_answer(answer: str) -> str:
    """Stage-1 textual normalisation of an answer (see the module docstring)."""
    s = str(answer).strip().replace("\n", "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[!,;: ]|\\quad|\\qquad", " ", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "").replace("\\degree", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _TRAILING_TEXT_RE.sub("", s).strip()
    s = _TEXT_WRAPPER_RE.sub(r"\1", s).strip()
    s = _TRAILING_UNIT_RE.sub("", s).strip()
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if _VARIABLE_RE.fullmatch(lhs.strip()) and rhs.strip():
            s = rhs.strip()
    s = s.replace("{,}", ",")
    if _THOUSANDS_RE.fullmatch(s.replace(" ", "")):
        s = s.replace(",", "")
    s = s.replace(" ", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]+)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"(?<!\d)\.(\d)", r"0.\1", s)
    s = re.sub(r"(\d)\.0+(?!\d)", r"\1", s)
    return s


def _as_fraction(normalized: str) -> Fraction | None:
    """The exact value of a normalised answer that is a single rational number, else None."""
    try:
        if _DECIMAL_RE.fullmatch(normalized):
            return Fraction(normalized)
        match = _FRAC_RE.fullmatch(normalized) or _SLASH_RE.fullmatch(normalized)
        if match is None:
            return None
        groups = match.groups()
        sign = -1 if len(groups) == 3 and groups[0] == "-" else 1
        numerator, denominator = Fraction(groups[-2]), Fraction(groups[-1])
        return None if denominator == 0 else sign * numerator / denominator
    except (ValueError, ZeroDivisionError):
        return None


def is_equiv(answer: str | None, ground_truth: str | None) -> bool:
    """True when two answers are the same after normalisation, or the same exact rational number."""
    if answer is None or ground_truth is None:
        return False
    a, b = normalize_answer(answer), normalize_answer(ground_truth)
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    return fa is not None and fb is not None and fa == fb


def extract_answer(solution_str: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in a response, or None."""
    boxed = last_boxed_only_string(solution_str)
    return None if boxed is None else remove_boxed(boxed)


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer of the response is equivalent to ``ground_truth``, else 0.0.

    ``ground_truth`` is the bare answer (as ``examples/data_preprocess/math_dataset.py`` writes it); a full
    reference solution containing ``\\boxed{...}`` is accepted too and its last box is used.
    """
    ground_truth = str(ground_truth)
    if any(command in ground_truth for command in _BOX_COMMANDS):
        ground_truth = extract_answer(ground_truth) or ground_truth
    return 1.0 if is_equiv(extract_answer(solution_str), ground_truth) else 0.0
