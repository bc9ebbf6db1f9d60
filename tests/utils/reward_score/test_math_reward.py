import pytest

from verl.utils.reward_score import math_reward


def test_last_boxed_with_nested_braces():
    text = r"first \boxed{1} then \boxed{\frac{\sqrt{3}}{2}} done"
    assert math_reward.last_boxed_only_string(text) == r"\boxed{\frac{\sqrt{3}}{2}}"
    assert math_reward.extract_answer(text) == r"\frac{\sqrt{3}}{2}"


def test_fbox_and_space_forms():
    assert math_reward.extract_answer(r"so \fbox{42}") == "42"
    assert math_reward.extract_answer(r"so $\boxed 42$.") == "42"


def test_malformed_box_gives_no_answer():
    assert math_reward.extract_answer(r"cut off \boxed{\frac{1}{2}") is None
    assert math_reward.extract_answer("no box here") is None
    assert math_reward.compute_score(r"cut off \boxed{\frac{1}{2}", r"\frac{1}{2}") == 0.0


def test_several_boxes_the_last_one_counts():
    assert math_reward.compute_score(r"\boxed{3} no wait \boxed{4}", "4") == 1.0
    assert math_reward.compute_score(r"\boxed{4} no wait \boxed{3}", "4") == 0.0


@pytest.mark.parametrize(
    "answer, truth",
    [
        (r"\frac{1}{2}", "1/2"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        (".5", "0.5"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"-\frac{3}{4}", "-0.75"),
        (r"\frac{-3}{4}", "-3/4"),
        ("5.0", "5"),
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        (r"5\text{ cm}", "5"),
        ("12 cm", "12"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        ("x = 5", "5"),
        (r"\$18.90", "18.9"),
        (r"50\%", "50"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"2 \sqrt{2}", r"2\sqrt2"),
        (r"\text{(B)}", "(B)"),
    ],
)
def test_equivalent_forms_are_equal(answer, truth):
    assert math_reward.is_equiv(answer, truth), (math_reward.normalize_answer(answer), truth)
    assert math_reward.compute_score(rf"The answer is $\boxed{{{answer}}}$.", truth) == 1.0


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("0.33", r"\frac{1}{3}"),  # not exact
        ("3", "4"),
        (r"\sqrt{8}", r"2\sqrt{2}"),  # symbolic equivalence is out of scope
        ("(1,2)", "(2,1)"),
        ("x = 5", "x = 6"),
    ],
)
def test_different_answers_are_not_equal(answer, truth):
    assert not math_reward.is_equiv(answer, truth)


def test_ground_truth_given_as_full_solution_uses_its_last_box():
    assert math_reward.compute_score(r"\boxed{7}", r"We add, so the answer is $\boxed{7}$.") == 1.0


def test_division_by_zero_in_a_fraction_is_not_a_number():
    assert not math_reward.is_equiv("1/0", "0")
