"""Geometry3K's format + accuracy score (upstream's weights) and the colour task's exact match, hand-worked."""

import pytest

from verl.utils.reward_score import default_compute_score, geo3k, vl_colors


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        # format and answer: 0.9 * 1 + 0.1 * 1
        ("<think>The angles sum to 180.</think> So x is \\boxed{60}.", "60", 1.0),
        # right answer, no think block: 0.9
        ("x = \\boxed{60}", "60", 0.9),
        # format only: 0.1
        ("<think>guess</think>\\boxed{50}", "60", 0.1),
        # no box at all: neither
        ("<think>x is 60</think> 60", "60", 0.0),
        # equivalent forms of the same answer
        ("<think>a</think>\\boxed{2 \\sqrt 3}", "2\\sqrt{3}", 1.0),
        ("<think>a</think>\\boxed{\\dfrac{20}{3}}", "\\frac{20}{3}", 1.0),
        ("<think>a</think>\\boxed{12.0}", "12", 1.0),
        # the last box counts
        ("<think>a</think>\\boxed{5} no, \\boxed{7}", "7", 1.0),
        # think must open the response
        ("Sure. <think>a</think>\\boxed{7}", "7", 0.9),
    ],
)
def test_geo3k_score_hand_worked(response, truth, expected):
    assert geo3k.compute_score(response, truth) == pytest.approx(expected)
    assert default_compute_score("hiyouga/geometry3k", response, truth) == pytest.approx(expected)


def test_geo3k_options():
    assert geo3k.compute_score("60", "60", use_boxed=False) == pytest.approx(0.9)
    assert geo3k.compute_score("<think>a</think>\\boxed{60}", "60", format_score=0.0) == 1.0
    assert geo3k.compute_score("<think>a</think>\\boxed{61}", "60", format_score=0.5) == 0.5
    assert geo3k.format_reward("<think>\nmulti\nline\n</think>\n\\boxed{1}\n") == 1.0


def test_vl_colors_exact_match():
    assert vl_colors.compute_score("red", "red") == 1.0
    assert vl_colors.compute_score(" Red.\n", "red") == 1.0
    assert vl_colors.compute_score("red, maybe blue", "red") == 0.0
    assert vl_colors.compute_score("reddish", "red") == 0.0
    assert default_compute_score("vl_colors", "blue", "blue") == 1.0
    assert default_compute_score("vl_colors", "", "blue") == 0.0
