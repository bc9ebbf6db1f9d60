"""File-system helpers that accept local paths and `hdfs://` URIs alike (upstream's `verl.utils.fs`).

- `exists`, `makedirs`, `copy`: `os.path.exists` / `os.makedirs` / `shutil.copy(tree)` for local
  paths; for `hdfs://` they run the Hadoop CLI (`hdfs dfs -test -e | -mkdir -p | -put | -get | -cp`),
  which must be on PATH (an error says so otherwise). A failing `hdfs` command raises with its
  output instead of returning False, so a missing checkpoint upload is never silent.
- `copy_to_local(src, cache_dir=None, ...)`: the local path of `src`. A local path (or a Hugging
  Face model id) is returned unchanged; an `hdfs://` path is downloaded once into
  `<cache_dir or tempdir>/<md5 of the URI>/<basename>` under a file lock, so concurrent workers on
  one node download it once, and a directory's file list is recorded so that a partly deleted
  cache is noticed and fetched again. `use_shm=True` then copies the result into `/dev/shm/verl-cache`
  (loading weights from RAM is faster when several processes load the same model).
- `local_mkdir_safe(path)`: `os.makedirs(path, exist_ok=True)` under a file lock (several ranks
  creating one checkpoint directory at once).

`filelock` is a dependency of transformers and huggingface_hub, so it is always installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

__all__ = [
    "copy",
    "copy_local_path_from_hdfs",
    "copy_to_local",
    "copy_to_shm",
    "exists",
    "get_local_temp_path",
    "is_non_local",
    "local_mkdir_safe",
    "makedirs",
    "md5_encode",
    "verify_copy",
]

_HDFS_PREFIX = "hdfs://"
_RECORD_FILE = ".directory_record.txt"
SHM_CACHE_ROOT = "/dev/shm/verl-cache"


def is_non_local(path: str) -> bool:
    """True for an `hdfs://` path."""
    return str(path).startswith(_HDFS_PREFIX)


def md5_encode(path: str) -> str:
    """Hex MD5 of the path string (names cache directories and lock files)."""
    return hashlib.md5(path.encode()).hexdigest()


def get_local_temp_path(hdfs_path: str, cache_dir: str) -> str:
    """`<cache_dir>/<md5(hdfs_path)>/<basename(hdfs_path)>`, creating the hashed directory."""
    directory = os.path.join(cache_dir, md5_encode(hdfs_path))
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, os.path.basename(hdfs_path))


# ------------------------------------------------------------------------------------------------
# exists / makedirs / copy


def _hdfs(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    binary = shutil.which("hdfs")
    if binary is None:
        raise FileNotFoundError(
            f"'hdfs' is not on PATH, so `hdfs dfs {' '.join(args)}` cannot run; install the Hadoop client "
            "(and set HADOOP_HOME / JAVA_HOME) or use local paths"
        )
    return subprocess.run([binary, "dfs", *args], capture_output=True, text=True, timeout=timeout)


def _check(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        raise OSError(
            f"{what} failed (exit code {result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
        )


def exists(path: str, **kwargs) -> bool:
    """`os.path.exists` that also answers for `hdfs://` paths."""
    if is_non_local(path):
        return _hdfs("-test", "-e", path, **kwargs).returncode == 0
    return os.path.exists(path)


def makedirs(name: str, mode: int = 0o777, exist_ok: bool = False, **kwargs) -> None:
    """`os.makedirs` that also creates `hdfs://` directories (there always as `mkdir -p`)."""
    if is_non_local(name):
        _check(_hdfs("-mkdir", "-p", name, **kwargs), f"hdfs dfs -mkdir -p {name}")
    else:
        os.makedirs(name, mode=mode, exist_ok=exist_ok)


def copy(src: str, dst: str, **kwargs):
    """Copy a file (`shutil.copy`) or a directory tree (`shutil.copytree`); with an `hdfs://` side,
    upload, download or copy within HDFS. Returns the destination."""
    if is_non_local(src) or is_non_local(dst):
        if is_non_local(dst):
            args = ("-cp", "-f", src, dst) if is_non_local(src) else ("-put", "-f", src, dst)
        else:
            args = ("-get", src, dst)
        _check(_hdfs(*args, **kwargs), f"hdfs dfs {' '.join(args)}")
        return dst
    if os.path.isdir(src):
        return shutil.copytree(src, dst, **kwargs)
    return shutil.copy(src, dst, **kwargs)


# ------------------------------------------------------------------------------------------------
# copies that can be checked


def _entries(root: str) -> set[str]:
    """Every file and directory under `root`, as `dir:<rel>` / `file:<rel>` (the record file left out)."""
    found = set()
    for current, dirs, files in os.walk(root):
        for name in dirs:
            found.add("dir:" + os.path.relpath(os.path.join(current, name), root))
        for name in files:
            if name != _RECORD_FILE:
                found.add("file:" + os.path.relpath(os.path.join(current, name), root))
    return found


def _record_directory_structure(folder: str) -> str:
    record = os.path.join(folder, _RECORD_FILE)
    entries = sorted(_entries(folder))
    with open(record, "w") as f:
        f.write("".join(f"{entry}\n" for entry in entries))
    return record


def _check_directory_structure(folder: str, record: str) -> bool:
    if not os.path.exists(record):
        return False
    with open(record) as f:
        return _entries(folder) == set(f.read().splitlines())


def verify_copy(src: str, dest: str) -> bool:
    """True when `dest` has the same files and directories as `src`, each file of the same size."""
    if not (os.path.exists(src) and os.path.exists(dest)):
        return False
    if os.path.isfile(src) != os.path.isfile(dest):
        return False
    if os.path.isfile(src):
        return os.path.getsize(src) == os.path.getsize(dest)
    src_entries, dest_entries = _entries(src), _entries(dest)
    if src_entries != dest_entries:
        return False
    for entry in src_entries:
        kind, rel = entry.split(":", 1)
        if kind == "file" and os.path.getsize(os.path.join(src, rel)) != os.path.getsize(os.path.join(dest, rel)):
            return False
    return True


def copy_to_shm(src: str) -> str:
    """Copy `src` (file or directory) to `/dev/shm/verl-cache/<md5 of its absolute path>/<basename>`
    unless an identical copy is already there; return the copy's path."""
    src_abs = os.path.abspath(os.path.normpath(src))
    dest_dir = os.path.join(SHM_CACHE_ROOT, md5_encode(src_abs))
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, os.path.basename(src_abs))
    if os.path.exists(dest) and verify_copy(src_abs, dest):
        return dest
    if os.path.isdir(src_abs):
        shutil.copytree(src_abs, dest, symlinks=False, dirs_exist_ok=True)
    else:
        shutil.copy2(src_abs, dest)
    return dest


