"""Upstream's other preprocessing scripts (multi-turn GSM8K and Geometry3K with tools, Search-R1, ReTool's
DAPO/AIME, SFT conversations, HellaSwag, HH-RLHF, Pokemon captions), run as a user runs them on small
hand-made files in each hub dataset's original layout; every row is checked field by field."""

import io
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from tests.examples.test_data_preprocess_scripts import REPO, SCRIPTS, _read, _run
from verl.utils.reward_score import default_compute_score


def _parquet(rows, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


GSM8K_TRAIN = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs 12,000 dollars; two cars?", "answer": "2*12000=24000\n#### 24,000"},
]
GSM8K_TEST = [{"question": "What is 2 minus 9?", "answer": "2-9=-7\n#### -7"}]
MULTI_TURN_INSTRUCTION = " Let's think step by step and output the final answer after `####`."


def _gsm8k_snapshot(tmp_path):
    """openai/gsm8k as the hub stores it: a folder per configuration, main/train-*.parquet, main/test-*.parquet
    (the scripts read "main"; the "socratic" rows must not leak in)."""
    root = tmp_path / "gsm8k"
    _parquet(GSM8K_TRAIN, root / "main" / "train-00000-of-00001.parquet")
    _parquet(GSM8K_TEST, root / "main" / "test-00000-of-00001.parquet")
    socratic = [{"question": "How many? ** Count them.", "answer": "#### 1"}]
    _parquet(socratic, root / "socratic" / "train-00000-of-00001.parquet")
    _parquet(socratic, root / "socratic" / "test-00000-of-00001.parquet")
    return root


def _check_gsm8k_common(rows, split, raw, truths):
    assert len(rows) == len(raw)
    for index, (row, example, truth) in enumerate(zip(rows, raw, truths, strict=True)):
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["reward_model"] == {"style": "rule", "ground_truth": truth}
        system, user = row["prompt"]
        assert system["role"] == "system" and "`#### <answer>`" in system["content"]
        assert user == {"role": "user", "content": example["question"] + MULTI_TURN_INSTRUCTION}
        info = row["extra_info"]
        assert (info["split"], info["index"], info["answer"], info["question"]) == (
            split,
            index,
            example["answer"],
            example["question"],
        )


