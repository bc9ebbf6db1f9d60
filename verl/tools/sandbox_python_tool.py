"""`PythonSandboxTool`: run model-written Python in a separate, limited process.

`await run_python(code, stdin=...)` starts `python -I -B -c <prelude>` in a fresh temporary directory
with the code, then the program's own input, on stdin (the prelude reads exactly the code's bytes, so
`input()` and `sys.stdin` see only `stdin`); the prelude confines the process and then executes the
code as `__main__`. What the
model sees is stdout (and stderr, and a note when the run timed out, ran out of memory or was cut).

What is isolated, and how:
- Time: a wall-clock timeout (`timeout_s`) kills the whole process group; RLIMIT_CPU stops a busy
  loop even if the parent is starved.
- Memory: RLIMIT_AS (`memory_mb`) makes large allocations fail with MemoryError.
- Output: at most `max_output_bytes` of stdout and of stderr are kept; a process that writes more
  is killed as soon as it passes the cap (a print loop cannot fill the parent's memory).
- Files: the working directory, HOME and TMPDIR are a temporary directory removed afterwards;
  RLIMIT_FSIZE caps each file written (`max_file_bytes`). An audit hook (PEP 578) refuses writes,
  renames, deletions and permission changes outside that directory, opening a directory outside it,
  and reads outside it except Python's own installation (so imports of the standard library and
  installed packages work, but `/etc`, home directories and credentials are not readable).
- Network: the process first moves into new user and network namespaces (`unshare`), where no
  interface is up, when the kernel allows it (`sandbox_capabilities()` says whether it does); in
  any case the audit hook refuses `socket.connect`/`bind`/`sendto`/`sendmsg` and DNS lookups.
- Processes: the audit hook refuses subprocesses, `os.system`, `exec*`, `fork`, `posix_spawn`,
  signals to other processes, and loading native libraries through `ctypes`.
- Environment: only PATH, HOME, TMPDIR, LANG and PYTHONIOENCODING are passed; `-I` ignores
  PYTHON* variables and the user site directory.

What is NOT isolated: the audit hook runs inside the sandboxed interpreter, so it stops accidents
and naive escapes, not a determined attacker (e.g. one exploiting an interpreter bug, or a C
extension already importable from site-packages that makes system calls itself). The process runs
as the same user as the trainer. For untrusted code at scale run the tool inside a container or a
gVisor/nsjail/firejail sandbox (the `python` argument may point at such a wrapper) or use a remote
sandbox service.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

# Runs in the sandboxed interpreter before the user's code.
# argv: tmpdir memory_bytes cpu_seconds file_bytes code_bytes
_PRELUDE = r"""
import sys, os, resource, builtins
_tmp, _mem, _cpu, _fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
_code = sys.stdin.buffer.read(int(sys.argv[5])).decode("utf-8", "surrogateescape")
sys.argv = ["<sandbox>"]
sys.dont_write_bytecode = True
try:
    import ctypes
    _libc = ctypes.CDLL(None, use_errno=True)
    _netns = _libc.unshare(0x10000000 | 0x40000000) == 0  # CLONE_NEWUSER | CLONE_NEWNET
    del ctypes, _libc
except Exception:
    _netns = False
os.environ["VERL_SANDBOX_NETNS"] = "1" if _netns else "0"
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))

def _make_hook(tmp, readable, pid):
    realpath, join, isdir, getcwd, fspath = os.path.realpath, os.path.join, os.path.isdir, os.getcwd, os.fspath
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    denied_events = frozenset((
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "socket.connect", "socket.bind", "socket.sendto",
        "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "os.chroot",
    ))
    path_events = {"os.remove": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.rmdir": (0,), "os.link": (0, 1),
                   "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
                   "os.chflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,)}

    def resolve(path):
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode(errors="surrogateescape")
        return realpath(join(getcwd(), path))

    def inside(path, roots):
        return any(path == r or path.startswith(r + os.sep) for r in roots)

    def hook(event, args):
        if event in denied_events:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event in ("os.kill", "os.killpg", "signal.pthread_kill") and args[0] not in (pid, 0):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            real = resolve(path)
            writing = (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & write_flags)
            if writing or isdir(real):
                if not inside(real, (tmp,)):
                    raise PermissionError(f"sandbox: {path!r} is outside the sandbox directory")
            elif not inside(real, readable):
                raise PermissionError(f"sandbox: reading {path!r} is not allowed")
            return
        positions = path_events.get(event)
        if positions:
            for i in positions:
                if not isinstance(args[i], int) and not inside(resolve(args[i]), (tmp,)):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the sandbox directory")

    return hook

_readable = tuple(sorted({os.path.realpath(p) for p in (_tmp, sys.prefix, sys.base_prefix, sys.exec_prefix,
                  sys.base_exec_prefix, "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")} |
                  {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}))
sys.addaudithook(_make_hook(os.path.realpath(_tmp), _readable, os.getpid()))
del _make_hook, _readable, _mem, _cpu, _fsize
_globals = {"__name__": "__main__", "__builtins__": builtins}
try:
    exec(compile(_code, "<sandbox>", "exec"), _globals)
except SystemExit:
    raise
except BaseException as _e:  # the traceback the program would print, without this prelude's frame
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The process's exit status (negative: killed by that signal); None when it was killed by us."""
    timed_out: bool = False
    output_truncated: bool = False

    def to_text(self) -> str:
        """What the model reads: stdout, then stderr and notes when there are any."""
        parts = [self.stdout]
        if self.stderr:
            parts.append(("" if not self.stdout or self.stdout.endswith("\n") else "\n") + self.stderr)
        if self.output_truncated:
            parts.append("\n[output truncated]")
        if self.timed_out:
            parts.append("\n[timed out]")
        elif self.exit_code not in (0, None) and not self.stderr:
            parts.append(f"\n[exit code {self.exit_code}]")
        return "".join(parts)


# seconds to wait for the pipes to close and the process to be reaped after killing its group
_AFTER_KILL_S = 10.0


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signal.SIGKILL)


