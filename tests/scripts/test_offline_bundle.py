"""scripts/offline_bundle.py: the requirement walk (against a local folder of hand-made wheels, so
these need no index), the Ray slimming (a slimmed wheel still installs with pip and lists exactly
what it holds), and, marked slow, the real thing: Ray's wheel for this interpreter, slimmed, in a
fresh virtualenv, starting a cluster; and the GPU image's bundle within its size."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import offline_bundle as ob  # noqa: E402

from tests.integration.ray_cluster_helpers import kill_cluster, short_temp_dir  # noqa: E402


def make_wheel(folder: Path, name: str, version: str, requires=(), files=None, tag="py3-none-any") -> Path:
    """A minimal, valid wheel: METADATA, WHEEL, RECORD and `files` ({path: text})."""
    files = dict(files or {f"{name}/__init__.py": f"VERSION = {version!r}\n"})
    dist = f"{name}-{version}.dist-info"
    files[f"{dist}/METADATA"] = (
        "Metadata-Version: 2.1\n"
        + f"Name: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    files[f"{dist}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"
    path = folder / f"{name}-{version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            data = text.encode()
            zf.writestr(member, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{member},sha256={digest},{len(data)}")
        zf.writestr(f"{dist}/RECORD", "\n".join([*record, f"{dist}/RECORD,,"]) + "\n")
    return path


def resolver_args(tmp_path: Path, index: Path) -> argparse.Namespace:
    return argparse.Namespace(
        python="3.12",
        platform=["manylinux2014_x86_64"],
        glibc="2.28",
        pip_option=["--no-index", f"--find-links={index}"],
        without=set(),
    )


def test_have_file_reads_pip_freeze_lines_and_bare_names(tmp_path):
    have = tmp_path / "freeze.txt"
    have.write_text(
        "# comment\nPyYAML==6.0.3\ntyping_extensions==4.15.0\nmypkg @ file:///tmp/x.whl\nbare-name\n-e git+x#egg=y\n"
    )
    assert ob.parse_have(have) == {
        "pyyaml": Version("6.0.3"),
        "typing-extensions": Version("4.15.0"),
        "mypkg": None,
        "bare-name": None,
    }


def test_manylinux2014_target_also_takes_newer_manylinux_tags_up_to_its_glibc():
    tags = ob.expand_platforms(["manylinux2014_x86_64"], "2.28")
    assert {"manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert ob.expand_platforms(["win_amd64"], "2.28") == ["win_amd64"]


def test_walk_bundles_what_the_target_lacks_and_narrows_a_version_a_later_requirement_excludes(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    # app needs lib (newest is 2.0) and tool; tool needs lib<2: a first pick of lib 2.0 must be undone
    make_wheel(index, "lib", "1.0")
    make_wheel(index, "lib", "2.0")
    make_wheel(index, "tool", "1.0", requires=["lib<2", "present>=1", 'winonly; sys_platform == "win32"'])
    make_wheel(index, "extra_dep", "1.0")
    make_wheel(index, "app", "1.0", requires=["lib>=1", "tool", 'extra_dep; extra == "more"'])
    args = resolver_args(tmp_path, index)
    cache = tmp_path / "cache"
    cache.mkdir()
    resolver = ob.resolve(args, cache, {"present": Version("1.5")}, {}, [Requirement("app")], set(), False)
    chosen = {name: str(c.version) for name, c in resolver.chosen.items()}
    assert chosen == {"app": "1.0", "lib": "1.0", "tool": "1.0"}  # no winonly (marker), no extra_dep (extra)
    assert "present" in resolver.skipped

    with_extra = ob.resolve(args, cache, {"present": None}, {}, [Requirement("app[more]")], set(), False)
    assert "extra-dep" in with_extra.chosen


def test_lock_pin_is_preferred_and_a_target_version_that_does_not_fit_is_bundled(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    for version in ("1.0", "1.1", "2.0"):
        make_wheel(index, "lib", version)
    make_wheel(index, "app", "1.0", requires=["lib>=1.1"])
    args = resolver_args(tmp_path, index)
    cache = tmp_path / "cache"
    cache.mkdir()
    resolver = ob.resolve(
        args, cache, {"lib": Version("1.0")}, {"lib": Version("1.1")}, [Requirement("app")], set(), False
    )
    assert str(resolver.chosen["lib"].version) == "1.1"  # the target's 1.0 does not fit; the lock's 1.1 does


def test_accelerator_stack_is_never_bundled(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "app", "1.0", requires=["torch>=9"])
    args = resolver_args(tmp_path, index)
    with pytest.raises(ob.BundleError, match="never bundled"):
        ob.resolve(args, tmp_path, {"torch": Version("2.11.0")}, {}, [Requirement("app")], set(), False)


def test_slimmed_wheel_drops_the_unloaded_parts_keeps_a_true_record_and_installs(tmp_path):
    files = {
        "ray/__init__.py": "X = 1\n",
        "ray/jars/ray_dist.jar": "java",
        "ray/dashboard/client/build/static/js/main.js.map": "{}",
        "ray/dashboard/client/build/static/js/main.js": "js",
        "ray/rllib/__init__.py": "",
        "ray/util/__init__.py": "",
    }
    src = make_wheel(tmp_path, "ray", "9.9", files=files)
    dst = tmp_path / "slim" / src.name
    dst.parent.mkdir()
    dropped = ob.slim_wheel(src, dst, ob.RAY_DROP)
    assert sorted(dropped) == sorted(
        ["ray/jars/ray_dist.jar", "ray/dashboard/client/build/static/js/main.js.map", "ray/rllib/__init__.py"]
    )
    with zipfile.ZipFile(dst) as zf:
        names = set(zf.namelist())
        record = zf.read("ray-9.9.dist-info/RECORD").decode().splitlines()
        for line in record:
            member, digest, size = line.split(",")
            assert member in names
            if digest:
                data = zf.read(member)
                expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert digest == f"sha256={expected}" and int(size) == len(data)
    assert {line.split(",")[0] for line in record} == names
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), str(dst)],
        check=True,
    )
    assert (target / "ray" / "util" / "__init__.py").exists() and not (target / "ray" / "jars").exists()


def _venv_python(folder: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(folder)
    return folder / "bin" / "python"


@pytest.mark.slow
def test_slimmed_ray_wheel_starts_a_cluster_in_a_fresh_virtualenv(tmp_path):
    """The real Ray wheel for this interpreter (from the index), slimmed, installed into a new
    virtualenv with nothing else of ours, runs a task, an actor and a placement group, and `ray start`
    brings up a head node."""
    import ray

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    cache = tmp_path / "cache"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(cache)]
        + [f"ray=={ray.__version__}"],
        check=True,
    )
    (original,) = cache.glob("ray-*.whl")
    slim = tmp_path / "bundle" / original.name
    slim.parent.mkdir()
    dropped = ob.slim_wheel(original, slim, ob.RAY_DROP)
    assert any(name.endswith("ray_dist.jar") for name in dropped)
    assert slim.stat().st_size < 0.65 * original.stat().st_size
    py = _venv_python(tmp_path / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(slim)], check=True)
    script = (
        "import ray\n"
        "from ray.util.placement_group import placement_group\n"
        "ray.init(num_cpus=2, include_dashboard=False)\n"
        "@ray.remote\n"
        "def double(x): return 2 * x\n"
        "@ray.remote\n"
        "class Echo:\n"
        "    def ping(self): return 'pong'\n"
        "pg = placement_group([{'CPU': 1}]); ray.get(pg.ready(), timeout=60)\n"
        "print(ray.get(double.remote(21)), ray.get(Echo.remote().ping.remote()), ray.__version__)\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS")}
    # this test's clusters live under its own folder: stopping them must not touch any other
    ray_tmp = short_temp_dir("vb")  # Ray's socket paths must stay short
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp)
    out = subprocess.run([str(py), "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["42", "pong", ray.__version__], python
    ray_cli = py.parent / "ray"
    temp = f"{ray_tmp}/head"
    started = subprocess.run(
        [
            str(ray_cli),
            "start",
            "--head",
            "--num-cpus=1",
            "--port=0",
            f"--temp-dir={temp}",
            "--include-dashboard=false",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    try:
        assert started.returncode == 0, started.stderr[-2000:]
    finally:
        # not `ray stop`: it ends every Ray cluster on the machine, this test session's own included
        kill_cluster(ray_tmp)


@pytest.mark.slow
def test_gpu_image_bundle_fits_its_budget(tmp_path):
    """The bundle for the lent GPU machines (Python 3.12, what scripts/gpu_image_freeze.txt says they
    have) holds Ray, Hydra, OmegaConf, tensordict, codetiming and our wheel, and is at most 55 MB."""
    out = tmp_path / "bundle"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "offline_bundle.py"), "--python", "3.12"]
        + ["--platform", "manylinux2014_x86_64", "--have", str(REPO / "scripts" / "gpu_image_freeze.txt")]
        + ["--out", str(out), "--cache", str(tmp_path / "cache"), "--max-mb", "55"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    names = {w["name"] for w in manifest["wheels"]}
    assert {"ray", "hydra-core", "omegaconf", "antlr4-python3-runtime", "tensordict", "codetiming", "verl"} <= names
    assert not names & {"torch", "transformers", "mlflow", "wandb", "vllm", "megatron-core", "datasets"}
    assert "datasets" in manifest["left_out"]  # only preprocessing and custom dataset classes import it
    assert manifest["total_mb"] <= 55
    assert (out / "install.sh").exists()


def test_with_names_only_a_requirement_left_out_by_default(tmp_path, capsys):
    assert set(ob.RUN_OPTIONAL) == {"datasets"}
    with pytest.raises(SystemExit) as exit_info:
        ob.main(["--out", str(tmp_path / "b"), "--with", "ray"])
    assert exit_info.value.code == 2
    assert "only ['datasets'] are left out by default" in capsys.readouterr().err
