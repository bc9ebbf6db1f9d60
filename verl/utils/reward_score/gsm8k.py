"""GSM8K scoring: compare the final number of a response with the reference answer.

Two extraction methods, as in upstream verl:

- ``strict``: the answer must follow ``####`` (the GSM8K solution format the preprocessed prompt asks
  for: 'output the final answer after "####"'). When a response repeats the marker, the last one counts.
- ``flexible``: the last number anywhere in the response.

Unlike a plain string comparison, numbers are compared by value after normalisation: thousands
separators and a dollar sign are dropped and trailing zeros do not matter, so "#### $1,000.00" matches the
ground truth "1000". A ground truth that is not a number is compared as a stripped string.

Returns ``score`` for a correct answer, ``format_score`` for an extracted but wrong one and 0.0 when no
answer can be extracted (the response did not follow the format).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A signed number with an optional "$", thousands commas and decimals: "-$1,234.50", "72", ".5".
_NUMBER_RE = re.compile(r"-?\$?(?:(?:\d[\d,]*\d|\d)(?:\.\d+)?|\.\d+)")
_STRICT_RE = re.compile(r"####\s*(-?\s*\$?\s*(?:(?:\d[\d,]*\d|\d)(?:\.\d+)?|\.\d+))")

METHODS = ("strict", "flexible")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").replace(" ", "")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a response as a plain number string ("1000", "-3.5"), or None when absent."""
    if method not in METHODS:
        raise ValueError(f"gsm8k extraction method {method!r} is unknown; choose one of {list(METHODS)}")
    if method == "strict":
        matches = _STRICT_RE.findall(solution_str)
    else:
        matches = _NUMBER_RE.findall(solution_str)
    if not matches:
        return None
    return _clean_number(matches[-1])


def _to_decimal(text: str) -> Decimal | None:
    try:
        return Decimal(_clean_number(str(text).strip()))
    except InvalidOperation:
        return None


def answers_match(answer: str, ground_truth) -> bool:
    """True when two answers are the same number (1,000 == 1000.0), or the same string if not numbers."""
    a, b = _to_decimal(answer), _to_decimal(ground_truth)
    if a is not None and b is not None:
        return a == b
    return str(answer).strip() == str(ground_truth).strip()


def compute_score(
    solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """Score a GSM8K response.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer ("72"; commas and "$" are tolerated).
        method: "strict" (answer after "####") or "flexible" (last number in the response).
        format_score: reward for a well-formed but wrong answer.
        score: reward for a correct answer.
    """
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answers_match(answer, ground_truth) else float(format_score)