def _check_gsm8k_tool_extra_info(rows, truths, raw):
    for row, truth, example in zip(rows, truths, raw, strict=True):
        info = row["extra_info"]
        assert info["need_tools_kwargs"] is True
        assert info["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
        assert info["interaction_kwargs"] == {
            "query": example["question"] + MULTI_TURN_INSTRUCTION,
            "ground_truth": truth,
        }
        assert "`calc_gsm8k_reward`" in row["prompt"][0]["content"]


def test_gsm8k_multiturn_w_tool_rows_and_hdfs_copy(tmp_path):
    out, copy = tmp_path / "out", tmp_path / "copy"
    result = _run(
        "gsm8k_multiturn_w_tool.py", "--local_dataset_path", _gsm8k_snapshot(tmp_path), "--local_save_dir", out,
        "--hdfs_dir", copy,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    train, test = _read(out / "train.parquet"), _read(out / "test.parquet")
    _check_gsm8k_common(train, "train", GSM8K_TRAIN, ["7", "24000"])
    _check_gsm8k_common(test, "test", GSM8K_TEST, ["-7"])
    _check_gsm8k_tool_extra_info(train + test, ["7", "24000", "-7"], GSM8K_TRAIN + GSM8K_TEST)
    assert set(train[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert _read(copy / "train.parquet") == train and _read(copy / "test.parquet") == test
    for row in train + test:  # the reference solution earns full marks under the default gsm8k reward
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], row["extra_info"]["answer"], truth) == 1.0


def test_gsm8k_tool_agent_loop_adds_the_agent_name(tmp_path):
    out = tmp_path / "out"
    # --local_dir: upstream's deprecated name of --local_save_dir still works, with a warning
    result = _run("gsm8k_tool_agent_loop.py", "--local_dataset_path", _gsm8k_snapshot(tmp_path), "--local_dir", out)
    assert result.returncode == 0, result.stderr
    assert "--local_dir is deprecated" in result.stdout
    train = _read(out / "train.parquet")
    assert [row["agent_name"] for row in train] == ["tool_agent", "tool_agent"]
    _check_gsm8k_common(train, "train", GSM8K_TRAIN, ["7", "24000"])
    _check_gsm8k_tool_extra_info(train, ["7", "24000"], GSM8K_TRAIN)


def test_gsm8k_multiturn_w_interaction_rows(tmp_path):
    out = tmp_path / "out"
    result = _run(
        "gsm8k_multiturn_w_interaction.py", "--local_dataset_path", _gsm8k_snapshot(tmp_path), "--local_save_dir", out
    )
    assert result.returncode == 0, result.stderr
    test = _read(out / "test.parquet")
    _check_gsm8k_common(test, "test", GSM8K_TEST, ["-7"])
    info = test[0]["extra_info"]
    assert info["interaction_kwargs"] == {
        "name": "gsm8k",
        "query": "What is 2 minus 9?" + MULTI_TURN_INSTRUCTION,
        "ground_truth": "-7",
    }
    assert "tools_kwargs" not in info and "need_tools_kwargs" not in info


def test_gsm8k_multiturn_missing_column_is_a_clear_error(tmp_path):
    no_answer = tmp_path / "no_answer"
    _parquet([{"question": "q"}], no_answer / "main" / "train-00000-of-00001.parquet")
    _parquet(GSM8K_TEST, no_answer / "main" / "test-00000-of-00001.parquet")
    result = _run("gsm8k_multiturn_w_tool.py", "--local_dataset_path", no_answer, "--local_save_dir", tmp_path / "o")
    assert result.returncode != 0
    assert "train example 0 of openai/gsm8k has no column(s) ['answer']" in result.stderr


def test_gsm8k_multiturn_missing_split_or_marker_is_a_clear_error(tmp_path):
    no_test = tmp_path / "no_test"
    _parquet(GSM8K_TRAIN, no_test / "main" / "train-00000-of-00001.parquet")
    result = _run(
        "gsm8k_multiturn_w_interaction.py", "--local_dataset_path", no_test, "--local_save_dir", tmp_path / "o"
    )
    assert result.returncode != 0 and "the 'test' split is missing" in result.stderr

    no_marker = tmp_path / "no_marker"
    _parquet([{"question": "q", "answer": "it is 5"}], no_marker / "train.parquet")
    result = _run("gsm8k_tool_agent_loop.py", "--local_dataset_path", no_marker, "--local_save_dir", tmp_path / "o")
    assert result.returncode != 0 and "train example 0: GSM8K answer without a '#### <number>' line" in result.stderr


def test_gsm8k_multiturn_sft_messages(tmp_path):
    out = tmp_path / "out"
    result = _run("gsm8k_multiturn_sft.py", "--local_dataset_path", _gsm8k_snapshot(tmp_path), "--local_save_dir", out)
    assert result.returncode == 0, result.stderr
    train, test = _read(out / "train.parquet"), _read(out / "test.parquet")
    assert train[1] == {
        "messages": [
            {
                "role": "user",
                "content": GSM8K_TRAIN[1]["question"]
                + ' Let\'s think step by step and output the final answer after "####".',
            },
            {"role": "assistant", "content": GSM8K_TRAIN[1]["answer"]},
        ]
    }
    assert len(train) == 2 and test[0]["messages"][1]["content"] == "2-9=-7\n#### -7"


def test_multiturn_writes_two_train_and_one_test_conversation(tmp_path):
    result = _run("multiturn.py", "--local_dir", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "deprecated" not in result.stdout  # --local_dir is this script's own upstream flag
    train, test = _read(tmp_path / "out" / "train.parquet"), _read(tmp_path / "out" / "test.parquet")
    assert len(train) == 2 and len(test) == 1
    for row in train + test:
        assert list(row) == ["messages"]
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        assert all(m["content"] for m in row["messages"])


def _png(color) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (28, 28), color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_geo3k_multiturn_w_tool_rows(tmp_path):
    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    root = tmp_path / "geometry3k"
    _parquet(
        [{"images": [{"bytes": red, "path": "a.png"}], "problem": "<image>Find x.", "answer": "3"}],
        root / "data" / "train-00000-of-00001.parquet",
    )
    _parquet(
        [{"images": [{"bytes": blue, "path": None}], "problem": "<image>Find the angle.", "answer": "60"}],
        root / "data" / "test-00000-of-00001.parquet",
    )
    out = tmp_path / "out"
    result = _run("geo3k_multiturn_w_tool.py", "--local_dataset_path", root, "--local_save_dir", out)
    assert result.returncode == 0, result.stderr
    (row,) = _read(out / "test.parquet")
    assert row["data_source"] == "hiyouga/geometry3k" and row["ability"] == "math"
    system, user = row["prompt"]
    assert system["role"] == "system" and "`calc_geo3k_reward`" in system["content"]
    assert user["role"] == "user" and user["content"].startswith("<image>Find the angle. You FIRST think")
    assert user["content"].endswith(r"The final answer MUST BE put in \boxed{}.")
    assert row["images"] == [{"bytes": blue, "path": None}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "60"}
    assert row["extra_info"] == {
        "split": "test",
        "index": 0,
        "answer": "60",
        "question": "<image>Find the angle.",
        "need_tools_kwargs": True,
        "tools_kwargs": {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "60"}}},
    }
    assert _read(out / "train.parquet")[0]["images"] == [{"bytes": red, "path": "a.png"}]


SEARCH_TRAIN = [
    {
        "id": "train_0",
        "question": "who wrote the hobbit",
        "golden_answers": ["J. R. R. Tolkien", "Tolkien"],
        "data_source": "nq",
        "prompt": [{"role": "user", "content": "original prompt"}],
        "ability": "fact-reasoning",
        "reward_model": {"ground_truth": {"target": ["J. R. R. Tolkien", "Tolkien"]}, "style": "rule"},
        "extra_info": {"index": 0, "split": "train"},
        "metadata": None,
    }
]
SEARCH_TEST = [
    {
        "id": "test_0",
        "question": "capital of france",
        "golden_answers": ["Paris"],
        "data_source": "hotpotqa",
        "ability": "fact-reasoning",
        "reward_model": None,
        "metadata": None,
    }
]


def test_search_r1_rows_route_to_the_search_tool_and_scorer(tmp_path):
    root = tmp_path / "nq_hotpotqa_train"
    _parquet(SEARCH_TRAIN, root / "train.parquet")
    _parquet(SEARCH_TEST, root / "test.parquet")
    out = tmp_path / "out"
    result = _run("preprocess_search_r1_dataset.py", "--local_dataset_path", root, "--local_dir", out)
    assert result.returncode == 0, result.stderr
    (train,), (test,) = _read(out / "train.parquet"), _read(out / "test.parquet")
    assert train["data_source"] == "searchR1_nq" and test["data_source"] == "searchR1_hotpotqa"
    system, user = train["prompt"]
    assert system == {"role": "system", "content": "You are a helpful and harmless assistant."}
    assert user["role"] == "user" and user["content"].endswith("Question: who wrote the hobbit")
    for tag in ("<think>", "<tool_call>", "<tool_response>", "<answer>"):
        assert tag in user["content"]
    assert train["ability"] == "fact-reasoning" and train["metadata"] is None
    truth = {"target": ["J. R. R. Tolkien", "Tolkien"]}
    assert train["reward_model"] == {"ground_truth": truth, "style": "rule"}
    assert train["extra_info"] == {
        "index": 0,
        "need_tools_kwargs": True,
        "question": "who wrote the hobbit",
        "split": "train",
        "tools_kwargs": {
            "search": {
                "create_kwargs": {
                    "ground_truth": truth,
                    "question": "who wrote the hobbit",
                    "data_source": "searchR1_nq",
                }
            }
        },
    }
    # no reward_model: the tool gets golden_answers, the row's reward_model stays empty as upstream
    assert test["reward_model"] is None
    assert test["extra_info"]["tools_kwargs"]["search"]["create_kwargs"]["ground_truth"] == ["Paris"]
    assert test["extra_info"]["split"] == "test"
    answer = "<think>known</think><answer> tolkien </answer>"
    assert default_compute_score(train["data_source"], answer, train["reward_model"]["ground_truth"]) == 1.0
    assert default_compute_score(train["data_source"], "<answer> Lewis </answer>", truth) == 0.0


def test_search_r1_without_gold_answers_is_a_clear_error(tmp_path):
    root = tmp_path / "raw"
    _parquet([{"question": "q", "data_source": "nq"}], root / "train.parquet")
    _parquet(SEARCH_TEST, root / "test.parquet")
    result = _run("preprocess_search_r1_dataset.py", "--local_dataset_path", root, "--local_dir", tmp_path / "o")
    assert result.returncode != 0
    assert "has neither reward_model.ground_truth nor golden_answers" in result.stderr


DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "Solve 1+1. Answer: $Answer"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a1b2"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "Solve 2*3."}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "6", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "c3d4"},
    },
]


