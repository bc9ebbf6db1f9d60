import pytest

from verl.utils.reward_score import gsm8k


@pytest.mark.parametrize(
    "response, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", 1.0),
        ("#### 1,000", 1.0),  # thousands separator
        ("The cost is #### $1000.00", 1.0),  # dollar sign and trailing zeros
        ("#### 70", 0.0),  # wrong answer: format_score, 0 by default
        ("The answer is 1000", 0.0),  # strict needs the #### marker
        ("", 0.0),
    ],
)
def test_strict_extraction_scores_answer_after_marker(response, expected):
    assert gsm8k.compute_score(response, "1000" if "1" in response else "7") == expected


def test_strict_uses_the_last_marker_when_repeated():
    assert gsm8k.extract_solution("#### 5 wait, no: #### 6") == "6"
    assert gsm8k.compute_score("#### 5 wait, no: #### 6", "6") == 1.0


def test_negative_answers():
    assert gsm8k.extract_solution("#### -12") == "-12"
    assert gsm8k.compute_score("#### -12", "-12") == 1.0
    assert gsm8k.compute_score("#### 12", "-12") == 0.0


def test_flexible_takes_the_last_number_and_ignores_trailing_period():
    response = "First 12 eggs, then 3 more, so 15."
    assert gsm8k.extract_solution(response, method="flexible") == "15"
    assert gsm8k.compute_score(response, "15", method="flexible") == 1.0
    assert gsm8k.compute_score(response, "15", method="strict") == 0.0


def test_flexible_handles_commas_and_dollars():
    assert gsm8k.compute_score("It costs $2,500 in total", "2500", method="flexible") == 1.0


def test_format_score_is_given_for_a_wrong_but_well_formed_answer():
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "7", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 7", "7", score=2.0) == 2.0


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="strict"):
        gsm8k.compute_score("#### 7", "7", method="lenient")
