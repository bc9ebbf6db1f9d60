"""Exact-match scoring of question answering with search (Search-R1's data sources, `searchR1_*`).

The response gives its final answer between `<answer>` and `</answer>`; when there are several, the last
one counts (a response quoting the format before answering still scores). The answer and each gold answer
are normalised (lower case, punctuation and the articles a/an/the removed, whitespace collapsed) before
comparing, as SQuAD-style EM does. `ground_truth` is the dataset's `{"target": [gold, ...]}` (a single
string is taken as one gold answer).

Scores (upstream's): `score` for a match, `format_score` for an extracted answer that does not match, 0
without an answer tag. A matching answer in a response with more than 10 opening or closing answer tags
gets a quarter of `score` (spamming tags to hit the answer is not rewarded in full).
`compute_score_subem` counts a match when a normalised gold answer is a substring of the answer.
"""

from __future__ import annotations

import re
import string

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
MAX_ANSWER_TAGS = 10
"""More opening or closing `<answer>` tags than this divides the score of a correct answer by 4."""


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces: "The  Eiffel-Tower!" -> "eiffeltower"."""
    text = str(text).lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def _golds(golden_answers) -> list[str]:
    if isinstance(golden_answers, str):
        return [golden_answers]
    return [str(g) for g in golden_answers]


def em_check(prediction: str, golden_answers) -> int:
    """1 when the normalised prediction equals a normalised gold answer, else 0."""
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) == pred for g in _golds(golden_answers)))


def subem_check(prediction: str, golden_answers) -> int:
    """1 when a normalised gold answer occurs inside the normalised prediction, else 0."""
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) in pred for g in _golds(golden_answers)))


def extract_solution(solution_str: str) -> str | None:
    """The text of the last `<answer>...</answer>` (stripped), or None when there is none."""
    matches = _ANSWER_RE.findall(solution_str)
    return matches[-1].strip() if matches else None


def count_answer_tags(text: str) -> tuple[int, int]:
    """(opening, closing) `<answer>` tags in the text."""
    return text.count("<answer>"), text.count("</answer>")


def _targets(ground_truth):
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(
                f"searchR1 ground truth {ground_truth!r} has no 'target' key; the preprocessed rows hold "
                "reward_model.ground_truth = {'target': [gold answers]} (examples/data_preprocess/preprocess_search_r1_dataset.py)"
            )
        return ground_truth["target"]
    return ground_truth


def compute_score(
    solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0, score: float = 1.0
):
    """Exact match of the last `<answer>` against the gold answers (module docstring for the scores).
    `method` is accepted for upstream's signature; extraction is always the answer tag."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    if not em_check(answer, _targets(ground_truth)):
        return format_score
    opening, closing = count_answer_tags(solution_str)
    if opening > MAX_ANSWER_TAGS or closing > MAX_ANSWER_TAGS:
        return score / 4
    return score


def compute_score_subem(
    solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0, score: float = 1.0
):
    """Substring match of the last `<answer>` against the gold answers."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if subem_check(answer, _targets(ground_truth)) else format_score
