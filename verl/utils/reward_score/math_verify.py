"""MATH-style scoring with Hugging Face's Math-Verify (`pip install math-verify`, or `verl[math]`).

Symbolic where `math_reward` is textual: the gold answer is read as LaTeX (it is wrapped in `\\boxed{}`
first, as the datasets store bare answers) and the response as either a plain expression or LaTeX, and the
two are compared by Math-Verify's parser and sympy, so `\\sqrt{8}` equals `2\\sqrt{2}`. Not a default route of
`default_compute_score` (neither is it upstream's): point `custom_reward_function.path` at a function that
calls it, or call it from your own scorer.

Returns Math-Verify's score (1.0 or 0.0); a parse or comparison error scores 0.0, and Math-Verify's own
timeout scores `timeout_score`.
"""

from __future__ import annotations


def _metric():
    try:
        from math_verify.metric import math_metric
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    except ImportError as e:
        raise ImportError(
            "verl.utils.reward_score.math_verify needs the math-verify package: pip install math-verify "
            "(or pip install 'verl[math]')"
        ) from e
    return math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )


def compute_score(model_output: str, ground_truth: str, timeout_score: float = 0) -> float:
    """1.0 when the response's answer equals `ground_truth` by Math-Verify's comparison, else 0.0."""
    from math_verify.errors import TimeoutException

    verify = _metric()
    try:
        score, _ = verify(["\\boxed{" + str(ground_truth) + "}"], [model_output])
    except TimeoutException:  # a BaseException: not caught below
        return timeout_score
    except Exception:
        return 0.0
    return float(score)
