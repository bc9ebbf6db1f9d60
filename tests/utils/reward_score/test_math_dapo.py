"""DAPO's math reward (verl/utils/reward_score/math_dapo.py) on hand-worked answers, and its routes
in default_compute_score."""

from __future__ import annotations

import pytest

from verl.utils.reward_score import default_compute_score, math_dapo


@pytest.mark.parametrize(
    ("answer", "normalized"),
    [
        ("x = \\frac{3}{4}", "\\frac{3}{4}"),  # the part after the last "="
        ("1,000 dollars", "1000"),  # units dropped, thousands separators of an integer removed
        ("2,3", "23"),  # digits once the commas are gone: read as one integer (Minerva's rule)
        ("(2,3)", "(2,3)"),  # not digits without the commas: they stay
        ("$\\frac12$", "\\frac{1}{2}"),  # shorthand TeX spelled out, $ dropped
        ("\\sqrt2", "\\sqrt{2}"),
        ("\\text{(B)}", "(B)"),
        ("10^\\circ", "10"),
        ("\\boxed{7}", "7"),
        ("an apple", "apple"),  # articles go by plain text replacement ("an " then "a ")
        ("a b", "b"),
    ],
)
def test_answers_normalize_as_minerva_does(answer, normalized):
    assert math_dapo.normalize_final_answer(answer) == normalized


def test_the_last_answer_line_is_scored_plus_or_minus_one():
    response = "First try. Answer: 3\nNo wait.\nAnswer: \\frac12"
    assert math_dapo.compute_score(response, "\\frac{1}{2}") == {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}
    assert math_dapo.compute_score(response, "3") == {"score": -1.0, "acc": False, "pred": "\\frac{1}{2}"}
    assert math_dapo.compute_score("no answer line", "5")["pred"] == "[INVALID]"
    # only the last 300 characters count
    assert math_dapo.compute_score("Answer: 5" + "." * 300, "5")["acc"] is False


def test_strict_box_compares_the_last_box_of_the_tail_exactly():
    assert math_dapo.compute_score("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", strict_box_verify=True)["acc"]
    # exact text: no normalisation, and \fbox is not a box here
    assert not math_dapo.compute_score("so \\boxed{0.5}", "\\frac{1}{2}", strict_box_verify=True)["acc"]
    assert math_dapo.compute_score("\\fbox{5}", "5", strict_box_verify=True) == {
        "score": -1.0,
        "acc": False,
        "pred": None,
    }
    assert not math_dapo.compute_score("\\boxed{5}" + "x" * 100, "5", strict_box_verify=True)["acc"]


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime24", "aime_2025"])
def test_default_compute_score_routes_dapo_sources(source):
    assert default_compute_score(source, "Answer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
