"""`benchmarks/step_profile.py` runs its in-process part end to end and prints what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


# the slow tier (make test-all, CI): a benchmark script run end to end, tens of seconds on 2 cores;
# the trainer phases and the profiler it times are unit-tested in the default tier
@pytest.mark.slow
def test_step_profile_local_part_prints_phase_times_and_top_operators():
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "benchmarks/step_profile.py", "--steps", "0", "--repeats", "2", "--profile-iters", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    headline = lines[-1]
    times = dict(re.findall(r"local_(gen|update)_ms=([0-9.]+)", headline))
    assert set(times) == {"gen", "update"} and all(float(v) > 0 for v in times.values()), headline
    # both profiles list the matmuls, which dominate a step of this model
    assert sum("aten::mm" in line or "aten::addmm" in line for line in lines) >= 2, out.stdout[-3000:]
