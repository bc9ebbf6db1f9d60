"""`benchmarks/weight_sync.py` runs end to end and reports what its docstring promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

_LAST_LINE = re.compile(
    r"^bench weight_sync: seconds=(\S+) gb=(\S+) gb_s=(\S+) device=(\S+) cpu=(\S+) isa=(\S+) cores=(\d+) load1=(\S+)/(\S+)$"
)


def _run(*args: str) -> re.Match:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run(
        [sys.executable, "benchmarks/weight_sync.py", *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    match = _LAST_LINE.match(last)
    assert match, last
    seconds, gb, gb_s = map(float, match.groups()[:3])
    assert seconds > 0 and gb_s > 0
    assert gb_s == pytest.approx(gb / seconds, rel=0.05, abs=0.01)
    return match


# the slow tier (make test-all, CI): a benchmark script run end to end, tens of seconds on 2 cores;
# the sync it times: tests/workers/test_weight_sync.py, default tier
@pytest.mark.slow
def test_the_tiny_preset_syncs_on_cpu_and_prints_the_last_line():
    match = _run("--preset", "tiny", "--repeats", "2", "--rollout-dtype", "bfloat16")
    # the tiny preset's 1.08M parameters in bf16 (the tied head is the embedding)
    assert float(match.group(2)) == pytest.approx(2 * 1.08e6 / 1e9, rel=0.05)


@pytest.mark.gpu
def test_the_tiny_preset_syncs_over_nccl_on_cuda():
    match = _run("--preset", "tiny", "--repeats", "2")
    assert "cpu" not in match.group(4).lower(), match.group(0)
