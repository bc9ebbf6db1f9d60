"""`python -m verl.trainer.main_eval`: pass@k against hand-worked values and brute-force enumeration,
and end-to-end scoring of a hand-written responses file per data source."""

import itertools
import json
from fractions import Fraction

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.trainer.main_eval import compute_metrics, main, pass_at_k


def test_pass_at_k_hand_worked_values():
    # 5 responses, 2 correct, pick 2: P(no correct) = C(3,2)/C(5,2) = 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    # 4 responses, 1 correct, pick 2: P(no correct) = C(3,2)/C(4,2) = 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-15)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5, abs=1e-15), "pass@1 is the fraction correct"
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 3, 3) == 1.0, "3 picks out of 2 wrong ones must include a correct one"
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_pass_at_k_equals_brute_force_enumeration_of_all_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(correct, k))
                exact = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-15), (n, c, k)


def test_pass_at_k_stays_exact_for_large_n():
    # C(2000, 1000) ~ 2e600 overflows a float; exact integers keep the ratio exact. With one
    # correct response C(n-1, k) / C(n, k) = (n-k)/n, so pass@k = k/n
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-15)
    assert pass_at_k(2000, 3, 1000) == pytest.approx(1 - (1000 * 999 * 998) / (2000 * 1999 * 1998), abs=1e-15)


def test_metrics_reject_prompts_with_different_numbers_of_responses():
    with pytest.raises(ValueError, match=r"prompts have \[2, 3\] responses"):
        compute_metrics({"arith": [[(1.0, True)] * 2, [(0.0, False)] * 3]})


def write_responses(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def row(data_source, ground_truth, responses):
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": "q"}],
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"index": 0},
        "responses": responses,
    }


def test_scores_each_data_source_with_its_rule_and_writes_json(tmp_path, capsys):
    path = write_responses(
        tmp_path / "gen.parquet",
        [
            row("arith", "85", ["85", "12", "85 is the answer"]),  # scores 1, 0, 1
            row("arith", "10", ["1", "2", "3"]),  # 0, 0, 0
            row("openai/gsm8k", "72", ["so #### 72", "#### 7"]),  # 1, 0
        ],
    )
    main([f"data.path={path}"])
    metrics = json.loads((tmp_path / "gen.eval.json").read_text())
    assert metrics.keys() == {"arith", "openai/gsm8k"}
    arith = metrics["arith"]
    assert arith["num_prompts"] == 2 and arith["n"] == 3
    assert arith["mean@3"] == pytest.approx(2 / 6)
    # prompt 1: c=2 of 3 -> pass@1 2/3, pass@2 1 - C(1,2)/C(3,2) = 1, pass@3 1; prompt 2: all 0
    assert arith["pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert arith["pass@2"] == pytest.approx(0.5) and arith["pass@3"] == pytest.approx(0.5)
    assert metrics["openai/gsm8k"] == {"num_prompts": 1, "n": 2, "mean@2": 0.5, "pass@1": 0.5, "pass@2": 1.0}
    out = capsys.readouterr().out
    assert "arith (2 prompts x 3): mean@3=0.3333 pass@1=0.3333 pass@2=0.5000 pass@3=0.5000" in out


CUSTOM_REWARD = """
def partial_credit(data_source, solution_str, ground_truth, extra_info=None, full=1.0):
    if solution_str == ground_truth:
        return full
    return 0.5 if solution_str.startswith(ground_truth[0]) else 0.0


def with_acc(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": -1.0, "acc": solution_str == ground_truth}


def three_arguments(data_source, response, ground_truth):  # verl-recipe open_math_reasoning's signature
    return float(response == ground_truth)


def wants_extra_info(data_source, solution_str, ground_truth, **kwargs):
    return float(kwargs["extra_info"]["bonus"])
"""


def test_custom_reward_function_partial_credit_counts_in_the_mean_but_not_as_a_pass(tmp_path):
    (tmp_path / "reward.py").write_text(CUSTOM_REWARD)
    path = write_responses(tmp_path / "gen.parquet", [row("my_task", "yes", ["yes", "yak", "no", "nope"])])
    out = tmp_path / "m.json"
    common = [f"data.path={path}", f"data.output_path={out}", f"custom_reward_function.path={tmp_path / 'reward.py'}"]
    main([*common, "custom_reward_function.name=partial_credit", "+custom_reward_function.reward_kwargs.full=2.0"])
    metrics = json.loads(out.read_text())["my_task"]
    assert metrics["mean@4"] == pytest.approx((2.0 + 0.5 + 0 + 0) / 4)
    assert metrics["pass@1"] == pytest.approx(1 / 4) and metrics["pass@4"] == 1.0
    # a dict result with an `acc` entry decides correctness whatever the score
    main([*common, "custom_reward_function.name=with_acc"])
    metrics = json.loads(out.read_text())["my_task"]
    assert metrics["mean@4"] == -1.0 and metrics["pass@1"] == pytest.approx(1 / 4)


def test_a_reward_function_without_extra_info_gets_upstreams_three_arguments(tmp_path):
    (tmp_path / "reward.py").write_text(CUSTOM_REWARD)
    path = write_responses(tmp_path / "gen.parquet", [row("my_task", "yes", ["yes", "no", "no", "no"])])
    out = tmp_path / "m.json"
    common = [f"data.path={path}", f"data.output_path={out}", f"custom_reward_function.path={tmp_path / 'reward.py'}"]
    main([*common, "custom_reward_function.name=three_arguments"])
    assert json.loads(out.read_text())["my_task"]["mean@4"] == pytest.approx(1 / 4)
    with_bonus = row("my_task", "yes", ["yes", "no", "no", "no"])
    with_bonus["extra_info"] = {"index": 0, "bonus": 0.25}
    write_responses(path, [with_bonus])
    main([*common, "custom_reward_function.name=wants_extra_info"])  # **kwargs: extra_info is passed
    assert json.loads(out.read_text())["my_task"]["mean@4"] == pytest.approx(0.25)


def test_unknown_data_source_and_missing_column_errors_say_what_to_set(tmp_path):
    path = write_responses(tmp_path / "gen.parquet", [row("my_task", "yes", ["yes"])])
    with pytest.raises(RuntimeError, match=r"row 0, response 0 \(data_source='my_task'\).*custom_reward_function.path"):
        main([f"data.path={path}"])
    with pytest.raises(ValueError, match=r"no column 'answers' \(data.response_key\)"):
        main([f"data.path={path}", "data.response_key=answers"])
