import pytest

from verl.utils.reward_score import default_compute_score


@pytest.mark.parametrize(
    "data_source, response, truth",
    [
        ("openai/gsm8k", "#### 72", "72"),
        ("lighteval/MATH", r"\boxed{\frac{1}{2}}", "0.5"),
        ("DigitalLearningGmbH/MATH-lighteval", r"\boxed{3}", "3"),
        ("HuggingFaceH4/MATH-500", r"\boxed{3}", "3"),
        ("arith", "85", "85"),
        ("countdown", "<answer>1+2</answer>", {"target": 3, "numbers": [1, 2]}),
    ],
)
def test_routes_each_data_source_to_its_rule(data_source, response, truth):
    score = default_compute_score(data_source, response, truth, extra_info={"index": 0})
    assert isinstance(score, float) and score == 1.0


def test_wrong_answers_score_zero():
    assert default_compute_score("openai/gsm8k", "#### 71", "72") == 0.0
    assert default_compute_score("arith", "84", "85") == 0.0


def test_unknown_data_source_lists_known_ones_and_points_to_custom_reward():
    with pytest.raises(NotImplementedError) as info:
        default_compute_score("my/dataset", "x", "y")
    message = str(info.value)
    assert "my/dataset" in message and "openai/gsm8k" in message and "custom_reward_function.path" in message


def test_upstream_extra_keyword_arguments_are_accepted():
    assert default_compute_score("arith", "85", "85", None, sandbox_fusion_url=None) == 1.0