def test_dapo_and_aime_multiturn_w_tool_add_the_code_interpreter(tmp_path):
    for script, name in (("dapo_multiturn_w_tool.py", "dapo-math-17k"), ("aime2024_multiturn_w_tool.py", "aime-2024")):
        root = tmp_path / name
        _parquet(DAPO_ROWS, root / "data" / f"{name}.parquet")  # the hub's single file: the "train" split
        out = tmp_path / f"out-{name}"
        result = _run(script, "--local_dataset_path", root, "--local_save_dir", out)
        assert result.returncode == 0, result.stderr
        assert sorted(os.listdir(out)) == ["train.parquet"]
        rows = _read(out / "train.parquet")
        for row, raw in zip(rows, DAPO_ROWS, strict=True):
            assert {k: row[k] for k in ("data_source", "prompt", "ability", "reward_model")} == {
                k: raw[k] for k in ("data_source", "prompt", "ability", "reward_model")
            }
            truth = raw["reward_model"]["ground_truth"]
            assert row["extra_info"] == {
                "index": raw["extra_info"]["index"],
                "need_tools_kwargs": True,
                "tools_kwargs": {"code_interpreter": {"create_kwargs": {"ground_truth": truth}}},
            }


def test_hellaswag_from_the_original_jsonl_files(tmp_path):
    root = tmp_path / "hellaswag"
    root.mkdir()
    example = {
        "activity_label": "Home and Garden",
        "ctx_a": "A man holds a rake.",
        "ctx_b": "he",
        "endings": ["rakes the leaves [step] into a pile.", "eats the rake."],
        "label": 0,
    }
    wikihow = {
        "activity_label": "Cooking",
        "ctx_a": "[header] How to boil an egg [title] Fill a pot.",
        "ctx_b": "",
        "endings": ["[substeps] Add the egg.", "Paint the pot."],
        "label": "1",
    }
    lines = {"train": [example, wikihow], "val": [example], "test": [{**example, "label": ""}]}
    for name, rows in lines.items():
        (root / f"hellaswag_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    result = _run("hellaswag.py", "--local_dataset_path", root, "--local_save_dir", out)
    assert result.returncode == 0, result.stderr
    train, val, test = (_read(out / f"{s}.parquet") for s in ("train", "validation", "test"))
    assert train[0] == {
        "data_source": "Rowan/hellaswag",
        "prompt": [{"role": "user", "content": "Home and Garden: A man holds a rake. He"}],
        "ability": "nlp",
        "reward_model": {
            "style": "model",
            "eval": "multiple_choice",
            "ground_truth": 0,
            "choices": ["rakes the leaves into a pile.", "eats the rake."],
        },
        "extra_info": {"split": "train", "index": 0},
    }
    assert train[1]["prompt"][0]["content"] == "Cooking: How to boil an egg. Fill a pot."
    assert train[1]["reward_model"]["ground_truth"] == 1
    # markup is dropped after the strip, as upstream, so its space stays
    assert train[1]["reward_model"]["choices"] == [" Add the egg.", "Paint the pot."]
    assert val[0]["extra_info"] == {"split": "validation", "index": 0}
    assert test == []  # the public test split has no labels
    assert pq.read_schema(out / "test.parquet").names == list(train[0])


HH_ROWS = [{"prompt": f"Human: q{i} Assistant:", "response": f"r{i}", "chosen": f"c{i}", "rejected": f"x{i}"} for i in range(6)]  # fmt: skip


def test_full_hh_rlhf_sft_rm_and_rl(tmp_path):
    root = tmp_path / "full-hh-rlhf"
    _parquet(HH_ROWS, root / "data" / "train-00000-of-00001.parquet")
    _parquet(HH_ROWS[:1], root / "data" / "test-00000-of-00001.parquet")
    out = tmp_path / "out"
    for split in ("sft", "rm", "rl"):
        result = _run("full_hh_rlhf.py", "--split", split, "--local_dataset_path", root, "--local_save_dir", out)
        assert result.returncode == 0, result.stderr
    sft = _read(out / "sft" / "train.parquet")
    assert sft[:2] == [{"prompt": "Human: q0 Assistant:", "response": "c0"}, {"prompt": "Human: q0 Assistant:", "response": "x0"}]  # fmt: skip
    assert len(sft) == 12
    # 6 rows: train[:75%] = round(4.5) = 4 rows, train[-25%:] = the last round(1.5) = 2 rows
    rm_train, rm_test = _read(out / "rm" / "train.parquet"), _read(out / "rm" / "test.parquet")
    assert [r["chosen"] for r in rm_train] == ["c0", "c1", "c2", "c3"]
    assert rm_test == [{"prompt": f"Human: q{i} Assistant:", "chosen": f"c{i}", "rejected": f"x{i}"} for i in (4, 5)]
    rl = _read(out / "rl" / "train.parquet")
    assert len(rl) == 6 and rl[5] == {
        "data_source": "Dahoas/full-hh-rlhf",
        "prompt": [{"role": "user", "content": "Human: q5 Assistant:"}],
        "ability": "alignment",
        "reward_model": {"style": "model", "ground_truth": "r5"},
        "extra_info": {"split": "train", "index": 5},
    }
    result = _run("full_hh_rlhf.py", "--split", "dpo", "--local_dataset_path", root, "--local_save_dir", out)
    assert result.returncode != 0 and "invalid choice: 'dpo'" in result.stderr


def test_pokemon_conversations_become_messages_and_split_reproducibly(tmp_path):
    raw = [
        {
            "conversations": [{"from": "human", "value": "<image>Describe it."}, {"from": "gpt", "value": f"Pokemon {i}"}],
            "images": [{"bytes": b"img%d" % i, "path": None}],
        }
        for i in range(10)
    ]  # fmt: skip
    root = tmp_path / "pokemon"
    _parquet(raw, root / "data" / "train-00000-of-00001.parquet")
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        result = _run("pokemon.py", "--local_dataset_path", root, "--local_save_dir", out, "--seed", 1)
        assert result.returncode == 0, result.stderr
        outs.append((_read(out / "train.parquet"), _read(out / "test.parquet")))
    (train, test), again = outs
    assert (train, test) == again and len(train) == 9 and len(test) == 1  # ceil(10%) of 10
    by_answer = {row["messages"][1]["content"]: row for row in train + test}
    assert sorted(by_answer) == sorted(f"Pokemon {i}" for i in range(10))
    assert by_answer["Pokemon 3"] == {
        "images": [{"bytes": b"img3", "path": None}],
        "messages": [
            {"role": "user", "content": "<image>Describe it."},
            {"role": "assistant", "content": "Pokemon 3"},
        ],
    }
    bad = tmp_path / "bad"
    _parquet([{"conversations": [{"from": "robot", "value": "hi"}]}] * 2, bad / "train.parquet")
    result = _run("pokemon.py", "--local_dataset_path", bad, "--local_save_dir", tmp_path / "o")
    assert result.returncode != 0 and "a turn from 'robot'" in result.stderr


def test_sft_outputs_load_in_the_sft_dataset(tmp_path):
    from verl.models.factory import build_tokenizer
    from verl.utils.dataset.sft_dataset import SFTDataset

    result = _run("multiturn.py", "--local_dir", tmp_path / "multiturn")
    assert result.returncode == 0, result.stderr
    tokenizer = build_tokenizer("tiny")
    config = {"multiturn": {"enable": True}, "max_length": 512, "truncation": "error"}
    dataset = SFTDataset(str(tmp_path / "multiturn" / "train.parquet"), tokenizer, config)
    assert len(dataset) == 2
    item = dataset[0]
    learned = tokenizer.decode(item["input_ids"][item["loss_mask"].bool()])
    # the loss covers the assistant replies, not the system or user turns
    assert "Mercury is the planet closest to the Sun." in learned and "Jupiter" in learned
    assert "Which planet" not in learned and "helpful assistant" not in learned


def test_hdfs_dir_is_created_and_the_folder_uploaded_with_the_hadoop_cli(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "hdfs.log"
    bin_dir.mkdir()
    fake = bin_dir / "hdfs"  # stands in for the Hadoop client: records its arguments
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "multiturn.py"), "--local_dir", str(out), "--hdfs_dir", "hdfs://nn/data/mt"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines() == ["dfs -mkdir -p hdfs://nn/data/mt", f"dfs -put -f {out} hdfs://nn/data/mt"]
