"""The dependency lock (requirements/constraints-py311.txt) agrees with setup.py's ranges and the
Makefile, and scripts/dependency_lock.py reads, writes and filters it as the Makefile and the
Dockerfiles use it.

The agreement test is what catches a bump done halfway: a range raised in setup.py without
`make lock`, or a lock edited by hand outside the ranges.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "constraints-py311.txt"
sys.path.insert(0, str(ROOT / "scripts"))
import dependency_lock  # noqa: E402


def _setup_requirements() -> dict[str, list[str]]:
    """install_requires and extras_require of setup.py, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    found = {}
    for node in ast.walk(tree):
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id in ("install_requires", "extras_require"):
            found[target.id] = ast.literal_eval(node.value)
    return {"": found["install_requires"], **found["extras_require"]}


def test_every_locked_requirement_of_the_cpu_install_lies_in_setup_pys_ranges():
    pins, python = dependency_lock.read_lock(LOCK)
    assert python == "3.11"
    requirements = _setup_requirements()
    for spec in requirements[""] + requirements["test"]:
        req = Requirement(spec)
        name = dependency_lock.canonical(req.name)
        assert name in pins, f"{req.name} ({spec}) is installed by `make install` but not locked; run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"the lock pins {req.name}=={pins[name]}, outside setup.py's {spec}; run `make lock`"
        )


def test_packages_whose_api_moves_have_upper_bounds():
    requirements = _setup_requirements()
    for name in ("transformers", "ray", "tensordict", "megatron-core", "vllm"):
        specs = [Requirement(s) for reqs in requirements.values() for s in reqs]
        for req in (r for r in specs if dependency_lock.canonical(r.name) == name):
            assert any(s.operator in ("<", "<=") for s in req.specifier), f"{req} has no upper bound"


def test_mlflow_is_an_extra_not_a_requirement():
    requirements = _setup_requirements()
    assert not any(Requirement(s).name == "mlflow" for s in requirements[""])
    assert any(Requirement(s).name == "mlflow" for s in requirements["mlflow"])
    assert any(Requirement(s).name == "mlflow" for s in requirements["test"])  # its tests still run


def test_the_makefile_installs_the_locked_torch_first():
    pins, _ = dependency_lock.read_lock(LOCK)
    torch_spec = subprocess.run(
        ["make", "-s", "--eval", "print-torch-spec: ; @echo $(TORCH_SPEC)", "print-torch-spec"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert torch_spec == f"torch=={pins['torch']}"


def test_freeze_writes_a_lock_that_reads_back(tmp_path):
    text = dependency_lock.freeze()
    path = tmp_path / "lock.txt"
    path.write_text(text)
    pins, python = dependency_lock.read_lock(path)
    assert python == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert "verl" not in pins and "pip" not in pins
    assert pins["torch"] == dependency_lock.public_version(__import__("torch").__version__)
    assert "+" not in pins["torch"]
    assert list(pins) == sorted(pins)


def test_constraints_leave_out_torch_or_what_is_installed(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text(
        dependency_lock.format_lock({"torch": "2.13.0", "pytest": "1.0", "zz-not-installed": "3.0"}, "3.11")
    )
    assert dependency_lock.constraints(str(lock), ["Torch"], False) == "pytest==1.0\nzz-not-installed==3.0\n"
    assert dependency_lock.constraints(str(lock), [], True) == "zz-not-installed==3.0\n"


def test_a_malformed_or_duplicate_line_is_named(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("torch>=2\n")
    with pytest.raises(ValueError, match="lock.txt:1: 'torch>=2' is not a `name==version` line"):
        dependency_lock.read_lock(lock)
    lock.write_text("PyYAML==6.0\npyyaml==6.0\n")
    with pytest.raises(ValueError, match="pyyaml is pinned twice"):
        dependency_lock.read_lock(lock)


def test_another_python_is_refused_with_what_to_do(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text(dependency_lock.format_lock({"torch": "2.13.0"}, "2.7"))
    problem = dependency_lock.check_python(str(lock))
    assert "tested on Python 2.7" in problem and "PYTHON=python2.7" in problem and "LOCK=" in problem
    lock.write_text(dependency_lock.format_lock({"torch": "2.13.0"}, f"{sys.version_info[0]}.{sys.version_info[1]}"))
    assert dependency_lock.check_python(str(lock)) is None
