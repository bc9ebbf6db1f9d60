"""The sandboxed executor for code-execution rewards: runs model-written code in a separate, limited,
throw-away process (verl.utils.reward_score.sandbox)."""

from __future__ import annotations

import os
import time

import pytest

from verl.utils.reward_score.sandbox import run_python


def test_runs_a_program_on_its_input():
    result = run_python("a, b = map(int, input().split())\nprint(a + b)", stdin="37 48\n")
    assert result.ok and result.stdout == "85\n" and result.stderr == ""


def test_a_failing_program_reports_its_error():
    result = run_python("raise ValueError('wrong answer')")
    assert not result.ok and result.returncode == 1 and "ValueError: wrong answer" in result.stderr


def test_the_trainer_environment_and_working_directory_do_not_leak_in(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "secret-token")
    monkeypatch.chdir(tmp_path)
    code = "import os\nprint(os.environ.get('HF_TOKEN'))\nprint(os.getcwd())\nopen('left.txt', 'w').write('x')"
    result = run_python(code)
    token, cwd = result.stdout.split()
    assert token == "None" and cwd != str(tmp_path) and "verl_sandbox_" in cwd
    assert not os.path.exists(cwd)  # the working directory is deleted afterwards
    assert not (tmp_path / "left.txt").exists()


def test_an_endless_program_and_its_children_are_killed_at_the_deadline(tmp_path):
    marker = tmp_path / "child_alive"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    code = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nwhile True:\n    pass\n"
    start = time.monotonic()
    result = run_python(code, timeout_s=1.5)
    # the program never ends by itself: 60 s (40x the deadline) proves the kill on any load
    assert result.timed_out and not result.ok and time.monotonic() - start < 60
    time.sleep(3.5)
    assert not marker.exists()  # the background child died with the program


def test_memory_beyond_the_limit_fails_the_program():
    result = run_python("x = bytearray(1 << 30)\nprint('allocated')", memory_limit_mb=256)
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout


@pytest.mark.parametrize("limit_mb", [1])
def test_files_larger_than_the_limit_cannot_be_written(limit_mb):
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'0' * (4 << 20))\nprint('written')"
    result = run_python(code, file_size_limit_mb=limit_mb)
    assert not result.ok and "written" not in result.stdout
