"""The Python sandbox: output, limits (time, memory, output size), files, network, processes."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from verl.tools.sandbox_python_tool import PythonSandboxTool, run_python, sandbox_capabilities


def run(code: str, **limits):
    return asyncio.run(run_python(code, **{"timeout_s": 5.0, **limits}))


def test_prints_and_errors_come_back_as_text():
    ok = run("import math\nprint(sum(range(10)), math.factorial(5))")
    assert (ok.stdout, ok.stderr, ok.exit_code) == ("45 120\n", "", 0)
    failed = run("1/0")
    assert failed.exit_code == 1
    assert failed.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert 'File "<sandbox>", line 1' in failed.stderr and "<string>" not in failed.stderr  # no prelude frames


def test_stdin_is_the_programs_input_and_not_part_of_the_code():
    result = run("import sys\nname = input()\nprint(name.upper(), sys.stdin.read().split())", stdin="ada\n1 2\n3")
    assert (result.stdout, result.exit_code) == ("ADA ['1', '2', '3']\n", 0)
    assert run("print(repr(input()))", stdin="é ü\n").stdout == "'é ü'\n"  # counted in bytes, not characters
    assert "EOFError" in run("input()").stderr


def test_a_busy_loop_and_a_sleep_are_killed_at_the_timeout():
    for code in ("while True: pass", "import time; time.sleep(60)"):
        start = time.monotonic()
        result = run(code, timeout_s=1.0)
        assert result.timed_out and result.exit_code is None
        # not a speed check: the sleep alone would take 60 s, so this only proves the kill (loose for busy CI)
        assert time.monotonic() - start < 30
        assert "[timed out]" in result.to_text()


def test_memory_beyond_the_limit_fails_inside_the_program():
    result = run("b = bytearray(1 << 30)", memory_mb=256)
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    assert run("b = bytearray(32 << 20); print(len(b))", memory_mb=256).stdout == f"{32 << 20}\n"


def test_output_is_capped_and_a_flood_is_stopped():
    start = time.monotonic()
    result = run("while True: print('x' * 1000)", max_output_bytes=5000)
    assert result.output_truncated and len(result.stdout) == 5000 and not result.timed_out
    assert time.monotonic() - start < 30  # the flood never ends by itself: this proves it was stopped
    assert result.to_text().endswith("[output truncated]")


def test_files_can_be_written_only_inside_a_scratch_directory_that_is_removed(tmp_path):
    outside = tmp_path / "escaped.txt"
    code = f"""
import os
open("notes.txt", "w").write("kept")
print(open("notes.txt").read(), os.getcwd())
for attempt in (lambda: open({str(outside)!r}, "w"), lambda: os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT),
                lambda: os.mkdir({str(tmp_path / "d")!r}), lambda: os.rename("notes.txt", {str(outside)!r}),
                lambda: open(os.path.expanduser("~/../../{outside.name}"), "a")):
    try:
        attempt()
        print("ALLOWED")
    except PermissionError as e:
        print("refused")
"""
    result = run(code)
    kept, scratch = result.stdout.splitlines()[0].split()
    assert kept == "kept" and result.stdout.count("refused") == 5 and "ALLOWED" not in result.stdout
    assert not outside.exists() and not (tmp_path / "d").exists()
    assert not os.path.exists(scratch)  # the scratch directory is gone after the run


def test_reading_outside_the_scratch_directory_and_python_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    result = run(f"print(open({str(secret)!r}).read())")
    assert "PermissionError" in result.stderr and "token" not in result.stdout
    assert run("import json, fractions; print(json.dumps([1]))").stdout == "[1]\n"  # the standard library imports


def test_no_network_even_to_a_listening_local_port():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        result = run(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
    finally:
        server.close()
    assert "connected" not in result.stdout and result.exit_code != 0


def test_no_subprocesses_signals_or_native_libraries():
    for code in (
        "import subprocess; subprocess.run(['true'])",
        "import os; os.system('true')",
        "import os; os.kill(1, 0)",
        "import ctypes; ctypes.CDLL(None)",
    ):
        result = run(code)
        assert result.exit_code != 0 and "PermissionError: sandbox:" in result.stderr, code


def test_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("VERL_TEST_SECRET", "hunter2")
    env = run("import os; print(sorted(os.environ))").stdout
    assert "VERL_TEST_SECRET" not in env and "PATH" in env


def test_capabilities_report_whether_the_network_namespace_is_available():
    assert set(sandbox_capabilities()) == {"network_namespace"}


def test_tool_runs_the_code_argument():
    tool = PythonSandboxTool({"timeout": 2})
    assert tool.name == "python" and tool.timeout_s == 3.0  # the loop's limit leaves the subprocess time to die
    response, _, metrics = asyncio.run(tool.execute("id", {"code": "print(6*7)"}))
    assert response.text == "42\n" and metrics == {"timed_out": 0.0, "output_truncated": 0.0}
    with pytest.raises(ValueError, match="'code'"):
        asyncio.run(tool.execute("id", {}))


def test_a_program_stopped_by_its_cpu_limit_is_reported_as_timed_out():
    # Under load the CPU limit (RLIMIT_CPU = timeout_s) can stop a busy loop before the parent's
    # wall-clock timer fires; the kernel's SIGXCPU is the same time limit and must read the same.
    # The program raises the signal itself, so the check does not depend on the machine's load.
    result = run("import os, signal; os.kill(os.getpid(), signal.SIGXCPU)", timeout_s=30.0)
    assert result.timed_out and result.exit_code is None
    assert "[timed out]" in result.to_text()
