"""The preprocessing scripts, run as a user runs them (subprocesses) on small files in the original
datasets' formats, so no download is needed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from verl.utils.reward_score import default_compute_score

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "data_preprocess"


def _run(script, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *map(str, args)], capture_output=True, text=True, env=env, timeout=120
    )


def _read(path):
    return pq.read_table(path).to_pylist()


GSM8K_TRAIN = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {"question": "A shop sells 1000 pens at $1 each. How much money?", "answer": "1000*1=1000\n#### 1,000"},
]
GSM8K_TEST = [{"question": "What is 5 minus 8?", "answer": "5-8=-3\n#### -3"}]


def test_gsm8k_from_a_local_snapshot(tmp_path):
    snapshot = tmp_path / "gsm8k" / "main"
    snapshot.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(GSM8K_TRAIN), snapshot / "train-00000-of-00001.parquet")
    (snapshot / "test-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_TEST))
    out = tmp_path / "out"
    result = _run("gsm8k.py", "--local_dataset_path", tmp_path / "gsm8k", "--local_dir", out)
    assert result.returncode == 0, result.stderr

    train, test = _read(out / "train.parquet"), _read(out / "test.parquet")
    assert len(train) == 2 and len(test) == 1
    row = train[0]
    assert row["data_source"] == "openai/gsm8k"
    assert row["ability"] == "math"
    assert row["prompt"] == [
        {
            "role": "user",
            "content": GSM8K_TRAIN[0]["question"]
            + ' Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert row["extra_info"] == {
        "split": "train",
        "index": 0,
        "answer": GSM8K_TRAIN[0]["answer"],
        "question": GSM8K_TRAIN[0]["question"],
    }
    assert [r["reward_model"]["ground_truth"] for r in train + test] == ["72", "1000", "-3"]
    assert test[0]["extra_info"]["split"] == "test"
    # the reference solutions score full marks under the default reward
    for r in train + test:
        score = default_compute_score(r["data_source"], r["extra_info"]["answer"], r["reward_model"]["ground_truth"])
        assert score == 1.0


def test_gsm8k_missing_local_path_is_a_clear_error(tmp_path):
    result = _run("gsm8k.py", "--local_dataset_path", tmp_path / "nope", "--local_dir", tmp_path / "out")
    assert result.returncode != 0
    assert "is not a directory" in result.stderr


MATH_TRAIN = [
    {
        "problem": "What is $\\frac{1}{4}+\\frac{1}{4}$?",
        "solution": "We add: $\\frac{1}{4}+\\frac{1}{4}=\\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {"problem": "No answer here.", "solution": "There is no boxed answer.", "level": "Level 2", "type": "Algebra"},
]
MATH_TEST = [
    {
        "problem": "How long is the side?",
        "solution": "First $\\boxed{3}$, no: the side is $\\boxed{5\\text{ cm}}$.",
        "level": "Level 3",
        "type": "Geometry",
    }
]


def test_math_from_a_local_snapshot_skips_unboxed_solutions(tmp_path):
    snapshot = tmp_path / "math" / "data"
    snapshot.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(MATH_TRAIN), snapshot / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(MATH_TEST), snapshot / "test-00000-of-00001.parquet")
    out = tmp_path / "out"
    result = _run("math_dataset.py", "--local_dataset_path", tmp_path / "math", "--local_dir", out)
    assert result.returncode == 0, result.stderr
    assert "skipped 1 without a boxed answer" in result.stdout

    train, test = _read(out / "train.parquet"), _read(out / "test.parquet")
    assert len(train) == 1 and len(test) == 1
    assert train[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert train[0]["prompt"][0]["content"].endswith(
        "Let's think step by step and output the final answer within \\boxed{}."
    )
    assert train[0]["reward_model"] == {"style": "rule", "ground_truth": "\\frac{1}{2}"}
    assert train[0]["extra_info"] == {"split": "train", "index": 0, "level": "Level 1", "type": "Prealgebra"}
    assert test[0]["reward_model"]["ground_truth"] == "5\\text{ cm}"  # the last box
    for original, row in ((MATH_TRAIN[0], train[0]), (MATH_TEST[0], test[0])):
        assert (
            default_compute_score(row["data_source"], original["solution"], row["reward_model"]["ground_truth"]) == 1.0
        )
    assert default_compute_score(test[0]["data_source"], "\\boxed{5}", test[0]["reward_model"]["ground_truth"]) == 1.0


def test_countdown_generated_offline_is_solvable_and_splits_are_disjoint(tmp_path):
    out = tmp_path / "out"
    result = _run("countdown.py", "--local_dir", out, "--train_size", 200, "--test_size", 50, "--seed", 3)
    assert result.returncode == 0, result.stderr
    train, test = _read(out / "train.parquet"), _read(out / "test.parquet")
    assert len(train) == 200 and len(test) == 50
    for row in train + test:
        truth = row["reward_model"]["ground_truth"]
        assert row["data_source"] == "countdown"
        assert 3 <= len(truth["numbers"]) <= 4 and 1 <= truth["target"] <= 999
        assert str(truth["numbers"]) in row["prompt"][0]["content"]
        answer = f"<think>...</think><answer>{row['extra_info']['solution']}</answer>"
        assert default_compute_score("countdown", answer, truth) == 1.0

    def key(row):
        truth = row["reward_model"]["ground_truth"]
        return tuple(sorted(truth["numbers"])), truth["target"]

    assert not {key(r) for r in train} & {key(r) for r in test}


def test_countdown_from_a_local_file(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"target": 10 + i, "nums": [i, 10]}) + "\n" for i in range(1, 6)))
    out = tmp_path / "out"
    result = _run("countdown.py", "--local_dataset_path", tasks, "--local_dir", out, "--test_size", 2)
    assert result.returncode == 0, result.stderr
    train, test = _read(out / "train.parquet"), _read(out / "test.parquet")
    assert [r["reward_model"]["ground_truth"]["target"] for r in train] == [11, 12, 13]
    assert [r["reward_model"]["ground_truth"] for r in test] == [
        {"target": 14, "numbers": [4, 10]},
        {"target": 15, "numbers": [5, 10]},
    ]
    assert default_compute_score("countdown", "<answer>4 + 10</answer>", test[0]["reward_model"]["ground_truth"]) == 1.0