def copy_to_local(
    src: str,
    cache_dir: str | None = None,
    filelock: str = ".file.lock",
    verbose: bool = False,
    always_recopy: bool = False,
    use_shm: bool = False,
) -> str:
    """The local path of `src` (see the module docstring). `filelock` is kept for upstream's signature:
    the lock file is always named after the URI's hash, so one URI has one lock."""
    local_path = copy_local_path_from_hdfs(src, cache_dir, filelock, verbose, always_recopy)
    if use_shm:
        if not os.path.exists(local_path):
            local_path = _hub_snapshot(local_path)
        return copy_to_shm(local_path)
    return local_path


def _hub_snapshot(model_id: str) -> str:
    """The local snapshot of a Hugging Face model id (downloaded if needed), for `use_shm`."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_id)
    except Exception as e:
        raise FileNotFoundError(
            f"copy_to_local(use_shm=True): {model_id!r} is not a local path and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {e}); give a local directory"
        ) from e


def copy_local_path_from_hdfs(
    src: str, cache_dir: str | None = None, filelock: str = ".file.lock", verbose: bool = False, always_recopy=False
) -> str:
    """Download an `hdfs://` `src` into the cache (see `copy_to_local`); return other paths unchanged."""
    from filelock import FileLock

    if src.endswith("/"):
        raise ValueError(f"copy_to_local: drop the trailing '/' of {src!r} (the basename names the cached copy)")
    if not is_non_local(src):
        return src
    cache_dir = cache_dir or tempfile.gettempdir()
    os.makedirs(cache_dir, exist_ok=True)
    local_path = get_local_temp_path(src, cache_dir)
    with FileLock(os.path.join(cache_dir, md5_encode(src) + ".lock")):
        if always_recopy and os.path.exists(local_path):
            if os.path.isdir(local_path):
                shutil.rmtree(local_path, ignore_errors=True)
            else:
                os.remove(local_path)
        if not os.path.exists(local_path):
            if verbose:
                print(f"copy {src} to {local_path}")
            copy(src, local_path)
            if os.path.isdir(local_path):
                _record_directory_structure(local_path)
        elif os.path.isdir(local_path) and not _check_directory_structure(
            local_path, os.path.join(local_path, _RECORD_FILE)
        ):
            if verbose:
                print(f"the cached copy {local_path} of {src} is incomplete; copying it again")
            shutil.rmtree(local_path, ignore_errors=True)
            copy(src, local_path)
            _record_directory_structure(local_path)
    return local_path


def local_mkdir_safe(path: str) -> str:
    """Create the directory `path` (relative to the working directory) under a lock; return its absolute path."""
    from filelock import FileLock

    path = os.path.abspath(path)
    lock_path = os.path.join(tempfile.gettempdir(), f"verl_mkdir_{md5_encode(path)[:16]}.lock")
    with FileLock(lock_path, timeout=60):
        os.makedirs(path, exist_ok=True)
    return path


def find_relative_file(path: str, folders) -> tuple[str | None, list[str]]:
    """Look a file up: `path` itself when absolute, else under each of `folders` in order (a None
    folder is skipped). Returns the first existing file (or None) and the candidates looked at, for an
    error message that says where it looked."""
    path = os.path.expanduser(str(path))
    candidates = [path] if os.path.isabs(path) else [os.path.join(f, path) for f in folders if f is not None]
    return next((c for c in candidates if os.path.isfile(c)), None), candidates
