"""Build an offline install bundle of verl for an air-gapped machine.

    python scripts/offline_bundle.py --python 3.12 --platform manylinux2014_x86_64 \
        --have target-freeze.txt --out DIR [--extra mcore] [--no-verl]

then, on the target (no package index needed):

    bash DIR/install.sh            # or: PYTHON=/path/to/python3 bash DIR/install.sh

What goes in, and why:
- Our runtime dependencies that the target lacks, as wheels for the target's Python and platform,
  with their own dependencies, resolved here against `--have` (a `pip freeze` of the target; a bare
  name without `==version` counts as present in any version). A package the target has in a
  version that a requirement excludes is bundled in a version that fits, except for the packages
  that must come with the target's accelerator stack (torch, triton, the nvidia-* libraries):
  a mismatch there is an error, not a silent upgrade.
- Versions: the tested lock (`requirements/constraints-py311.txt`, see docs/dependencies.md) where
  it pins the package and the pin satisfies every requirement seen, else the newest release that
  does. This is a walk over the requirement graph, not a backtracking resolver: a conflict it
  cannot settle with the first choice is reported, with the two requirements, and stops the build.
- A slimmed Ray wheel: the Java workers' jar, the dashboard's JavaScript source maps and Ray's
  libraries that the core API never imports (rllib, tune, train, serve, data, llm, air) are
  removed from the wheel, its RECORD rewritten, so it still installs with pip; 79 MB -> ~40 MB.
  `--full-ray` keeps the wheel whole. `ray[default]` (dashboard, job server: what `ray job submit`
  needs) is left out unless `--extra ray-default`: a training run on one machine never loads it.
- Our own wheel (pure Python), installed with `--no-deps` so that its `ray[default]` requirement
  does not ask for the dashboard's packages when they were left out. `--no-verl` leaves it out,
  for a run from a source checkout (`scripts/gpu_acceptance.sh` does that).
- Optional dependencies that a run imports only when configured (mlflow, wandb, vllm,
  megatron-core) are left out unless named with `--extra` (our setup.py's extras: mcore, mlflow,
  trackers, vllm, ...); so is `datasets`, a base requirement that only data preprocessing and
  custom dataset classes import, unless `--with datasets`.

`install.sh` runs one `pip install --no-index --find-links DIR` over the third-party wheels (pip
then checks the whole closure against what the target has) and then installs our wheel.
`manifest.json` lists every wheel with its size and the requirement that brought it in.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCK = REPO / "requirements" / "constraints-py311.txt"
# Packages that come with the target's accelerator stack: replacing them from a bundle would swap
# the CUDA build the machine was set up with.
NEVER_BUNDLE = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|pytorch-triton.*)$")
# Parts of Ray's wheel that `import ray`, `ray.init()`, actors, placement groups and `ray start`
# never load.
RUN_OPTIONAL = {
    "datasets": "imported only by data preprocessing and by dataset classes that build Hugging Face datasets "
    "(verl-recipe's); `--with datasets` bundles it",
}
"""Our own requirements that a training run imports only when configured to, left out unless `--with NAME`."""

RAY_DROP = re.compile(r"^ray/(jars/|(rllib|tune|train|serve|data|llm|air)/)|\.js\.map$")


class BundleError(RuntimeError):
    pass


class Conflict(Exception):
    """A package was chosen before a later requirement narrowed its versions: resolve again with the
    narrower range from the start."""

    def __init__(self, name: str, specifier: SpecifierSet, message: str):
        super().__init__(message)
        self.name, self.specifier, self.message = name, specifier, message


@dataclass
class Chosen:
    name: str
    version: Version
    wheel: Path
    requested_by: list[str] = field(default_factory=list)
    requirements: list[Requirement] = field(default_factory=list)


def parse_have(path: Path | None) -> dict[str, Version | None]:
    """`pip freeze` lines -> {canonical name: version or None}. `name @ url` and bare names count as
    present in an unknown version."""
    have: dict[str, Version | None] = {}
    if path is None:
        return have
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;]+))?", line)
        if not match:
            raise BundleError(f"{path}: cannot read the line {raw!r}; expected `name==version` as `pip freeze` writes")
        name, version = match.groups()
        have[canonicalize_name(name)] = Version(version) if version else None
    return have


def parse_lock(path: Path | None) -> dict[str, Version]:
    if path is None or not path.exists():
        return {}
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line.strip())
        if match:
            pins[canonicalize_name(match.group(1))] = Version(match.group(2).split("+")[0])
    return pins


def target_environment(python: str, platforms: list[str]) -> dict[str, str]:
    machine = "aarch64" if any("aarch64" in p for p in platforms) else "x86_64"
    full = python if python.count(".") >= 2 else f"{python}.0"
    return {
        "python_version": ".".join(python.split(".")[:2]),
        "python_full_version": full,
        "implementation_name": "cpython",
        "implementation_version": full,
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": machine,
        "platform_release": "",
        "platform_version": "",
    }


def expand_platforms(platforms: list[str], glibc: str) -> list[str]:
    """pip matches `--platform` tags exactly: a target that runs manylinux2014 (glibc 2.17) wheels
    also runs manylinux_2_17..manylinux_2_<glibc> ones, so all of those are offered."""
    out: list[str] = []
    major, minor = (int(x) for x in glibc.split("."))
    for platform in platforms:
        match = re.match(r"^manylinux(?:2014|_2_(\d+)|1|2010)_(x86_64|aarch64)$", platform)
        out.append(platform)
        if not match:
            continue
        arch = match.group(2)
        for m in range(5, minor + 1):
            out.append(f"manylinux_{major}_{m}_{arch}")
        out += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]
    return list(dict.fromkeys(out))


def wheel_metadata(wheel: Path) -> tuple[str, Version, list[Requirement]]:
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        meta = Parser().parsestr(zf.read(meta_name).decode())
    requirements = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    return canonicalize_name(meta["Name"]), Version(meta["Version"]), requirements


class Resolver:
    """Walks the requirement graph from our wheel's requirements and downloads each missing package
    once, for the target's Python and platform."""

    def __init__(self, args, cache: Path, have: dict[str, Version | None], lock: dict[str, Version], narrowed=None):
        self.args, self.cache, self.have, self.lock = args, cache, have, lock
        self.narrowed: dict[str, SpecifierSet] = narrowed or {}  # learnt from earlier conflicts
        self.environment = target_environment(args.python, args.platform)
        self.platforms = expand_platforms(args.platform, args.glibc)
        self.chosen: dict[str, Chosen] = {}
        self.skipped: dict[str, str] = {}
        self.expanded: set[tuple[str, frozenset[str]]] = set()  # (package, extras) whose needs are queued

    def applies(self, req: Requirement, extras: set[str]) -> bool:
        if req.marker is None:
            return True
        return any(req.marker.evaluate({**self.environment, "extra": extra}) for extra in (extras or {""}))

    def resolve(self, roots: list[tuple[Requirement, str]]) -> None:
        queue = list(roots)
        while queue:
            req, parent = queue.pop(0)
            name = canonicalize_name(req.name)
            if name in self.chosen:
                chosen = self.chosen[name]
                if not req.specifier.contains(chosen.version, prereleases=True):
                    raise Conflict(
                        name,
                        req.specifier & self.narrowed.get(name, SpecifierSet()),
                        f"{parent} needs {req}, but {name}=={chosen.version} was chosen for "
                        f"{', '.join(chosen.requested_by)}",
                    )
                chosen.requested_by.append(f"{parent} ({req})")
                queue += self.needs(chosen, req)
                continue
            if name in self.have:
                version = self.have[name]
                if version is None or req.specifier.contains(version, prereleases=True):
                    self.skipped.setdefault(name, f"present on the target ({version or 'any version'})")
                    continue
                if NEVER_BUNDLE.match(name):
                    raise BundleError(
                        f"{parent} needs {req}, but the target has {name}=={version}, which comes with its "
                        "accelerator stack and is never bundled; choose versions that fit the target's"
                    )
            elif NEVER_BUNDLE.match(name):
                raise BundleError(
                    f"{parent} needs {req}, which the target lacks; {name} comes with the accelerator stack "
                    "(install it there from the vendor's wheels), it is never bundled"
                )
            wheel = self.download(name, req.specifier & self.narrowed.get(name, SpecifierSet()))
            wheel_name, version, requirements = wheel_metadata(wheel)
            chosen = Chosen(wheel_name, version, wheel, [f"{parent} ({req})"], requirements)
            self.chosen[name] = chosen
            queue += self.needs(chosen, req)

    def needs(self, chosen: Chosen, req: Requirement) -> list[tuple[Requirement, str]]:
        """What `chosen` asks for with the extras `req` names, once per (package, extras)."""
        key = (chosen.name, frozenset(req.extras))
        if key in self.expanded:
            return []
        self.expanded.add(key)
        return [(r, chosen.name) for r in chosen.requirements if self.applies(r, set(req.extras))]

    def download(self, name: str, specifier: SpecifierSet) -> Path:
        pin = self.lock.get(name)
        attempts = [f"{name}=={pin}"] if pin is not None and specifier.contains(pin, prereleases=True) else []
        attempts.append(f"{name}{specifier}")
        errors = []
        for spec in attempts:
            before = set(self.cache.glob("*.whl"))
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
            cmd += ["--python-version", self.args.python, "--implementation", "cp", "-d", str(self.cache)]
            cmd += self.args.pip_option
            for platform in self.platforms:
                cmd += ["--platform", platform]
            proc = subprocess.run([*cmd, spec], capture_output=True, text=True)
            if proc.returncode == 0:
                return self.find_wheel(name, before)
            errors.append(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
            # No wheel at all (antlr4-python3-runtime 4.9.3 is an sdist only): build one here, which
            # is only valid for the target when the result is pure Python.
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "wheel",
                    "--no-deps",
                    "-q",
                    "-w",
                    str(self.cache),
                    *self.args.pip_option,
                    spec,
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode == 0:
                wheel = self.find_wheel(name, before)
                tags = parse_wheel_filename(wheel.name)[3]
                if all(tag.platform == "any" and tag.abi == "none" for tag in tags):
                    return wheel
                raise BundleError(
                    f"{name}: no wheel for Python {self.args.python} on {self.args.platform} is published, and "
                    f"the one built here ({wheel.name}) is specific to this machine; build it on the target"
                )
            errors.append(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
        raise BundleError(f"cannot get a wheel of {name}{specifier} for the target: {'; '.join(errors)}")

    def find_wheel(self, name: str, before: set[Path]) -> Path:
        candidates = [p for p in self.cache.glob("*.whl") if canonicalize_name(parse_wheel_filename(p.name)[0]) == name]
        new = [p for p in candidates if p not in before]
        return max(new or candidates, key=lambda p: p.stat().st_mtime)


def resolve(args, cache, have, lock, own_requirements, extras, ray_default) -> Resolver:
    """Walk from our requirements; each conflict narrows one package's range and starts again
    (downloads are cached), so a package chosen early gets a version every requirement accepts."""
    narrowed: dict[str, SpecifierSet] = {}
    for _ in range(20):
        resolver = Resolver(args, cache, have, lock, narrowed)
        roots = []
        for req in own_requirements:
            if not resolver.applies(req, extras) or canonicalize_name(req.name) in args.without:
                continue
            if canonicalize_name(req.name) == "ray" and not ray_default:
                req = Requirement(str(req).replace("ray[default]", "ray"))
            roots.append((req, "verl"))
        try:
            resolver.resolve(roots)
            return resolver
        except Conflict as conflict:
            if narrowed.get(conflict.name) == conflict.specifier:
                raise BundleError(f"{conflict.message}; no release fits both: pin versions in --lock") from None
            narrowed[conflict.name] = conflict.specifier
    raise BundleError(f"the requirements kept conflicting after 20 attempts: {sorted(narrowed)}")


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim_wheel(src: Path, dst: Path, drop: re.Pattern) -> list[str]:
    """Copy a wheel without the members `drop` matches, with a RECORD that lists what is left."""
    dropped = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        kept_lines = []
        for info in zin.infolist():
            if info.filename == record_name:
                continue
            if drop.search(info.filename):
                dropped.append(info.filename)
                continue
            data = zin.read(info)
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr, out.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            zout.writestr(out, data, compresslevel=9)
            kept_lines.append(record_line(info.filename, data))
        kept_lines.append(f"{record_name},,")
        record = ("\n".join(kept_lines) + "\n").encode()
        out = zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0))
        out.external_attr = 0o644 << 16
        zout.writestr(out, record, compresslevel=9)
    return dropped


