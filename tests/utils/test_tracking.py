"""Tracking backends write real files that their own readers can read back."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from verl.utils import tracking
from verl.utils.tracking import Tracking, sanitize_mlflow_key

STEPS = {
    1: {"critic/score/mean": 0.25, "response_length/mean": 4.0, "val-core/arith/acc/mean@1": 0.3},
    2: {"critic/score/mean": 0.5, "response_length/mean": 3.5},
    3: {"critic/score/mean": 0.75, "response_length/mean": 3.0, "val-core/arith/acc/mean@1": 0.9},
}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("VERL_FILE_LOGGER_PATH", "MLFLOW_TRACKING_URI", "TENSORBOARD_DIR", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # restored afterwards even though the logger sets it


def test_console_prints_one_sorted_compact_line_per_step(capsys):
    t = Tracking("p", "e", "console")
    t.log({"b/x": 0.123456, "a": 1, "c": "txt", "d": np.float32(2.5), "e": torch.tensor(1e-5)}, step=3)
    t.finish()
    assert capsys.readouterr().out == "step 3 | a=1 b/x=0.1235 c=txt d=2.5 e=1e-05\n"


def test_file_backend_writes_one_json_object_per_step(tmp_path):
    t = Tracking("proj", "exp", ["file"], run_dir=tmp_path / "run")
    for step, data in STEPS.items():
        t.log(data, step=step)
    t.log({"np": np.float64(1.5), "tensor": torch.tensor(2.0), "count": np.int64(7), "text": "hi"}, step=4)
    t.finish()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["data"] == STEPS[3]
    assert records[3]["data"] == {"np": 1.5, "tensor": 2.0, "count": 7.0, "text": "hi"}


def test_file_backend_honours_env_path_and_appends_across_runs(tmp_path, monkeypatch):
    path = tmp_path / "elsewhere" / "m.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    for step in (1, 2):  # a resumed run continues the same file
        t = Tracking("p", "e", "file", run_dir=tmp_path / "run")
        t.log({"x": float(step)}, step=step)
        t.finish()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_run_dir_comes_from_the_config(tmp_path):
    from verl.trainer.config import load_ppo_config

    cfg = load_ppo_config([f"trainer.run_dir={tmp_path / 'from_cfg'}"], config_name="arith_demo")
    t = Tracking("p", "e", "file", config=cfg)
    t.log({"x": 1.0}, step=1)
    t.finish()
    assert (tmp_path / "from_cfg" / "metrics.jsonl").exists()
    assert Tracking("proj", "exp", "console").run_dir.as_posix() == "outputs/proj/exp"


@pytest.mark.parametrize("async_elsewhere", [False, True])
def test_mlflow_local_file_store_round_trip(tmp_path, async_elsewhere):
    import mlflow

    from verl.trainer.config import load_ppo_config

    # rollout tracing turns on mlflow's process-wide async logging; every step must still be stored
    mlflow.config.enable_async_logging(async_elsewhere)
    cfg = load_ppo_config(config_name="arith_demo")
    t = Tracking("verl_test", "run1", ["mlflow", "file"], config=cfg, run_dir=tmp_path / "run")
    for step, data in STEPS.items():
        t.log({**data, "odd#name,x": float(step)}, step=step)
    t.finish()
    mlflow.config.enable_async_logging(False)

    client = mlflow.MlflowClient(tracking_uri="file:" + str(tmp_path / "mlruns"))
    exp = client.get_experiment_by_name("verl_test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "val-core/arith/acc/mean_at_1")
    assert [(m.step, m.value) for m in history] == [(1, 0.3), (3, 0.9)]
    reward = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in reward] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    odd = client.get_metric_history(run.info.run_id, sanitize_mlflow_key("odd#name,x"))
    assert [m.value for m in odd] == [1.0, 2.0, 3.0]
    assert run.data.params["data.train_batch_size"] == "32"
    assert run.data.params["trainer.logger"] == '["console", "file"]'
    assert "training_curves.png" in [a.path for a in client.list_artifacts(run.info.run_id)]


def test_mlflow_respects_tracking_uri(tmp_path, monkeypatch):
    import mlflow

    uri = "file:" + str(tmp_path / "custom_store")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    t = Tracking("p2", "e2", "mlflow")
    t.log({"loss": 2.0}, step=5)
    t.finish()
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("p2").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(5, 2.0)]
    assert not (tmp_path / "mlruns").exists()


def test_mlflow_keys_follow_upstreams_mapping_and_each_renamed_key_is_warned_once(caplog, monkeypatch):
    import verl.utils.tracking as tracking

    monkeypatch.setattr(tracking, "_warned_mlflow_keys", set())  # other tests of this process logged some
    expected = {
        "val-core/arith/acc/mean@1": "val-core/arith/acc/mean_at_1",
        "train/lr(1e-3)": "train/lr_1e-3_",
        "val-aux//reward/mean@2": "val-aux/reward/mean_at_2",
        "a#b,c": "a_b_c",
        "plain/name-1.0 ok:yes": "plain/name-1.0 ok:yes",
    }
    with caplog.at_level("WARNING", logger="verl.utils.tracking"):
        assert {k: sanitize_mlflow_key(k) for k in expected} == expected
        sanitize_mlflow_key("a#b,c")
    warned = [r.getMessage() for r in caplog.records if "[MLflow]" in r.getMessage()]
    assert len(warned) == 4 and sum("'a#b,c'" in m for m in warned) == 1  # renamed keys only, each once


def test_mlflow_adapter_logs_mapped_keys_to_the_active_run_and_warns_each_renamed_key_once(
    tmp_path, monkeypatch, caplog
):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = "file:" + str(tmp_path / "store")
    mlflow.set_tracking_uri(uri)
    # an experiment of this store: an earlier test may have left another store's experiment active
    experiment_id = mlflow.MlflowClient(tracking_uri=uri).create_experiment("adapter")
    adapter = tracking._MlflowLoggingAdapter()
    with caplog.at_level("WARNING", logger="verl.utils.tracking"), mlflow.start_run(experiment_id=experiment_id) as run:
        adapter.log({"val-core///acc/best@5": 0.5, "x y:z": 1, "t": torch.tensor(2.5), "txt": "no"}, step=3)
        adapter.log({"val-core///acc/best@5": 0.75}, step=4)
    mlflow.set_tracking_uri(None)
    client = mlflow.MlflowClient(tracking_uri=uri)
    data = client.get_run(run.info.run_id).data
    assert data.metrics == {"val-core/acc/best_at_5": 0.75, "x y:z": 1.0, "t": 2.5}  # the text left out
    history = client.get_metric_history(run.info.run_id, "val-core/acc/best_at_5")
    assert [(m.step, m.value) for m in history] == [(3, 0.5), (4, 0.75)]
    warned = [r.getMessage() for r in caplog.records if "[MLflow]" in r.getMessage()]
    assert warned == [
        "[MLflow] metric key 'val-core///acc/best@5' logged as 'val-core/acc/best_at_5' "
        "(MLflow forbids some characters)"
    ]


def test_tensorboard_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracking("p", "e", "tensorboard", run_dir=tmp_path / "run")
    for step, data in STEPS.items():
        t.log({**data, "text": "ignored"}, step=step)
    t.finish()
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert "text" not in acc.Tags()["scalars"]
    events = acc.Scalars("critic/score/mean")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([0.25, 0.5, 0.75])
    assert [e.step for e in acc.Scalars("val-core/arith/acc/mean@1")] == [1, 3]


def test_tensorboard_respects_env_dir(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    t = Tracking("p", "e", "tensorboard", run_dir=tmp_path / "run")
    t.log({"x": 1.0}, step=1)
    t.finish()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_trainer_tensorboard_dir_wins_over_the_environment(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "env"))
    config = {"trainer": {"tensorboard_dir": str(tmp_path / "key")}}
    t = Tracking("p", "e", "tensorboard", config=config, run_dir=tmp_path / "run")
    t.log({"x": 1.0}, step=1)
    t.finish()
    assert list((tmp_path / "key").glob("events.out.tfevents.*"))
    assert not (tmp_path / "env").exists()


def test_wandb_goes_offline_without_credentials(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no stored login
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracking("p", "e", "wandb", run_dir=tmp_path / "run")
    assert t.logger["wandb"].mode == "offline"
    for step, data in STEPS.items():
        t.log(data, step=step)
    t.finish()
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb 0.31 ships no public reader for offline runs; its records are protobuf messages holding
    # each metric's key beside its JSON value, so the last step's value must sit right after the key.
    # wandb's service process may still be flushing the file when finish() returns: give it a few seconds
    deadline = time.monotonic() + 15
    while not re.search(rb"critic/score/mean.{1,4}0\.75", raw := run_file.read_bytes(), re.S):
        if time.monotonic() > deadline:
            raise AssertionError("the last step was not committed")
        time.sleep(0.5)
    assert re.search(rb"val-core/arith/acc/mean@1.{1,4}0\.9", raw, re.S)


def _swanlab_records(log_dir):
    """The records of the one swanlab run file under log_dir, parsed with swanlab's own reader."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = log_dir.glob("run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    records = []
    for raw in reader:
        rec = Record()
        rec.ParseFromString(raw)
        records.append(rec)
    reader.close()
    return records


