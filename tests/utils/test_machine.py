"""`verl.utils.machine`: the machine fields every benchmark headline ends with."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from verl.utils.machine import bench_headline, cpu_flags, kernel_isa, usable_cores

_HEADLINE = re.compile(r"^bench demo: a=1 b=x cpu=(\S+) isa=(\S+) cores=(\d+) load1=([0-9.]+)/([0-9.]+)$")


def test_the_headline_keeps_the_benchmark_fields_and_appends_the_machine():
    match = _HEADLINE.match(bench_headline("demo", "a=1 b=x"))
    assert match, bench_headline("demo", "a=1 b=x")
    cpu, isa, cores = match.group(1), match.group(2), int(match.group(3))
    assert " " not in cpu and cpu
    assert isa.split("+")[0] == torch.backends.cpu.get_cpu_capability()
    assert cores == usable_cores()


def test_the_isa_names_the_bf16_extension_exactly_when_the_cpu_reports_it():
    assert ("+bf16" in kernel_isa()) == ("avx512_bf16" in cpu_flags())
    assert ("+amx" in kernel_isa()) == ("amx_tile" in cpu_flags())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_cores_counts_the_affinity_mask_not_the_host():
    first_core = min(os.sched_getaffinity(0))
    code = (
        f"import os; os.sched_setaffinity(0, {{{first_core}}}); "
        "from verl.utils.machine import usable_cores; print(usable_cores())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "1"
