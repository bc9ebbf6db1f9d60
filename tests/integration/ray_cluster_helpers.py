"""Helpers for tests that start their own Ray cluster next to whatever else runs on the machine.

Such a cluster gets a private temp dir (RAY_TMPDIR / `--temp-dir`), so `ray.init()` elsewhere never
finds it through `/tmp/ray/ray_current_cluster`, and ports nobody else uses. It is torn down by
killing exactly its own processes (every process whose command line names that temp dir, and their
children): `ray stop` would kill every Ray process of the user on the machine.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import time

import psutil


def short_temp_dir(prefix: str) -> str:
    """A fresh directory under /tmp with a short path (Ray's Unix socket paths must stay < 108 bytes)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that are free right now."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def processes_of(temp_dir: str) -> list[psutil.Process]:
    """The processes of the Ray cluster that lives in `temp_dir`: those naming it, and their children."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in proc.info["cmdline"] or []):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
        except psutil.Error:
            continue
    return list(found.values())


def _signal(procs: list[psutil.Process], kill: bool) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill() if kill else proc.terminate()


def kill_cluster(temp_dir: str, grace_s: float = 5.0) -> None:
    """SIGTERM the cluster's processes, SIGKILL what is left after `grace_s` (repeating while
    processes forked during the shutdown turn up)."""
    procs = processes_of(temp_dir)
    _signal(procs, kill=False)
    psutil.wait_procs(procs, timeout=grace_s)
    deadline = time.monotonic() + grace_s
    while (left := processes_of(temp_dir)) and time.monotonic() < deadline:
        _signal(left, kill=True)
        psutil.wait_procs(left, timeout=1.0)
