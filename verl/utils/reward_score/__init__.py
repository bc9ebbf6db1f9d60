"""Rule-based reward functions, chosen by the ``data_source`` column of each sample.

``default_compute_score`` is what the reward managers call when no ``custom_reward_function.path`` is
configured. The routing is one explicit table, ``SCORE_FNS``; every scorer is plain Python with no heavy
imports, so this package is cheap to import in any worker.

What is deliberately not here: code-execution data sources and model-based judges. Upstream's extra
keyword arguments for them (``sandbox_fusion_url``, ...) are accepted and ignored so that callers written
for upstream keep working; a data source that needs them raises the same NotImplementedError as any
unknown one. A custom reward that executes generated code runs it through ``sandbox.run_python`` (a
separate, resource-limited, throw-away process), never in the trainer's own process.
"""

from __future__ import annotations

from collections.abc import Callable

from verl.utils.reward_score import arith, countdown, gsm8k, math_reward

SCORE_FNS: dict[str, Callable[[str, object], float | dict]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": math_reward.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_reward.compute_score,
    "HuggingFaceH4/MATH-500": math_reward.compute_score,
    "arith": arith.compute_score,
    "arith_tool": arith.compute_score_after_tools,
    "countdown": countdown.compute_score,
}


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict:
    """Score one response with the rule for its data source.

    Args:
        data_source: the dataset name stored in the sample's ``data_source`` column ("openai/gsm8k", ...).
        solution_str: the decoded response.
        ground_truth: ``reward_model.ground_truth`` of the sample.
        extra_info: the sample's ``extra_info`` (unused by the built-in rules; part of the signature that
            custom reward functions share).

    Returns:
        A float, or a dict with at least a ``"score"`` key when a rule reports more than one value.

    Raises:
        NotImplementedError: no rule for ``data_source``.
    """
    fn = SCORE_FNS.get(data_source)
    if fn is None:
        raise NotImplementedError(
            f"no reward function for data_source={data_source!r}; the built-in ones are {sorted(SCORE_FNS)}. "
            "Write a function compute_score(data_source, solution_str, ground_truth, extra_info) in a Python "
            "file and point custom_reward_function.path (and custom_reward_function.name) at it."
        )
    result = fn(solution_str, ground_truth)
    return result if isinstance(result, dict) else float(result)


__all__ = ["SCORE_FNS", "default_compute_score"]
