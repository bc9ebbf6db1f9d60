"""verl.utils.fs: local copies, the hdfs cache layout (with a stand-in `hdfs` CLI), shm copies."""

import os
import stat
import textwrap

import pytest

from verl.utils import fs


def _tree(root, files):
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)


def test_local_paths_pass_through_and_cache_path_layout(tmp_path):
    assert fs.copy_to_local(str(tmp_path)) == str(tmp_path)
    assert not fs.is_non_local("/a/b") and fs.is_non_local("hdfs://nn/a")
    path = fs.get_local_temp_path("hdfs://nn/models/m1", str(tmp_path))
    assert path == os.path.join(str(tmp_path), fs.md5_encode("hdfs://nn/models/m1"), "m1")
    assert os.path.isdir(os.path.dirname(path))
    with pytest.raises(ValueError, match="trailing '/'"):
        fs.copy_to_local("hdfs://nn/models/m1/")


def test_copy_exists_makedirs_and_verify_copy_locally(tmp_path):
    src = tmp_path / "src"
    _tree(src, {"a.txt": "abc", "sub/b.bin": "12345"})
    fs.makedirs(str(tmp_path / "x" / "y"), exist_ok=True)
    assert fs.exists(str(tmp_path / "x" / "y"))
    fs.copy(str(src), str(tmp_path / "dst"))
    assert fs.verify_copy(str(src), str(tmp_path / "dst"))
    with open(tmp_path / "dst" / "sub" / "b.bin", "w") as f:
        f.write("123")  # same files, one size differs
    assert not fs.verify_copy(str(src), str(tmp_path / "dst"))
    os.remove(tmp_path / "dst" / "sub" / "b.bin")
    assert not fs.verify_copy(str(src), str(tmp_path / "dst"))


@pytest.fixture
def fake_hdfs(tmp_path, monkeypatch):
    """An `hdfs` executable on PATH that maps hdfs://nn/<p> to <tmp>/remote/<p> and logs its calls."""
    remote = tmp_path / "remote"
    remote.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "hdfs.log"
    script = bin_dir / "hdfs"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/usr/bin/env python3
            import os, shutil, sys
            args = sys.argv[2:]
            open({str(log)!r}, "a").write(" ".join(args) + "\\n")
            loc = lambda p: p.replace("hdfs://nn", {str(remote)!r}) if p.startswith("hdfs://") else p
            if args[0] == "-test":
                sys.exit(0 if os.path.exists(loc(args[2])) else 1)
            if args[0] == "-mkdir":
                os.makedirs(loc(args[2]), exist_ok=True); sys.exit(0)
            if args[0] in ("-get", "-put", "-cp"):
                src, dst = loc(args[-2]), loc(args[-1])
                if not os.path.exists(src):
                    print("No such file: " + args[-2], file=sys.stderr); sys.exit(1)
                (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst); sys.exit(0)
            sys.exit(2)
            """
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return remote, log


def test_hdfs_download_is_cached_and_refetched_when_incomplete(tmp_path, fake_hdfs):
    remote, log = fake_hdfs
    _tree(remote / "models" / "m1", {"config.json": "{}", "w/part0": "0123456789"})
    cache = tmp_path / "cache"
    local = fs.copy_to_local("hdfs://nn/models/m1", cache_dir=str(cache))
    assert local == fs.get_local_temp_path("hdfs://nn/models/m1", str(cache))
    with open(os.path.join(local, "w", "part0")) as f:
        assert f.read() == "0123456789"
    assert log.read_text().count("-get") == 1
    assert fs.copy_to_local("hdfs://nn/models/m1", cache_dir=str(cache)) == local
    assert log.read_text().count("-get") == 1, "a complete cached copy must not be downloaded again"
    os.remove(os.path.join(local, "w", "part0"))
    fs.copy_to_local("hdfs://nn/models/m1", cache_dir=str(cache))
    assert log.read_text().count("-get") == 2 and os.path.exists(os.path.join(local, "w", "part0"))


def test_hdfs_exists_makedirs_upload_and_errors(tmp_path, fake_hdfs):
    remote, _ = fake_hdfs
    fs.makedirs("hdfs://nn/ckpt/step1")
    assert fs.exists("hdfs://nn/ckpt/step1") and not fs.exists("hdfs://nn/ckpt/step2")
    _tree(tmp_path / "out", {"f.txt": "x"})
    fs.copy(str(tmp_path / "out" / "f.txt"), "hdfs://nn/ckpt/step1/f.txt")
    assert (remote / "ckpt" / "step1" / "f.txt").read_text() == "x"
    with pytest.raises(OSError, match="No such file: hdfs://nn/missing"):
        fs.copy("hdfs://nn/missing", str(tmp_path / "m"))


def test_hdfs_without_cli_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="'hdfs' is not on PATH"):
        fs.exists("hdfs://nn/a")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_copy_to_local_with_shm_copies_once(tmp_path):
    src = tmp_path / "model"
    _tree(src, {"config.json": "{}"})
    dest = fs.copy_to_local(str(src), use_shm=True)
    try:
        assert dest.startswith(fs.SHM_CACHE_ROOT) and fs.verify_copy(str(src), dest)
        mtime = os.path.getmtime(os.path.join(dest, "config.json"))
        assert fs.copy_to_local(str(src), use_shm=True) == dest
        assert os.path.getmtime(os.path.join(dest, "config.json")) == mtime
    finally:
        import shutil

        shutil.rmtree(os.path.dirname(dest), ignore_errors=True)


def test_local_mkdir_safe_returns_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = fs.local_mkdir_safe("a/b")
    assert path == os.path.join(str(tmp_path), "a", "b") and os.path.isdir(path)
