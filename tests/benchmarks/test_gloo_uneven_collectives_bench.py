"""`benchmarks/gloo_uneven_collectives.py` runs end to end on 2 gloo ranks (it checks that the
uneven all-gather equals both alternatives it is timed against before timing any) and prints its
headline."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

_FIELDS = ("gather_ours_ms", "gather_padded_ms", "gather_a2a_ms", "gather_even_ms", "rs_gloo_ms", "rs_padded_ms")
_LAST_LINE = re.compile(r"^bench gloo_uneven_collectives: " + " ".join(f"{f}=(\\S+)" for f in _FIELDS) + " ")


# the slow tier: a benchmark script run end to end; the gather it times is checked in the default
# tier by tests/utils/megatron/test_gloo_collectives.py
@pytest.mark.slow
def test_uneven_collectives_benchmark_prints_every_timing():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "benchmarks/gloo_uneven_collectives.py", "--tokens", "32", "--hidden", "64"]
    run = subprocess.run([*cmd, "--repeats", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    match = _LAST_LINE.match(last)
    assert match, last
    assert all(float(ms) > 0 for ms in match.groups())
    assert "padding=1.25 world=2 tokens=32 hidden=64" in last
