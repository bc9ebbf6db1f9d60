"""Search-R1's exact-match scorer, the Math-Verify scorer and the batched scorer, on hand-worked answers."""

from __future__ import annotations

import pytest

from verl.utils.reward_score import SEARCH_R1_DATA_SOURCES, default_compute_score, math_batch
from verl.utils.reward_score import search_r1_like_qa_em as qa


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   APPLE, a day!", "apple day"),
        ("Theodore", "theodore"),  # "the" only as a whole word
        ("U.S.A.", "usa"),
    ],
)
def test_normalize_answer_drops_case_punctuation_articles_and_extra_spaces(text, expected):
    assert qa.normalize_answer(text) == expected


def test_the_last_answer_tag_is_scored_and_without_one_the_score_is_zero():
    gt = {"target": ["Paris", "paris, france"]}
    assert qa.compute_score("<answer>Paris</answer>", gt) == 1.0
    # the format example quoted first does not count; the last tag does
    assert qa.compute_score("use <answer>x</answer> ... <answer> the paris </answer>", gt) == 1.0
    assert qa.compute_score("<answer>Paris</answer> then <answer>Lyon</answer>", gt) == 0.0
    assert qa.compute_score("Paris", gt) == 0
    assert qa.compute_score("<answer>Lyon</answer>", gt, format_score=0.1) == 0.1
    assert qa.compute_score("<answer>Paris, France.</answer>", gt, score=2.0) == 2.0


def test_a_correct_answer_among_more_than_ten_tags_gets_a_quarter():
    gt = {"target": ["Paris"]}
    spam = "<answer>x</answer>" * 10 + "<answer>Paris</answer>"  # 11 opening, 11 closing
    assert qa.count_answer_tags(spam) == (11, 11)
    assert qa.compute_score(spam, gt) == 0.25
    assert qa.compute_score("<answer>x</answer>" * 9 + "<answer>Paris</answer>", gt) == 1.0  # 10 tags: in full


def test_substring_match_and_string_ground_truth():
    assert qa.compute_score_subem("<answer>it is Paris in France</answer>", {"target": ["paris"]}) == 1.0
    assert qa.compute_score("<answer>it is Paris in France</answer>", {"target": ["paris"]}) == 0.0
    assert qa.em_check("Paris", "paris") == 1  # a bare string is one gold answer
    with pytest.raises(ValueError, match="no 'target' key"):
        qa.compute_score("<answer>Paris</answer>", {"answer": ["Paris"]})


@pytest.mark.parametrize("source", SEARCH_R1_DATA_SOURCES)
def test_default_compute_score_routes_every_search_r1_source(source):
    gt = {"target": ["1994"]}
    assert default_compute_score(source, "<answer>1994</answer>", gt) == 1.0
    assert default_compute_score(source, "<answer>1995</answer>", gt) == 0.0


def test_math_verify_compares_symbolically():
    from verl.utils.reward_score import math_verify as mv

    assert mv.compute_score("so the answer is $\\sqrt{8}$", "2\\sqrt{2}") == 1.0
    assert mv.compute_score("the answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert mv.compute_score("the answer is 4", "3") == 0.0
    assert mv.compute_score("no number here", "3") == 0.0


def test_batched_math_scores_each_response_and_checks_lengths():
    scores = math_batch.compute_score_batched(
        ["lighteval/MATH"] * 3,
        ["\\boxed{\\frac{1}{2}}", "\\boxed{3}", "no box"],
        ["0.5", "4", "1"],
        [None] * 3,
    )
    assert scores == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        math_batch.compute_score_batched(["a", "a"], ["x", "y"], ["1"], [None, None])
