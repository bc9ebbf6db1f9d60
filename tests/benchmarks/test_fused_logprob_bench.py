"""`benchmarks/fused_logprob.py` runs end to end, and the fused path's peak memory is below the unfused one's
(the whole logits and their gradient, 2 x 64 MiB here, never exist)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

_LAST_LINE = re.compile(
    r"^bench fused_logprob: unfused_s=(\S+) fused_s=(\S+) time_ratio=(\S+) unfused_mib=(\S+) fused_mib=(\S+) "
    r"mem_ratio=(\S+) tokens=2048 vocab=8192 hidden=64 dtype=float32 device=cpu cpu=\S+ isa=\S+ cores=\d+ load1=\S+$"
)


@pytest.mark.slow  # three Python processes that import torch
def test_benchmark_reports_both_variants_and_the_fused_one_needs_less_memory():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run(
        [sys.executable, "benchmarks/fused_logprob.py", "--tokens=2048", "--vocab=8192", "--hidden=64"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    match = _LAST_LINE.match(last)
    assert match, last
    unfused_s, fused_s, _, unfused_mib, fused_mib, mem_ratio = map(float, match.groups())
    assert unfused_s > 0 and fused_s > 0
    assert unfused_mib > 100, "the unfused path holds the 64 MiB logits and their gradient"
    assert mem_ratio < 0.8, last
