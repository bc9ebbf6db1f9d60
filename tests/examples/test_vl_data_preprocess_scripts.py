"""The multi-modal preprocessing scripts (geo3k.py on local copies in the hub's and save_to_disk's
layouts, vl_colors.py offline), run as a user runs them; RLHFDataset with the tiny-vl processor loads
what they write."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.reward_score import default_compute_score

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "data_preprocess"


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from verl.models.factory import build_tokenizer
    from verl.models.vision import save_processor
    from verl.utils.tokenizer import hf_processor

    out = str(tmp_path_factory.mktemp("tiny-vl-processor"))
    tokenizer = build_tokenizer("tiny-vl")
    tokenizer.save_pretrained(out)
    save_processor(tokenizer, out)
    return hf_processor(out)


def _run(script, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *map(str, args)], capture_output=True, text=True, env=env, timeout=120
    )


def _png(color, size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


GEO_TRAIN = [
    {"images": [{"bytes": _png((255, 0, 0)), "path": "0.png"}], "problem": "<image>Find x.", "answer": "3"},
    {"images": [{"bytes": _png((0, 0, 255), (56, 112)), "path": None}], "problem": "<image>Find y.", "answer": "60"},
]
GEO_TEST = [{"images": [{"bytes": _png((0, 255, 0)), "path": "t.png"}], "problem": "<image>Find z.", "answer": "7"}]


def _check_geo3k_output(out, processor):
    train = pq.read_table(out / "train.parquet").to_pylist()
    assert len(train) == 2 and len(pq.read_table(out / "test.parquet").to_pylist()) == 1
    row = train[1]
    assert row["data_source"] == "hiyouga/geometry3k" and row["ability"] == "math"
    assert row["prompt"] == [
        {
            "role": "user",
            "content": "<image>Find y. You FIRST think about the reasoning process as an internal monologue and then "
            "provide the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
            "The final answer MUST BE put in \\boxed{}.",
        }
    ]
    assert row["images"] == [{"bytes": GEO_TRAIN[1]["images"][0]["bytes"], "path": None}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "60"}
    assert row["extra_info"] == {"split": "train", "index": 1, "answer": "60", "question": "<image>Find y."}
    config = {"max_prompt_length": 256, "filter_overlong_prompts": True, "truncation": "error"}
    dataset = RLHFDataset(str(out / "train.parquet"), processor.tokenizer, config, processor=processor)
    item = dataset[1]
    assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 8, 4]]
    assert item["multi_modal_data"]["images"][0].size == (56, 112)
    assert default_compute_score(item["data_source"], "<think>60 degrees</think> \\boxed{60}", "60") == 1.0


def test_geo3k_from_a_hub_snapshot(tmp_path, processor):
    data = tmp_path / "geometry3k" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(GEO_TRAIN), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(GEO_TEST), data / "test-00000-of-00001.parquet")
    out = tmp_path / "out"
    result = _run("geo3k.py", "--local_dataset_path", tmp_path / "geometry3k", "--local_save_dir", out)
    assert result.returncode == 0, result.stderr
    _check_geo3k_output(out, processor)


def test_geo3k_from_save_to_disk_arrow(tmp_path, processor):
    for split, rows in (("train", GEO_TRAIN), ("test", GEO_TEST)):
        (tmp_path / "raw" / split).mkdir(parents=True)
        table = pa.Table.from_pylist(rows)
        path = str(tmp_path / "raw" / split / "data-00000-of-00001.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    out = tmp_path / "out"
    result = _run("geo3k.py", "--local_dataset_path", tmp_path / "raw", "--local_dir", out)
    assert result.returncode == 0, result.stderr
    assert "deprecated" in result.stdout
    _check_geo3k_output(out, processor)


def test_geo3k_errors_say_what_to_do(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.Table.from_pylist([{**GEO_TRAIN[0], "problem": "Find x."}]), bad / "train.parquet")
    result = _run("geo3k.py", "--local_dataset_path", bad, "--local_save_dir", tmp_path / "out")
    assert result.returncode != 0 and "train example 0: the problem has 0 <image> placeholder(s) but 1" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run("geo3k.py", "--local_dataset_path", empty, "--local_save_dir", tmp_path / "out")
    assert result.returncode != 0 and "no train* parquet/JSON file and no train/*.arrow" in result.stderr
    try:
        import datasets  # noqa: F401
    except ImportError:  # this machine: no datasets package, and no hub either
        result = _run("geo3k.py", "--local_save_dir", tmp_path / "out")
        assert result.returncode != 0 and "--local_dataset_path" in result.stderr


def test_vl_colors_script_writes_loadable_parquet(tmp_path, processor):
    out = tmp_path / "colors"
    result = _run("vl_colors.py", "--local_save_dir", out, "--num_train", 6, "--num_test", 2, "--colors", "red,blue")
    assert result.returncode == 0, result.stderr
    config = {"max_prompt_length": 48, "filter_overlong_prompts": True, "truncation": "error"}
    train = RLHFDataset(str(out / "train.parquet"), processor.tokenizer, config, processor=processor)
    assert len(train) == 6 and len(pq.read_table(out / "test.parquet")) == 2
    answers = sorted(train[i]["reward_model"]["ground_truth"] for i in range(6))
    assert answers == ["blue"] * 3 + ["red"] * 3
    assert train[0]["multi_modal_inputs"]["pixel_values"].shape == (16, 1176)
