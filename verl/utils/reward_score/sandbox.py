"""The sandboxed executor for code-execution rewards: run model-written Python in a throw-away process.

A reward that executes generated code (unit tests for a coding task) must never `exec()` it inside
the trainer: the code would run with the trainer's memory, files, credentials and network. Call
`run_python(code, stdin=...)` instead; it runs the code in a fresh interpreter with

- its own session (the whole process group is killed at the deadline, children included);
- `python -I` (isolated mode: no PYTHON* variables, no user site-packages, no script directory on
  the path) and an environment stripped to PATH/LANG, so no secret in the trainer's environment
  (tokens, keys) reaches the code;
- a fresh temporary working directory, deleted afterwards;
- resource limits: address space (`memory_limit_mb`), CPU seconds, size of files it writes, open
  files, and no core dumps;
- a wall-clock deadline (`timeout_s`).

What it is not: a security boundary against a determined attacker. It shares the kernel, the user
id and the network with the trainer, and can read files the user can read. For untrusted code at
scale, run it in a container or a remote sandbox service (upstream verl's SandboxFusion:
`reward_model.sandbox_fusion.url`, see `verl.utils.reward_score.sandbox_fusion`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["SandboxResult", "run_python"]

_MAX_OUTPUT_BYTES = 1 << 20  # what is kept of stdout/stderr


@dataclass
class SandboxResult:
    """Outcome of one execution: exit status (negative: killed by that signal), output, and whether
    the deadline or a resource limit ended it."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _limits(memory_limit_mb: int, cpu_s: int, file_size_mb: int):
    def apply() -> None:  # runs in the child between fork and exec
        import resource

        os.setsid()
        memory = memory_limit_mb * 1024 * 1024
        for limit, value in (
            (resource.RLIMIT_AS, memory),
            (resource.RLIMIT_CPU, cpu_s),
            (resource.RLIMIT_FSIZE, file_size_mb * 1024 * 1024),
            (resource.RLIMIT_NOFILE, 64),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(limit, (value, value))

    return apply


def run_python(
    code: str,
    stdin: str = "",
    timeout_s: float = 10.0,
    memory_limit_mb: int = 1024,
    file_size_limit_mb: int = 16,
) -> SandboxResult:
    """Run `code` as a Python program with `stdin` as its input, within the limits above (POSIX only).

    The limits are set between fork and exec (`preexec_fn`); call it from the main thread of a
    process, or from a process pool (as the prime reward manager does), not from many threads at once.
    """
    if os.name != "posix":
        raise NotImplementedError("the sandboxed executor needs POSIX resource limits (Linux or macOS)")
    workdir = tempfile.mkdtemp(prefix="verl_sandbox_")
    try:
        program = os.path.join(workdir, "main.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(code)
        proc = subprocess.Popen(
            [sys.executable, "-I", program],
            cwd=workdir,
            env={"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_limits(memory_limit_mb, int(timeout_s) + 1, file_size_limit_mb),
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # and whatever it left running
            os.killpg(proc.pid, signal.SIGKILL)
        return SandboxResult(
            returncode=proc.returncode,
            stdout=out[:_MAX_OUTPUT_BYTES].decode("utf-8", "replace"),
            stderr=err[:_MAX_OUTPUT_BYTES].decode("utf-8", "replace"),
            timed_out=timed_out or proc.returncode == -signal.SIGXCPU,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
