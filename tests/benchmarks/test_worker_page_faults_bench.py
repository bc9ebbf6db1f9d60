"""`benchmarks/worker_page_faults.py` reads faults and CPU time from /proc and finds child processes
(the full ABBA run takes minutes and is not run here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.worker_page_faults import _descendants, _faults_and_cpu_s


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_faults_and_cpu_time_grow_when_a_process_touches_fresh_pages_and_computes():
    faults, cpu_s = _faults_and_cpu_s(os.getpid())
    pages = bytearray(8 * 2**20)  # zero-filled on first touch: 2K faults of 4 KiB
    for i in range(0, len(pages), 4096):
        pages[i] = 1
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    faults_after, cpu_s_after = _faults_and_cpu_s(os.getpid())
    assert faults_after - faults >= 1000, (faults, faults_after)
    assert cpu_s_after - cpu_s >= 0.03, (cpu_s, cpu_s_after)


def test_descendants_lists_a_grandchild_with_its_command_line():
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)  # grandchild'])"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 20
        found = []
        while time.time() < deadline and len(found) < 2:
            # the child's command line holds the grandchild's code too: both match
            found = sorted(pid for pid, args in _descendants(os.getpid()) if "grandchild" in args)
            time.sleep(0.1)
        assert len(found) == 2 and child.pid in found, (child.pid, found)
    finally:
        for pid, _ in _descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()
