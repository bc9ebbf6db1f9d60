"""Geometry3K (``hiyouga/geometry3k``) scoring, upstream verl's rule: a weighted sum of a format
reward and an accuracy reward.

- format: the whole response is ``<think>...</think>`` followed by text containing ``\\boxed{...}``
  (what the preprocessed prompt asks for; ``examples/data_preprocess/geo3k.py``);
- accuracy: the last ``\\boxed{...}`` (or, with ``use_boxed=False``, the whole response) equals the
  reference answer;
- score = (1 - format_score) * accuracy + format_score * format, so 1.0, 0.9 (right answer, wrong
  format), 0.1 (format only) or 0.0 with the default ``format_score=0.1``.

Upstream grades the answer with the ``mathruler`` package's ``grade_answer`` (a normaliser plus sympy).
This uses the project's MATH normaliser (``math_reward.is_equiv``: LaTeX spacing, ``\\frac``/``\\sqrt``
shorthand, units, degrees, exact rationals) instead of adding that dependency: the Geometry3K answers
are numbers, fractions and surds, which it decides the same way; expressions that are equal only
symbolically (``\\sqrt{12}`` vs ``2\\sqrt{3}``) count as different here.
"""

from __future__ import annotations

import re

from verl.utils.reward_score.math_reward import extract_answer, is_equiv

_FORMAT_RE = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(predict_str: str) -> float:
    """1.0 when the response is ``<think>...</think>`` then text with a ``\\boxed{...}``, else 0.0."""
    return 1.0 if _FORMAT_RE.fullmatch(predict_str) else 0.0


def acc_reward(predict_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    """1.0 when the last boxed answer (or the whole response without ``use_boxed``) equals ``ground_truth``."""
    answer = extract_answer(predict_str) if use_boxed else predict_str
    return 1.0 if is_equiv(answer, str(ground_truth)) else 0.0


def compute_score(predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    """(1 - format_score) * accuracy + format_score * format (module docstring)."""
    return (1.0 - format_score) * acc_reward(predict_str, ground_truth, use_boxed) + format_score * format_reward(
        predict_str
    )
