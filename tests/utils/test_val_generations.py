"""trainer.log_val_generations: which validation samples are logged, and how each tracker keeps them,
read back from the trackers' own files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from verl.utils.tracking import Tracking, ValidationGenerationsLogger, select_val_generations


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("VERL_FILE_LOGGER_PATH", "MLFLOW_TRACKING_URI", "TENSORBOARD_DIR", "WANDB_DIR", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_MODE", "SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_LOG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.setenv("HOME", str(tmp_path))  # no stored wandb login: offline
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_the_same_prompts_are_chosen_whatever_their_order():
    inputs = ["q3", "q1", "q4", "q0", "q2"]
    outputs = [f"a{q[1]}" for q in inputs]
    scores = [float(q[1]) for q in inputs]
    # upstream's rule: sort (q0..q4), then the order RandomState(42) shuffles five items into, 1, 4, 2, 0, 3
    assert np.random.RandomState(42).permutation(5).tolist() == [1, 4, 2, 0, 3]
    expected = [("q1", "a1", 1.0), ("q4", "a4", 4.0), ("q2", "a2", 2.0)]
    assert select_val_generations(inputs, outputs, scores, 3) == expected
    order = [4, 2, 0, 3, 1]
    again = select_val_generations(
        [inputs[i] for i in order], [outputs[i] for i in order], [scores[i] for i in order], 3
    )
    assert again == expected
    assert len(select_val_generations(inputs, outputs, scores, 50)) == 5
    assert select_val_generations(inputs, outputs, scores, 0) == []
    with pytest.raises(ValueError, match="differ in length"):
        select_val_generations(inputs, outputs[:-1], scores, 2)


def test_every_tracker_keeps_the_samples_read_back(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("swanlab")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    t = Tracking("proj", "exp", ["console", "file", "wandb", "swanlab", "mlflow", "tensorboard"], run_dir=run_dir)
    t.log_generations([("2+2?", "4", 1.0), ("3+3?", "7", np.float32(0.0))], step=1)
    t.log_generations([("2+2?", "5", 0.0)], step=2)  # a smaller validation set: the table's cells stay empty
    t.finish()

    rows = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "input": "2+2?", "output": "4", "score": 1.0},
        {"step": 1, "input": "3+3?", "output": "7", "score": 0.0},
        {"step": 2, "input": "2+2?", "output": "5", "score": 0.0},
    ]

    # wandb: the table of the last call holds one row per validation (upstream's columns)
    tables = [json.loads(p.read_text()) for p in run_dir.glob("wandb/offline-run-*/files/media/table/val/*.table.json")]
    last = max(tables, key=lambda tb: len(tb["data"]))
    assert last["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert last["data"] == [[1, "2+2?", "4", 1.0, "3+3?", "7", 0.0], [2, "2+2?", "5", 0.0, None, None, None]]

    # swanlab: one echarts table per validation, one row per sample
    charts = sorted(run_dir.glob("swanlog/run-*/media/echarts/*.json"))
    assert [json.loads(p.read_text())["rowData"] for p in charts] == [
        [
            {"step": 1, "input": "2+2?", "output": "4", "score": 1.0},
            {"step": 1, "input": "3+3?", "output": "7", "score": 0.0},
        ],
        [{"step": 2, "input": "2+2?", "output": "5", "score": 0.0}],
    ]

    # mlflow: upstream's artifact name
    client = mlflow.MlflowClient(tracking_uri="file:" + str(tmp_path / "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    path = client.download_artifacts(run.info.run_id, "val_step2.json", str(tmp_path / "dl"))
    assert json.loads(Path(path).read_text()) == [{"input": "2+2?", "output": "5", "score": 0.0}]

    # tensorboard: markdown text under val/generations
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("val/generations/text_summary")}
    assert sorted(texts) == [1, 2]
    assert "**Input:** 3+3?" in texts[1] and "**Output:** 7" in texts[1] and "**Score:** 0.0" in texts[1]
    assert "3+3?" not in texts[2]


def test_upstream_logger_writes_into_the_running_tracking(tmp_path):
    t = Tracking("p", "e", ["console", "file"], run_dir=tmp_path / "run")
    ValidationGenerationsLogger("p", "e").log(["console", "file"], [("in", "out", 0.5)], step=3)
    t.finish()
    rows = [json.loads(line) for line in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()]
    assert rows == [{"step": 3, "input": "in", "output": "out", "score": 0.5}]


def test_upstream_logger_without_a_tracking_goes_where_upstream_writes(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracking("p", "e", ["file"], run_dir=tmp_path / "run")
    t.finish()  # a finished tracking is not written to
    with caplog.at_level(logging.WARNING, logger="verl.utils.tracking"):
        ValidationGenerationsLogger("proj", "exp").log(["tensorboard", "file"], [("in", "out", 1.0)], step=4)
    assert not (tmp_path / "run" / "val_generations.jsonl").exists()
    assert "not logged to 'file'" in caplog.text
    acc = EventAccumulator(str(tmp_path / "tensorboard_log" / "proj" / "exp"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("val/generations/text_summary")
    assert event.step == 4 and "**Output:** out" in event.tensor_proto.string_val[0].decode()


def test_a_sample_that_is_not_a_triple_is_refused(tmp_path):
    t = Tracking("p", "e", ["file"], run_dir=tmp_path)
    with pytest.raises(ValueError, match=r"\(input, output, score\)"):
        t.log_generations([("in", "out")], step=1)
    t.finish()