def build_own_wheel(cache: Path) -> Path:
    out = cache / "own"
    shutil.rmtree(out, ignore_errors=True)
    # without build isolation when this interpreter can build it: no index needed for setuptools
    can_build = importlib.util.find_spec("setuptools") and importlib.util.find_spec("wheel")
    flags = ["--no-build-isolation"] if can_build else []
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *flags, "-w", str(out), str(REPO)],
        capture_output=True,
        text=True,
        cwd=cache,
    )
    if proc.returncode != 0:
        raise BundleError(f"building verl's own wheel failed:\n{proc.stdout}{proc.stderr}")
    (wheel,) = out.glob("verl-*.whl")
    return wheel


INSTALL_SH = """#!/usr/bin/env bash
# Installs this offline bundle with no package index: `bash install.sh` (PYTHON=... picks the
# interpreter; extra arguments go to pip, e.g. --target DIR). Written by scripts/offline_bundle.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
PIP=("$PY" -m pip install --no-index --find-links "$HERE" --no-cache-dir --disable-pip-version-check -q)
if [ -s "$HERE/requirements.txt" ]; then
  "${PIP[@]}" -r "$HERE/requirements.txt" "$@"
fi
OWN=$(ls "$HERE"/verl-*.whl 2>/dev/null || true)
if [ -n "$OWN" ]; then
  "${PIP[@]}" __OWN_FLAGS__ "$OWN" "$@"
fi
echo "offline bundle installed into $("$PY" -c 'import sys; print(sys.prefix)')"
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    parser.add_argument("--platform", action="append", help="target wheel platform tag (repeatable)")
    parser.add_argument("--glibc", default="2.28", help="newest manylinux glibc the target runs (default 2.28)")
    parser.add_argument("--have", type=Path, help="`pip freeze` of the target: what it already has")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--extra", action="append", default=[], help="one of our extras to include (repeatable)")
    parser.add_argument(
        "--without", action="append", default=[], help="leave out one of our own requirements (repeatable)"
    )
    parser.add_argument(
        "--with",
        dest="with_",
        action="append",
        default=[],
        help=f"bundle one of the requirements left out by default ({', '.join(sorted(RUN_OPTIONAL))})",
    )
    parser.add_argument("--lock", type=Path, default=DEFAULT_LOCK, help="preferred exact versions")
    parser.add_argument("--no-verl", action="store_true", help="leave our own wheel out (run from a checkout)")
    parser.add_argument("--full-ray", action="store_true", help="keep Ray's wheel whole")
    parser.add_argument("--cache", type=Path, help="download cache (default: a temporary folder)")
    parser.add_argument(
        "--pip-option", action="append", default=[], help="passed to pip download, e.g. --pip-option=--index-url=URL"
    )
    parser.add_argument("--max-mb", type=float, default=None, help="fail when the bundle is larger")
    args = parser.parse_args(argv)
    args.platform = args.platform or ["manylinux2014_x86_64"]
    wanted = {canonicalize_name(n) for n in args.with_}
    if wanted - set(RUN_OPTIONAL):
        parser.error(
            f"--with {sorted(wanted - set(RUN_OPTIONAL))}: only {sorted(RUN_OPTIONAL)} are left out by default"
        )
    args.without = {canonicalize_name(n) for n in args.without} | (set(RUN_OPTIONAL) - wanted)

    cache = args.cache or Path(tempfile.mkdtemp(prefix="verl-bundle-"))
    cache.mkdir(parents=True, exist_ok=True)
    have = parse_have(args.have)
    lock = parse_lock(args.lock)
    extras = set(args.extra)
    ray_default = "ray-default" in extras
    extras.discard("ray-default")

    own = build_own_wheel(cache)
    _, own_version, own_requirements = wheel_metadata(own)
    known_extras = {str(e) for r in own_requirements if r.marker for e in _marker_extras(r.marker)}
    unknown = extras - known_extras
    if unknown:
        raise BundleError(f"--extra {sorted(unknown)}: not an extra of verl; choose from {sorted(known_extras)}")

    resolver = resolve(args, cache, have, lock, own_requirements, extras, ray_default)

    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    manifest = {"python": args.python, "platforms": resolver.platforms, "extras": sorted(args.extra), "wheels": []}
    for name, chosen in sorted(resolver.chosen.items()):
        dst = args.out / chosen.wheel.name
        entry = {"name": name, "version": str(chosen.version), "requested_by": chosen.requested_by}
        if name == "ray" and not args.full_ray:
            dropped = slim_wheel(chosen.wheel, dst, RAY_DROP)
            entry["slimmed"] = {
                "removed_files": len(dropped),
                "original_mb": round(chosen.wheel.stat().st_size / 1e6, 1),
            }
        else:
            shutil.copy2(chosen.wheel, dst)
        entry["file"], entry["mb"] = dst.name, round(dst.stat().st_size / 1e6, 2)
        manifest["wheels"].append(entry)
    (args.out / "requirements.txt").write_text("".join(f"{w['name']}=={w['version']}\n" for w in manifest["wheels"]))
    if not args.no_verl:
        shutil.copy2(own, args.out / own.name)
        manifest["wheels"].append(
            {"name": "verl", "version": str(own_version), "file": own.name, "mb": round(own.stat().st_size / 1e6, 2)}
        )
    manifest["present_on_target"] = dict(sorted(resolver.skipped.items()))
    manifest["left_out"] = {name: RUN_OPTIONAL.get(name, "--without") for name in sorted(args.without)}
    script = INSTALL_SH.replace("__OWN_FLAGS__", "" if ray_default else "--no-deps")
    (args.out / "install.sh").write_text(script)
    os.chmod(args.out / "install.sh", 0o755)
    total = sum(p.stat().st_size for p in args.out.iterdir())
    manifest["total_mb"] = round(total / 1e6, 2)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    for w in manifest["wheels"]:
        print(f"{w['mb']:8.2f} MB  {w['file']}")
    print(f"bundle: {len(manifest['wheels'])} wheels, {total / 1e6:.1f} MB in {args.out}")
    if args.max_mb is not None and total / 1e6 > args.max_mb:
        print(f"error: the bundle is {total / 1e6:.1f} MB, over --max-mb {args.max_mb}", file=sys.stderr)
        return 1
    return 0


def _marker_extras(marker: Marker):
    """The extra names a marker mentions (`extra == "mcore"`)."""
    return re.findall(r'extra\s*==\s*"([^"]+)"', str(marker))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BundleError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
