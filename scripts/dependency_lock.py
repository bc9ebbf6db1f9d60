"""The dependency lock: write it from an environment, turn it into pip constraints, compare with it.

    python scripts/dependency_lock.py freeze > requirements/constraints-py311.txt
    python scripts/dependency_lock.py constraints LOCK [--without torch] [--without-installed]
    python scripts/dependency_lock.py check-python LOCK
    python scripts/dependency_lock.py diff LOCK

`freeze` lists every distribution of the running interpreter's environment as `name==version`
(sorted, this package and pip left out, local version labels such as `+cpu` dropped so one lock
serves the CPU and CUDA builds of a version) under a header naming the Python version. `make lock`
runs it in the virtualenv that `make test-latest` just resolved and tested; see
docs/dependencies.md for the policy.

`constraints` prints the lock as a pip constraints file (`pip install -c`), less the named
packages (`--without torch`: torch is installed first, from the build the machine needs) or less
every package already installed (`--without-installed`: the CUDA image, where vLLM has pinned its
own set first, and the lock then fixes only what verl adds). `check-python` fails, saying what to
do, when the interpreter is not the Python version the lock was resolved on. `diff` prints the
packages whose installed version differs from the lock (what `make test-latest` is testing anew).

Standard library only: it runs in a bare virtualenv or image before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

SKIPPED = {"verl", "pip"}  # this package itself (editable), and the installer


def canonical(name: str) -> str:
    """PEP 503 normalised name: `Foo_Bar.baz` -> `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public_version(version: str) -> str:
    """The version without its local label: `2.13.0+cpu` -> `2.13.0`."""
    return version.split("+", 1)[0]


def installed() -> dict[str, str]:
    """canonical name -> version of every distribution this interpreter sees (first one wins, as imports do)."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def read_lock(path: str | Path) -> tuple[dict[str, str], str | None]:
    """(canonical name -> version, python "3.11" from the header or None) of a lock file."""
    pins: dict[str, str] = {}
    python = None
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if line.startswith("# python:"):
            python = line.split(":", 1)[1].strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
        if match is None:
            raise ValueError(f"{path}:{number}: {raw!r} is not a `name==version` line")
        name = canonical(match.group(1))
        if name in pins:
            raise ValueError(f"{path}:{number}: {match.group(1)} is pinned twice")
        pins[name] = match.group(2)
    return pins, python


def format_lock(pins: dict[str, str], python: str) -> str:
    header = [
        f"# The exact versions the test suite passed with on Python {python} (CPU; torch from its CPU wheel):",
        '# every package that `pip install torch && pip install -e ".[test]"` resolved, this package left out.',
        "# Written by `make lock` (scripts/dependency_lock.py freeze); do not edit by hand. Policy and how to",
        "# bump: docs/dependencies.md. Installed through `pip install -c` by make install/test, CI and docker/.",
        f"# python: {python}",
    ]
    return "\n".join(header + [f"{name}=={pins[name]}" for name in sorted(pins)]) + "\n"


def freeze() -> str:
    pins = {name: public_version(v) for name, v in installed().items() if name not in SKIPPED}
    return format_lock(pins, f"{sys.version_info.major}.{sys.version_info.minor}")


def constraints(lock: str, without: list[str], without_installed: bool) -> str:
    pins, _ = read_lock(lock)
    dropped = {canonical(n) for n in without}
    if without_installed:
        dropped |= set(installed())
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()) if name not in dropped)


def check_python(lock: str) -> str | None:
    """None when this interpreter matches the lock's Python, else what to do."""
    _, python = read_lock(lock)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python is None or python == here:
        return None
    return (
        f"{lock} holds the versions tested on Python {python}, but this virtualenv runs Python {here}, where "
        f"some of them may not install or behave the same. Make the virtualenv with Python {python} "
        f"(`make clean && make install PYTHON=python{python}`), or install the untested newest versions that "
        "setup.py allows with `make install LOCK=`"
    )


def diff(lock: str) -> list[str]:
    """`name: locked -> installed` for each package whose installed version differs from the lock."""
    pins, _ = read_lock(lock)
    now = {name: public_version(v) for name, v in installed().items() if name not in SKIPPED}
    lines = []
    for name in sorted(set(pins) | set(now)):
        before, after = pins.get(name, "-"), now.get(name, "-")
        if before != after:
            lines.append(f"{name}: {before} -> {after}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("freeze", help="print this environment as a lock file")
    c = sub.add_parser("constraints", help="print the lock as pip constraints")
    c.add_argument("lock")
    c.add_argument("--without", action="append", default=[], metavar="NAME", help="leave this package out")
    c.add_argument("--without-installed", action="store_true", help="leave every installed package out")
    for name in ("check-python", "diff"):
        sub.add_parser(name).add_argument("lock")
    args = parser.parse_args(argv)

    if args.command == "freeze":
        sys.stdout.write(freeze())
    elif args.command == "constraints":
        sys.stdout.write(constraints(args.lock, args.without, args.without_installed))
    elif args.command == "check-python":
        problem = check_python(args.lock)
        if problem:
            print(problem, file=sys.stderr)
            return 1
    else:
        changes = diff(args.lock)
        print(f"{len(changes)} package(s) differ from {args.lock}" + (":" if changes else ""))
        for line in changes:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