async def _read_capped(stream: asyncio.StreamReader, cap: int, on_overflow) -> tuple[bytes, bool]:
    data = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(data), False
        data += chunk
        if len(data) > cap:
            on_overflow()
            return bytes(data[:cap]), True


async def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 8192,
    max_file_bytes: int = 16 << 20,
    python: str | None = None,
) -> SandboxResult:
    """Execute `code` in a confined subprocess (see the module docstring) and collect its output;
    `stdin` is the program's standard input."""
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or max_file_bytes <= 0:
        raise ValueError("run_python: timeout_s, memory_mb, max_output_bytes and max_file_bytes must be positive")
    with tempfile.TemporaryDirectory(prefix="verl_sandbox_") as tmp:
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        code_bytes = code.encode("utf-8", errors="surrogateescape")
        limits = [tmp, str(memory_mb << 20), str(max(1, int(timeout_s + 0.999))), str(max_file_bytes)]
        limits.append(str(len(code_bytes)))
        proc = await asyncio.create_subprocess_exec(
            python or sys.executable,
            "-I",
            "-B",
            "-c",
            _PRELUDE,
            *limits,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills everything it started
        )
        kill = functools.partial(_kill_group, proc.pid)
        timed_out = False
        try:
            proc.stdin.write(code_bytes + stdin.encode("utf-8", errors="surrogateescape"))
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the interpreter died before reading (e.g. out of memory at start-up)
        finally:
            proc.stdin.close()
        readers = [
            asyncio.ensure_future(_read_capped(stream, max_output_bytes, kill)) for stream in (proc.stdout, proc.stderr)
        ]
        try:
            _, running = await asyncio.wait(readers, timeout=timeout_s)
            if running:
                timed_out = True
                kill()  # the pipes close with the process group, so the readers finish
                # bounded all the same: a pipe kept open by something the kill did not reach must not hang us
                _, running = await asyncio.wait(readers, timeout=_AFTER_KILL_S)
                for reader in running:
                    reader.cancel()
            (out, out_cut), (err, err_cut) = [
                reader.result() if not reader.cancelled() else (b"", True) for reader in readers
            ]
        except BaseException:  # cancelled: never leave the process behind
            kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), _AFTER_KILL_S)
            raise
        if out_cut or err_cut:
            kill()
        try:
            exit_code = await asyncio.wait_for(
                proc.wait(), _AFTER_KILL_S if (timed_out or out_cut or err_cut) else None
            )
        except asyncio.TimeoutError:  # killed, yet not reaped in time: report it as killed
            exit_code = None
        if exit_code == -signal.SIGXCPU:
            # its CPU limit (timeout_s of CPU time) stopped it before our wall-clock timer fired, as
            # happens when this process is starved: the same time limit, reported the same way
            timed_out = True
        return SandboxResult(
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            exit_code=None if (timed_out or out_cut or err_cut) else exit_code,
            timed_out=timed_out,
            output_truncated=out_cut or err_cut,
        )


@functools.lru_cache(maxsize=1)
def sandbox_capabilities() -> dict[str, bool]:
    """Which OS-level protections this machine grants the sandbox (probed once per process)."""
    code = "import os; print(os.environ['VERL_SANDBOX_NETNS'])"
    result = asyncio.run(run_python(code, timeout_s=20))
    return {"network_namespace": result.stdout.strip() == "1"}


SANDBOX_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program and return what it prints (no network, no files outside a scratch dir).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print() the results you need"}},
            "required": ["code"],
        },
    },
}


class PythonSandboxTool(BaseTool):
    """Runs the `code` argument with `run_python`.

    config: `timeout` (seconds, default 5; the agent loop's own limit is one second more),
    `memory_mb` (512), `max_output_bytes` (8192), `max_file_bytes` (16 MiB), `python` (interpreter
    or wrapper command, default this interpreter).
    """

    def __init__(self, config: dict | None = None, tool_schema: OpenAIFunctionToolSchema | dict | None = None):
        config = dict(config or {})
        self.run_timeout_s = float(config.get("timeout", 5.0))
        config["timeout"] = self.run_timeout_s + 1.0  # the subprocess's own timeout fires first
        super().__init__(config, tool_schema or SANDBOX_SCHEMA)
        self.limits = {
            "memory_mb": int(self.config.get("memory_mb", 512)),
            "max_output_bytes": int(self.config.get("max_output_bytes", 8192)),
            "max_file_bytes": int(self.config.get("max_file_bytes", 16 << 20)),
            "python": self.config.get("python"),
        }

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str):
            raise ValueError("missing string argument 'code'")
        result = await run_python(code, timeout_s=self.run_timeout_s, **self.limits)
        metrics = {"timed_out": float(result.timed_out), "output_truncated": float(result.output_truncated)}
        return ToolResponse(text=result.to_text()), 0.0, metrics