def test_swanlab_goes_offline_without_a_key_and_logs_scalars_read_back(tmp_path, monkeypatch):
    pytest.importorskip("swanlab")
    for var in ("SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_LOG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory (upstream's ./swanlog)
    run_dir = tmp_path / "run"
    t = Tracking("proj", "exp", ["swanlab"], config={"trainer": {"run_dir": str(run_dir)}, "lr": 0.5})
    assert t.logger["swanlab"].mode == "offline"
    t.log({"critic/score/mean": 0.25, "n": np.int64(3), "t": torch.tensor(1.5), "note": "text"}, step=1)
    t.log({"critic/score/mean": 0.75}, step=2)
    t.finish()
    log_dir = run_dir / "swanlog"
    records = _swanlab_records(log_dir)
    start = next(r.start for r in records if r.WhichOneof("record_type") == "start")
    assert (start.project, start.name) == ("proj", "exp")
    scalars = sorted(
        (r.scalar.step, r.scalar.key, r.scalar.value.number) for r in records if r.WhichOneof("record_type") == "scalar"
    )
    # the string never reaches swanlab; numpy and tensor scalars arrive as numbers
    assert scalars == [(1, "critic/score/mean", 0.25), (1, "n", 3.0), (1, "t", 1.5), (2, "critic/score/mean", 0.75)]
    assert any(r.WhichOneof("record_type") == "finish" for r in records)
    config = (next(log_dir.glob("run-*/files/config.yaml"))).read_text()
    assert "FRAMEWORK" in config and "verl" in config and "lr" in config
    assert not (tmp_path / "swanlog").exists()


def test_swanlab_honours_log_dir_and_mode_from_the_environment(tmp_path, monkeypatch):
    pytest.importorskip("swanlab")
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("SWANLAB_MODE", "local")
    t = Tracking("p", "e", ["swanlab"], run_dir=tmp_path / "run")
    t.log({"x": 2.0}, step=7)
    t.finish()
    assert t.logger["swanlab"].mode == "local"
    scalars = [r.scalar for r in _swanlab_records(tmp_path / "elsewhere") if r.WhichOneof("record_type") == "scalar"]
    assert [(s.key, s.step, s.value.number) for s in scalars] == [("x", 7, 2.0)]
    assert not (tmp_path / "run" / "swanlog").exists()


def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ValueError, match="clearml, console, file, mlflow, swanlab, tensorboard, tracking, wandb"):
        Tracking("p", "e", ["console", "comet"])


