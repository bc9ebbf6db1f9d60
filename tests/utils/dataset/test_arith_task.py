"""The arithmetic task: seeded generation, disjoint splits, correct ground truth, parquet schema,
cache, and the first-integer rule."""

from __future__ import annotations

import os

import pytest

from verl.utils.dataset.arith import (
    ArithTask,
    ensure_arith_data,
    extract_first_integer,
    load_rows,
    make_arith_rows,
    write_arith_parquet,
)


def _expressions(rows):
    return [r["extra_info"]["expression"] for r in rows]


def test_same_seed_gives_identical_rows_and_another_seed_does_not():
    assert make_arith_rows(200, 50, seed=7) == make_arith_rows(200, 50, seed=7)
    assert make_arith_rows(200, 50, seed=7) != make_arith_rows(200, 50, seed=8)


def test_test_split_does_not_depend_on_the_train_size():
    _, test_small = make_arith_rows(10, 50, seed=3)
    _, test_large = make_arith_rows(2000, 50, seed=3)
    assert test_small == test_large


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"ops": "+-*", "steps": 3},
        {"ops": "+-", "style": "word"},
        {"ops": "-*", "steps": 2, "style": "word"},
    ],
)
def test_splits_are_disjoint_and_free_of_duplicates(kwargs):
    train, test = make_arith_rows(1500, 300, seed=0, **kwargs)
    train_exprs, test_exprs = _expressions(train), _expressions(test)
    assert len(set(train_exprs)) == 1500 and len(set(test_exprs)) == 300
    assert not set(train_exprs) & set(test_exprs)


def test_splits_can_use_up_every_distinct_problem():
    task = ArithTask(digits=1, ops=("+",))
    assert task.num_distinct_problems == 100
    train, test = make_arith_rows(90, 10, digits=1, seed=0)
    assert len(set(_expressions(train)) | set(_expressions(test))) == 100


def test_asking_for_more_problems_than_exist_says_how_many_there_are():
    with pytest.raises(ValueError, match="has only 100"):
        make_arith_rows(95, 10, digits=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ops": "+-*", "steps": 1},
        {"ops": "+-*", "steps": 3},
        {"ops": "+-*", "steps": 1, "style": "word"},
        {"ops": "+-*", "steps": 3, "style": "word", "digits": 3},
    ],
)
def test_ground_truth_equals_python_evaluation_of_the_expression(kwargs):
    train, test = make_arith_rows(300, 100, seed=1, **kwargs)
    for row in train + test:
        expected = eval(row["extra_info"]["expression"])  # independent reference: Python's own precedence
        assert row["reward_model"]["ground_truth"] == str(expected) == row["extra_info"]["answer"]


def test_plain_prompt_contains_the_expression_verbatim():
    train, _ = make_arith_rows(50, 10, ops="+-*", steps=2, seed=0)
    for row in train:
        assert row["prompt"][0]["content"] == f"What is {row['extra_info']['expression']}?"


def test_default_task_is_two_digit_addition_in_the_upstream_schema():
    train, test = make_arith_rows(100, 20, seed=0)
    row = test[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "arith" and row["ability"] == "math"
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["style"] == "rule"
    assert row["extra_info"]["split"] == "test" and row["extra_info"]["index"] == 0
    for r in train + test:
        a, b = map(int, r["extra_info"]["expression"].split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99


def test_one_step_subtraction_word_problems_never_go_negative():
    train, test = make_arith_rows(400, 100, ops="-", style="word", seed=0)
    assert all(int(r["reward_model"]["ground_truth"]) >= 0 for r in train + test)


def test_invalid_task_options_are_rejected_with_the_valid_choices():
    with pytest.raises(ValueError, match=r"\['\+', '-', '\*'\]"):
        ArithTask(ops=("/",))
    with pytest.raises(ValueError, match="plain"):
        ArithTask(style="poem")


def test_parquet_round_trip_keeps_rows(tmp_path):
    train_path, test_path = write_arith_parquet(str(tmp_path), num_train=30, num_test=10, ops="+-", seed=2)
    train, test = make_arith_rows(30, 10, ops="+-", seed=2)
    assert load_rows(train_path) == train and load_rows(test_path) == test
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]


def test_ensure_arith_data_generates_once_into_the_cache_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    train_path, test_path = ensure_arith_data()
    assert train_path == os.path.join(str(tmp_path), "data", "arith", "train.parquet")
    assert len(load_rows(test_path)) == 500 and len(load_rows(train_path)) == 5000
    mtime = os.path.getmtime(train_path)
    assert ensure_arith_data() == (train_path, test_path)
    assert os.path.getmtime(train_path) == mtime


@pytest.mark.parametrize(
    ("text", "expected"),
    [("85", 85), ("85<eos>", 85), (" -34 apples", -34), ("it is 12, not 13", 12), ("no digits", None), ("", None)],
)
def test_extract_first_integer(text, expected):
    assert extract_first_integer(text) == expected
