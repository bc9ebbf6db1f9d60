"""`benchmarks/ulysses_row_gather.py` runs end to end on 2 gloo ranks (it checks that the packed
gather equals the pickled one before timing either) and prints its headline."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

_LAST_LINE = re.compile(r"^bench ulysses_row_gather: pickle_ms=(\S+) tensor_ms=(\S+) speedup=(\S+) mb_per_rank=(\S+) ")


# the slow tier (make test-all, CI): a benchmark script run end to end, tens of seconds on 2 cores;
# the gather it times: tests/workers/test_ulysses_rows.py, default tier
@pytest.mark.slow
def test_row_gather_benchmark_prints_both_timings_and_their_ratio():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "benchmarks/ulysses_row_gather.py", "--rows", "4", "--prompt", "16", "--response", "16"]
    run = subprocess.run([*cmd, "--repeats", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    match = _LAST_LINE.match(last)
    assert match, last
    pickle_ms, tensor_ms, speedup, _ = map(float, match.groups())
    assert pickle_ms > 0 and tensor_ms > 0
    assert speedup == pytest.approx(pickle_ms / tensor_ms, rel=0.05, abs=0.01)
