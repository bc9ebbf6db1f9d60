"""Training-curves PNG from a metrics JSONL file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from verl.utils.plotting import is_plotted_metric, plot_training_curves, read_metrics_jsonl

BLUE = np.array([31, 119, 180])  # matplotlib tab:blue, the reward curve


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_records(n=20):
    recs = []
    for s in range(1, n + 1):
        data = {"critic/score/mean": s / n, "response_length/mean": 3 + s % 3, "actor/pg_loss": 0.1}
        if s % 5 == 0:
            data["val-core/arith/acc/mean@1"] = s / n
            data["val-core/gsm8k/acc/mean@1"] = s / (2 * n)
        recs.append({"step": s, "data": data})
    return recs


def blue_pixels(png, panel: int) -> int:
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)
    w = img.shape[1] // 3
    region = img[:, panel * w : (panel + 1) * w]
    return int((np.abs(region - BLUE).sum(axis=2) < 30).sum())


def test_png_is_valid_sized_and_draws_the_reward_curve(tmp_path):
    png = plot_training_curves(write_jsonl(tmp_path / "m.jsonl", run_records()), tmp_path / "curves.png")
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 20_000
    assert Image.open(png).size == (1300, 360)
    assert blue_pixels(png, 0) > 200  # a reward line is drawn in the left panel


def test_missing_metrics_leave_their_panel_empty(tmp_path):
    records = [{"step": s, "data": {"response_length/mean": 3.0}} for s in range(1, 5)]
    png = plot_training_curves(write_jsonl(tmp_path / "m.jsonl", records), tmp_path / "curves.png")
    assert blue_pixels(png, 0) < 20


def test_reader_accepts_flat_records_and_reports_bad_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "critic/score/mean": 0.5}\n\n{"step": 2, "data": {"x": 1}}\n')
    assert read_metrics_jsonl(path) == [
        {"step": 1, "data": {"critic/score/mean": 0.5}},
        {"step": 2, "data": {"x": 1}},
    ]
    path.write_text('{"step": 1, "data": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2 is not valid JSON"):
        read_metrics_jsonl(path)


def test_plotted_metric_names_follow_upstream():
    assert is_plotted_metric("critic/score/mean")
    assert is_plotted_metric("response_length/mean")
    assert is_plotted_metric("val-core/openai/gsm8k/acc/mean@4")
    assert not is_plotted_metric("val-aux/arith/reward/mean@1")
    assert not is_plotted_metric("critic/score/max")
