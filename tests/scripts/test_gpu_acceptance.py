"""scripts/gpu_acceptance.sh: its report parsers on hand-made inputs, and (slow) the whole script
in `--cpu-dry-run`, so the one-call GPU check cannot rot between GPU runs: every step runs with
tiny sizes on CPU, GPU tests are collected and skip cleanly, and the report files are complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_acceptance as acc  # noqa: E402


def test_bench_figures_come_from_the_last_headline():
    output = "noise\nbench x: a=1 b=2\nmore\nbench rollout: ours_tok_s=57175 pct_roofline=13.3 device=H100\n"
    assert acc.bench_figures(output) == {"ours_tok_s": 57175.0, "pct_roofline": 13.3, "device": "H100"}
    assert acc.bench_figures("no headline") == {}


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.b" name="test_err"><error message="fixture broke"/></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped message="no gpu"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts, failures = acc.parse_junit(xml)
    assert counts == {"tests": 4, "failures": 1, "errors": 1, "skipped": 1, "passed": 1}
    assert [(f["test"], f["kind"], f["message"]) for f in failures] == [
        ("tests.a::test_bad", "failure", "assert 1 == 2"),
        ("tests.b::test_err", "error", "fixture broke"),
    ]


def test_verbose_counts_when_the_run_was_killed_before_its_junit_report():
    output = (
        "tests/a.py::test_ok PASSED                                   [ 25%]\n"
        "tests/a.py::test_bad[bf16] FAILED                            [ 50%]\n"
        "some captured noise mentioning PASSED\n"
        "tests/b.py::test_skip SKIPPED (no gpu)                       [ 75%]\n"
        "tests/b.py::test_err ERROR                                   [100%]\n"
    )
    counts, failures = acc.parse_verbose(output)
    assert counts == {"tests": 4, "failures": 1, "errors": 1, "skipped": 1, "passed": 1}
    assert [(f["test"], f["kind"]) for f in failures] == [
        ("tests/a.py::test_bad[bf16]", "failed"),
        ("tests/b.py::test_err", "error"),
    ]


def test_grpo_figures_from_the_file_loggers_records():
    records = [
        {"step": 0, "data": {"val-core/arith/acc/mean@1": 0.25}},
        {"step": 1, "data": {"timing_s/step": 3.0, "critic/score/mean": 0.1}},
        {"step": 2, "data": {"timing_s/step": 0.2, "critic/score/mean": 0.3}},
        {"step": 3, "data": {"timing_s/step": 0.4, "critic/score/mean": 0.5, "val-core/arith/acc/mean@1": 0.5}},
    ]
    figures = acc.grpo_figures(records)
    assert figures["steps"] == 3
    assert figures["median_step_s"] == 0.4  # steps 2 and 3 (the first pays the warm-up): upper median
    assert (figures["critic/score/mean first"], figures["critic/score/mean last"]) == (0.1, 0.5)
    assert (figures["val_acc first"], figures["val_acc last"]) == ("0.250@0", "0.500@3")


def test_gpu_test_files_are_the_ones_that_mark_gpu_tests():
    files = acc.gpu_test_files()
    assert "tests/workers/rollout/test_rollout_cuda_graph.py" in files
    assert "tests/scripts/test_gpu_acceptance.py" not in files  # mentions the marker only in this string
    for name in files:
        assert acc.GPU_MARK.search((REPO / name).read_text())


@pytest.mark.slow
def test_cpu_dry_run_runs_every_step_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_acceptance.sh"), str(out), "--cpu-dry-run", "--budget-s", "900"],
        capture_output=True,
        text=True,
        timeout=1000,
        env={**__import__("os").environ, "PYTHON": sys.executable},
    )
    report = json.loads((out / "results.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert proc.returncode == 0 and report["passed"], (out / "summary.md").read_text()
    assert list(steps) == list(acc.STEPS)
    assert steps["install"]["status"] == "skipped"  # no bundle given: the installed packages are used
    assert all(steps[name]["status"] == "passed" for name in acc.STEPS if name != "install")
    gpu = steps["gpu_tests"]["figures"]
    assert gpu["tests"] >= 8 and gpu["skipped"] == gpu["tests"]
    assert steps["grpo"]["figures"]["steps"] == 2
    assert steps["rollout_roofline"]["figures"]["ours_tok_s"] > 0
    assert steps["actor_mfu"]["figures"]["mfu_pct"] > 0
    assert steps["actor_mfu_fused"]["figures"]["mfu_pct"] > 0 and steps["actor_mfu_fused"]["figures"]["fused"] == 1
    assert steps["weight_sync"]["figures"]["seconds"] > 0
    assert {p.name for p in out.iterdir()} == {
        "results.json",
        "summary.md",
        "logs.txt",
        "target_freeze.txt",
        "metrics.jsonl",
        "training_curves.png",
    }