@pytest.mark.parametrize(("backend", "reason"), [("vemlp_wandb", "volcengine_ml_platform"), ("trackio", "pillow<13")])
def test_upstream_backends_not_here_are_refused_with_the_reason(backend, reason):
    with pytest.raises(ValueError, match=f"does not have: '{backend}': .*{re.escape(reason)}"):
        Tracking("p", "e", ["console", backend])


def test_tracking_is_upstreams_name_of_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    t = Tracking("proj", "exp", ["tracking", "wandb"], run_dir=tmp_path / "run")
    assert list(t.logger) == ["wandb"] and t.logger["wandb"].mode == "offline"
    t.finish()


_CLEARML_RUN = """
import sys, numpy as np, torch
from verl.utils.tracking import Tracking
t = Tracking("proj", "exp", ["clearml"], config={"trainer": {"run_dir": sys.argv[1]}, "actor": {"lr": 0.5}})
assert t.logger["clearml"].offline
t.log({"critic/score/mean": 0.25, "timing_s/gen": np.float32(1.5), "loss": torch.tensor(2.0), "note": "text"}, step=1)
t.log({"critic/score/mean": 0.75}, step=2)
t.log_generations([("1+1=", "2", 1.0), ("2+2=", "5", 0.0)], step=2)
print("FOLDER", t.logger["clearml"].offline_folder)
t.finish()
"""


