"""MATH-style answer normalisation (the `normalize_answer` of upstream's `prime_math.math_normalize`).

Two answers that normalise to the same string are the same answer. The text rules are those of
`verl.utils.reward_score.math_reward.normalize_answer` (spacing, `\\left`/`\\right`, dollars,
percent and degree signs, units, thousands separators, `x = 5` -> `5`, `\\frac12` -> `\\frac{1}{2}`),
after unwrapping an answer given as `\\text{...}`; then a plain `a/b` of integers becomes
`\\frac{a}{b}` and a decimal with an exact short fraction (`0.5`) becomes that fraction, as the
Hendrycks MATH normaliser does, so `1/2`, `0.5` and `\\frac{1}{2}` all normalise alike.
"""

from __future__ import annotations

import re

from verl.utils.reward_score.math_reward import normalize_answer as _normalize_text

__all__ = ["normalize_answer"]

_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_INT_SLASH = re.compile(r"^(-?)(\d+)/(\d+)$")


def normalize_answer(answer: str | None) -> str | None:
    """The normal form of `answer` (None stays None)."""
    if answer is None:
        return None
    answer = str(answer).strip()
    match = _TEXT_WRAPPED.search(answer)
    if match is not None:
        answer = match.group("text")
    normalized = _normalize_text(answer)
    if normalized == "0.5":
        return "\\frac{1}{2}"
    slash = _INT_SLASH.match(normalized)
    if slash is not None:
        sign, numerator, denominator = slash.groups()
        return f"{sign}\\frac{{{numerator}}}{{{denominator}}}"
    return normalized
