import pytest

from verl.utils.reward_score import arith, countdown


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("85", "85", 1.0),
        ("  85<eos>", "85", 1.0),
        ("85 is the answer", 85, 1.0),
        ("84", "85", 0.0),
        ("The answer is 85", "85", 1.0),  # text before the first integer is allowed
        ("37+48=85", "85", 0.0),  # the first integer is 37
        ("-12", "-12", 1.0),
        ("12", "-12", 0.0),
        ("", "85", 0.0),
        ("   ", "85", 0.0),
        ("eighty-five", "85", 0.0),
    ],
)
def test_arith_first_integer_must_match(response, truth, expected):
    assert arith.compute_score(response, truth) == expected


def test_arith_non_integer_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="must be an integer"):
        arith.compute_score("85", "eighty-five")


GT = {"target": 24, "numbers": [4, 6, 1]}


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>...</think><answer>4 * 6 * 1</answer>", 1.0),
        ("<answer>(6 - 1 - 1) * 6</answer>", 0.1),  # numbers misused
        ("<answer>4 * 6</answer>", 0.1),  # 1 not used
        ("<answer>4 * 6 + 1</answer>", 0.1),  # 25, wrong target
        ("<answer>(4 / 1) * 6 = 24</answer>", 1.0),  # trailing '= result' ignored
        ("<answer>6 / (1 - 1 + 0) * 4</answer>", 0.1),  # division by zero, and 0 not given
        ("<answer>__import__('os').system('echo hi')</answer>", 0.1),  # never executed
        ("<answer>4 ** 6 * 1</answer>", 0.1),  # power is not allowed
        ("<answer>4.0 * 6 * 1</answer>", 0.1),  # float literals are not given numbers
        ("<answer>1 * 2</answer> then <answer>1*6*4</answer>", 1.0),  # last answer counts
        ("4 * 6 * 1", 0.0),  # no answer tags
    ],
)
def test_countdown_scoring(response, expected):
    assert countdown.compute_score(response, GT) == expected


def test_countdown_exact_fraction_arithmetic():
    assert countdown.compute_score("<answer>(6 / 4) * 4</answer>", {"target": 6, "numbers": [6, 4, 4]}) == 1.0
    assert countdown.compute_score("<answer>(1 / 3) * 3</answer>", {"target": 1, "numbers": [1, 3, 3]}) == 1.0


def test_countdown_bad_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="target"):
        countdown.compute_score("<answer>1</answer>", "24")