def test_clearml_goes_offline_without_a_server_and_its_session_reads_back(tmp_path, monkeypatch):
    """In a process of its own: ClearML hooks the process it runs in (streams, frameworks, exit handlers)."""
    pytest.importorskip("clearml")
    import subprocess
    import sys

    for var in ("CLEARML_API_ACCESS_KEY", "CLEARML_API_HOST", "CLEARML_CONFIG_FILE", "CLEARML_OFFLINE_MODE"):
        monkeypatch.delenv(var, raising=False)
    env = {**__import__("os").environ, "HOME": str(tmp_path / "home"), "CLEARML_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", _CLEARML_RUN, str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (folder,) = re.findall(r"^FOLDER (.*)$", out.stdout, re.M)
    assert folder.startswith(str(tmp_path / "cache" / "offline"))
    events = [e for line in Path(folder, "metrics.jsonl").read_text().splitlines() for e in json.loads(line)]
    scalars = {
        (e["metric"], e["variant"], e["iter"]): e["value"] for e in events if e["type"] == "training_stats_scalar"
    }
    # graph = the name's first part, series = the rest; numpy and tensor scalars arrive as numbers, text never
    assert scalars == {
        ("critic", "score/mean", 1): 0.25,
        ("timing_s", "gen", 1): 1.5,
        ("loss", "loss", 1): 2.0,
        ("critic", "score/mean", 2): 0.75,
    }
    (table,) = [e for e in events if e["type"] == "plot"]
    assert (table["metric"], table["variant"], table["iter"]) == ("Validation", "Validation generations", 2)
    cells = json.loads(table["plot_str"])["data"][0]["cells"]["values"]
    assert cells == [[2, 2], ["1+1=", "2+2="], ["2", "5"], [1.0, 0.0]]
    task = json.loads(Path(folder, "task.json").read_text())
    assert task["name"] == "exp"
    assert "lr = 0.5" in task["configuration"]["Hyperparameters"]["value"]


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(
        tracking._BACKEND_PACKAGES, "tensorboard", ("verl_no_such_package_xyz", "pip install tensorboard")
    )
    with pytest.raises(ImportError, match="pip install tensorboard"):
        Tracking("p", "e", ["console", "tensorboard"])


def test_finish_draws_the_curves_png_once(tmp_path):
    t = Tracking("p", "e", ["file"], run_dir=tmp_path)
    for step, data in STEPS.items():
        t.log(data, step=step)
    t.finish()
    png = tmp_path / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mtime = png.stat().st_mtime_ns
    t.finish()  # idempotent
    assert png.stat().st_mtime_ns == mtime


def test_no_curves_png_without_plotted_metrics(tmp_path):
    t = Tracking("p", "e", ["file"], run_dir=tmp_path)
    t.log({"sft/loss": 1.0}, step=1)
    t.finish()
    assert not (tmp_path / "training_curves.png").exists()


def test_log_can_target_one_backend(tmp_path, capsys):
    t = Tracking("p", "e", ["console", "file"], run_dir=tmp_path)
    t.log({"x": 1.0}, step=1, backend="file")
    t.finish()
    assert capsys.readouterr().out == ""
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_validation_generations_are_kept_beside_the_metrics(tmp_path):
    t = Tracking("p", "e", ["file"], run_dir=tmp_path)
    t.log_generations([("What is 2+2?", "4", 1.0), ("What is 3+3?", "7", 0.0)], step=10)
    t.finish()
    rows = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 10, "input": "What is 2+2?", "output": "4", "score": 1.0},
        {"step": 10, "input": "What is 3+3?", "output": "7", "score": 0.0},
    ]
