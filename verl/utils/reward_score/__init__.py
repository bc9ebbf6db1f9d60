"""Rule-based reward functions, chosen by the ``data_source`` column of each sample.

``default_compute_score`` is what the reward managers call when no ``custom_reward_function.path`` is
configured. The routing is explicit tables: ``SCORE_FNS`` for rules that need only the response and
the ground truth, ``CODE_DATA_SOURCES`` for code contests. Heavy scorers (sympy for the NuminaMath
sources, ``prime_math``) are imported on first use, so this package stays cheap to import.

Code data sources (``codecontests``, ``apps``, ``codeforces``, ``taco``) run the generated program
against the sample's test cases: on a SandboxFusion service when ``sandbox_fusion_url`` is given
(``sandbox_fusion.compute_score``, with ``concurrent_semaphore`` and ``memory_limit_mb``), otherwise
locally, one throw-away sandboxed interpreter per test case (``prime_code.compute_score`` through
``sandbox.run_python``), never inside the trainer's own process. Their score is the fraction of the
first 10 test cases that pass, as upstream.
"""

from __future__ import annotations

from collections.abc import Callable

from verl.utils.reward_score import (
    arith,
    countdown,
    geo3k,
    gsm8k,
    math_dapo,
    math_reward,
    search_r1_like_qa_em,
    vl_colors,
)


def _prime_math_score(solution_str: str, ground_truth) -> float:
    from verl.utils.reward_score import prime_math

    return float(prime_math.compute_score(solution_str, ground_truth)[0])


NUMINA_DATA_SOURCES = (
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
SEARCH_R1_DATA_SOURCES = (
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)

SCORE_FNS: dict[str, Callable[[str, object], float | dict]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": math_reward.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_reward.compute_score,
    "HuggingFaceH4/MATH-500": math_reward.compute_score,
    "arith": arith.compute_score,
    "arith_tool": arith.compute_score_after_tools,
    "countdown": countdown.compute_score,
    "hiyouga/geometry3k": geo3k.compute_score,
    "vl_colors": vl_colors.compute_score,
    **{source: _prime_math_score for source in NUMINA_DATA_SOURCES},
    # question answering with a search tool: exact match of the last <answer> (search_r1_like_qa_em)
    **dict.fromkeys(SEARCH_R1_DATA_SOURCES, search_r1_like_qa_em.compute_score),
    # DAPO-Math-17k and its evaluation sets: +1 / -1 on the `Answer:` line (math_dapo)
    **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning"), math_dapo.compute_score),
}
MATH_DAPO_PREFIX = "aime"
"""Data sources starting with it (`aime24`, `aime_2025`, ...) are scored by math_dapo, as upstream."""


def _code_score(solution_str, ground_truth, sandbox_fusion_url, concurrent_semaphore, memory_limit_mb) -> float:
    if sandbox_fusion_url:
        from verl.utils.reward_score import sandbox_fusion

        score, _ = sandbox_fusion.compute_score(
            sandbox_fusion_url, concurrent_semaphore, memory_limit_mb, solution_str, ground_truth, continuous=True
        )
    else:
        from verl.utils.reward_score import prime_code

        score, _ = prime_code.compute_score(solution_str, ground_truth, continuous=True)
    return float(score)


def default_compute_score(
    data_source,
    solution_str,
    ground_truth,
    extra_info=None,
    sandbox_fusion_url=None,
    concurrent_semaphore=None,
    memory_limit_mb=None,
    **kwargs,
) -> float | dict:
    """Score one response with the rule for its data source.

    Args:
        data_source: the dataset name stored in the sample's ``data_source`` column ("openai/gsm8k", ...).
        solution_str: the decoded response.
        ground_truth: ``reward_model.ground_truth`` of the sample.
        extra_info: the sample's ``extra_info`` (unused by the built-in rules; part of the signature that
            custom reward functions share).
        sandbox_fusion_url: a SandboxFusion ``run_code`` URL for the code data sources (None: run locally).
        concurrent_semaphore: a ``threading.Semaphore`` bounding the SandboxFusion requests in flight.
        memory_limit_mb: SandboxFusion's memory limit per run (None: 1024).
        kwargs: further upstream options of routes this implementation does not have; a data source
            that needed them raises ``NotImplementedError`` like any unknown one.

    Returns:
        A float, or a dict with at least a ``"score"`` key when a rule reports more than one value.

    Raises:
        NotImplementedError: no rule for ``data_source``.
    """
    if data_source in CODE_DATA_SOURCES:
        return _code_score(solution_str, ground_truth, sandbox_fusion_url, concurrent_semaphore, memory_limit_mb)
    fn = SCORE_FNS.get(data_source)
    if fn is None and str(data_source).startswith(MATH_DAPO_PREFIX):
        fn = math_dapo.compute_score
    if fn is None:
        raise NotImplementedError(
            f"no reward function for data_source={data_source!r}; the built-in ones are "
            f"{sorted(SCORE_FNS) + sorted(CODE_DATA_SOURCES)} and any starting with {MATH_DAPO_PREFIX!r}. "
            "Write a function compute_score(data_source, solution_str, ground_truth, extra_info) in a Python "
            "file and point custom_reward_function.path (and custom_reward_function.name) at it."
        )
    result = fn(solution_str, ground_truth)
    return result if isinstance(result, dict) else float(result)


__all__ = ["CODE_DATA_SOURCES", "NUMINA_DATA_SOURCES", "SCORE_FNS", "SEARCH_R1_DATA_SOURCES", "default_compute_score"]
