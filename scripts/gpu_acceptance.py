"""GPU acceptance in one call: every GPU path of the project checked, with figures, in one go.

    bash scripts/gpu_acceptance.sh OUT_DIR [--bundle DIR] [--budget-s 480] [--only a,b] [--cpu-dry-run]

(the shell wrapper sets the offline environment and calls this file). Steps, in order:

  environment      versions, the device, `pip freeze` of the machine before anything is installed
  install          the offline bundle (`scripts/offline_bundle.py`), when `--bundle` is given
  grpo             `python -m verl.trainer.main_ppo` GRPO on the bundled model, one GPU, fixed steps
  rollout_roofline benchmarks/rollout_gpu_roofline.py (0.5B shape, batch 256, 128 + 256 tokens)
  actor_mfu        benchmarks/actor_update_mfu.py (0.5B shape, 4 x 4096 tokens, bf16)
  actor_mfu_fused  the same with --fused (use_fused_kernels=true)
  weight_sync      benchmarks/weight_sync.py (0.5B shape, FSDP -> engine)
  gpu_tests        `pytest -m gpu` over the test files that hold GPU tests (per-test timeout); last,
                   as the longest step

Each step runs as a subprocess in its own process group with a timeout; a failed or timed-out
step is recorded and the next one runs. The whole run keeps to `--budget-s` (default 480 s): a
step gets at most what is left, and a step that cannot start is reported as skipped. Everything
lands in OUT_DIR as at most six files (a device machine returns few): `results.json` (each step's
status, seconds, figures, goals), `summary.md` (the same as a table), `logs.txt` (every step's
output), `target_freeze.txt`, and the GRPO run's `metrics.jsonl` and `training_curves.png`.

`--cpu-dry-run` runs the same steps with tiny sizes on CPU: GPU-only checks are reported as
skipped, everything else must pass. The test suite runs it (tests/scripts/), so the script cannot
rot between the rare GPU runs.

Goals (reported beside the figures, not pass/fail: a step passes when it runs and measures):
decode >= 30% of the memory-bandwidth roofline, actor update MFU >= 45%, weight sync <= 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)", re.M)
BENCH_LINE = re.compile(r"^bench (?P<name>[\w.-]+): (?P<fields>.*)$", re.M)


@dataclass
class StepResult:
    name: str
    status: str = "skipped"  # passed | failed | timeout | skipped
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    goals: dict = field(default_factory=dict)
    note: str = ""


@dataclass
class Context:
    out: Path
    scratch: Path
    dry_run: bool
    bundle: Path | None
    deadline: float
    python: str = sys.executable
    log: list[str] = field(default_factory=list)


def kill_processes_mentioning(path: Path) -> int:
    """Kill the processes whose command line names `path` (the Ray cluster a step started under
    its RAY_TMPDIR, a step's leftovers). Never `ray stop`, which ends every Ray cluster on the
    machine, a test session's own included. Returns how many were killed."""
    import psutil

    killed, me = 0, os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.info["pid"] != me and any(str(path) in part for part in proc.info["cmdline"] or []):
                proc.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


def run(ctx: Context, name: str, cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | None, str]:
    """Run `cmd` in its own process group; returns (exit code or None on timeout, output)."""
    remaining = ctx.deadline - time.monotonic()
    timeout_s = min(timeout_s, remaining)
    header = f"===== {name}: {' '.join(cmd)} (timeout {timeout_s:.0f} s)"
    print(header, flush=True)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ray clusters the step starts live under the scratch folder, apart from any other on the machine
        env={**os.environ, "RAY_TMPDIR": str(ctx.scratch), **(env or {})},
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=max(timeout_s, 1))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
        kill_processes_mentioning(ctx.scratch)
    ctx.log += [header, output or "", f"===== {name}: exit {code if code is not None else 'TIMEOUT'}", ""]
    print(_tail(output, 40), flush=True)
    return code, output or ""


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def bench_figures(output: str) -> dict:
    """The `key=value` fields of the last `bench NAME: ...` line, numbers as floats."""
    matches = list(BENCH_LINE.finditer(output))
    if not matches:
        return {}
    figures = {}
    for item in matches[-1].group("fields").split():
        key, _, value = item.partition("=")
        try:
            figures[key] = float(value)
        except ValueError:
            figures[key] = value
    return figures


# ----------------------------------------------------------------------------------- the steps


def step_environment(ctx: Context, res: StepResult) -> None:
    code = (
        "import json, platform, sys, torch\n"
        "info = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "        'cuda_available': torch.cuda.is_available(), 'platform': platform.platform()}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,\n"
        "                nccl='.'.join(map(str, torch.cuda.nccl.version())), capability=list(torch.cuda.get_device_capability()))\n"
        "for mod in ('transformers', 'ray', 'hydra', 'omegaconf', 'tensordict', 'megatron.core', 'flash_attn'):\n"
        "    try:\n"
        "        m = __import__(mod, fromlist=['_'])\n"
        "        info[mod] = getattr(m, '__version__', 'present')\n"
        "    except Exception as e:\n"
        "        info[mod] = f'absent ({type(e).__name__})'\n"
        "print('ENV ' + json.dumps(info))\n"
    )
    freeze, output = run(ctx, "pip freeze", [ctx.python, "-m", "pip", "freeze"], 60)
    if freeze == 0:
        (ctx.out / "target_freeze.txt").write_text(output)
    code_rc, output = run(ctx, "environment", [ctx.python, "-c", code], 120)
    match = re.search(r"^ENV (.*)$", output, re.M)
    res.figures = json.loads(match.group(1)) if match else {}
    if ctx.bundle is None and not ctx.dry_run:
        missing = [
            m for m in ("ray", "hydra", "omegaconf", "tensordict") if str(res.figures.get(m, "")).startswith("absent")
        ]
        if missing:
            res.note = f"not installed yet: {', '.join(missing)} (pass --bundle)"
    res.status = "passed" if code_rc == 0 and match else "failed"


def step_install(ctx: Context, res: StepResult) -> None:
    if ctx.bundle is None:
        res.note = "no --bundle given: using the packages already installed"
        return
    code, output = run(ctx, "install", ["bash", str(ctx.bundle / "install.sh")], 240)
    res.status = "passed" if code == 0 else ("timeout" if code is None else "failed")
    if code != 0:
        # The bundle's closure did not fit the machine (a version the --have file did not know):
        # install the wheels without pip's dependency check so the other steps still run, and
        # report the mismatch; refresh scripts/gpu_image_freeze.txt from target_freeze.txt.
        res.note = "pip refused the bundle: " + _tail(output, 4)
        retry, _ = run(ctx, "install --no-deps", ["bash", str(ctx.bundle / "install.sh"), "--no-deps"], 240)
        res.note += f"; retried with --no-deps: exit {retry}"


def gpu_test_files() -> list[str]:
    files = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if GPU_MARK.search(path.read_text()):
            files.append(str(path.relative_to(REPO)))
    return files


def step_gpu_tests(ctx: Context, res: StepResult) -> None:
    junit = ctx.scratch / "gpu_tests.xml"
    files = gpu_test_files()
    cmd = [ctx.python, "-m", "pytest", "-m", "gpu", "-v", "-rfEs", "--timeout", "120", f"--junitxml={junit}", *files]
    code, output = run(ctx, "gpu_tests", cmd, 300)
    counts, failures = parse_junit(junit) if code is not None else parse_verbose(output)
    res.figures = {**counts, "files": len(files)}
    if failures:
        res.figures["failed_tests"] = failures
    if code is None:
        res.status = "timeout"
    elif ctx.dry_run:
        # on CPU every GPU test must skip cleanly (no collection error, none run by mistake)
        ok = counts.get("errors", 0) == 0 and counts.get("failures", 0) == 0 and counts.get("tests", 0) > 0
        res.status = "passed" if ok and counts.get("skipped") == counts.get("tests") else "failed"
        res.note = f"{counts.get('skipped', 0)} GPU tests skipped (no GPU)"
    else:
        ok = code == 0 and counts.get("tests", 0) > 0 and counts.get("failures", 0) + counts.get("errors", 0) == 0
        res.status = "passed" if ok else "failed"
        if not counts:
            res.note = _tail(output, 5)


VERBOSE_RESULT = re.compile(r"^(?P<test>\S+::\S+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def parse_verbose(output: str) -> tuple[dict, list[dict]]:
    """Counts from `pytest -v` lines, for a run killed before it wrote its junit report."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failures = []
    for match in VERBOSE_RESULT.finditer(output):
        outcome = match.group("outcome")
        counts["tests"] += 1
        key = {"FAILED": "failures", "ERROR": "errors", "SKIPPED": "skipped", "XFAIL": "skipped"}.get(outcome)
        if key:
            counts[key] += 1
        if outcome in ("FAILED", "ERROR"):
            failures.append(
                {"test": match.group("test"), "kind": outcome.lower(), "message": "(run killed: see logs.txt)"}
            )
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts, failures


def parse_junit(path: Path) -> tuple[dict, list[dict]]:
    if not path.exists():
        return {}, []
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failures = []
    for case in suite.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or node.text or "").strip()
                failures.append(
                    {"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind, "message": message[:400]}
                )
    return counts, failures


def step_grpo(ctx: Context, res: StepResult) -> None:
    steps = 2 if ctx.dry_run else 30
    run_dir = ctx.scratch / "grpo"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        f"trainer.device={'cpu' if ctx.dry_run else 'cuda'}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={1 if ctx.dry_run else 10}",
        "trainer.logger=[console,file]",
        f"trainer.run_dir={run_dir}",
        f"trainer.default_local_dir={ctx.scratch / 'grpo_ckpt'}",
        "trainer.save_freq=-1",
    ]
    code, output = run(
        ctx, "grpo", [ctx.python, "-m", "verl.trainer.main_ppo", "--config-name=arith_demo", *overrides], 180
    )
    metrics_path = run_dir / "metrics.jsonl"
    records = []
    if metrics_path.exists():
        shutil.copy2(metrics_path, ctx.out / "metrics.jsonl")
        records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if (run_dir / "training_curves.png").exists():
        shutil.copy2(run_dir / "training_curves.png", ctx.out / "training_curves.png")
    res.figures = grpo_figures(records)
    done = res.figures.get("steps", 0)
    res.status = "timeout" if code is None else ("passed" if code == 0 and done >= steps else "failed")
    if res.status != "passed":
        res.note = f"{done} of {steps} steps logged; " + _tail(output, 3)


def grpo_figures(records: list[dict]) -> dict:
    """Steps done, median step time, first/last training score and held-out accuracy from the
    file logger's records (`{"step": N, "data": {metric: value}}`)."""
    rows = [(r.get("step", 0), r.get("data", r)) for r in records]
    steps = [data for _, data in rows if "timing_s/step" in data]
    figures: dict = {"steps": len(steps)}
    if steps:
        times = sorted(d["timing_s/step"] for d in steps[1:] or steps)  # the first step pays the warm-up
        figures["median_step_s"] = round(times[len(times) // 2], 4)
        for key in ("critic/score/mean", "timing_s/gen", "timing_s/update_actor"):
            values = [d[key] for d in steps if key in d]
            if values:
                figures[f"{key} first"], figures[f"{key} last"] = round(values[0], 4), round(values[-1], 4)
    val = [(step, v) for step, data in rows for k, v in data.items() if k.startswith("val-core/")]
    if val:
        figures["val_acc first"] = f"{val[0][1]:.3f}@{val[0][0]}"
        figures["val_acc last"] = f"{val[-1][1]:.3f}@{val[-1][0]}"
    return figures


def bench_step(script: str, gpu_args: list[str], dry_args: list[str], goal: tuple[str, str, float] | None, timeout=150):
    def step(ctx: Context, res: StepResult) -> None:
        path = REPO / "benchmarks" / script
        if not path.exists():
            res.status, res.note = "failed", f"benchmarks/{script} does not exist"
            return
        code, output = run(ctx, res.name, [ctx.python, str(path), *(dry_args if ctx.dry_run else gpu_args)], timeout)
        res.figures = bench_figures(output)
        res.status = "timeout" if code is None else ("passed" if code == 0 and res.figures else "failed")
        if res.status != "passed":
            res.note = _tail(output, 3)
        if goal and res.figures and not ctx.dry_run:
            key, op, target = goal
            value = res.figures.get(key)
            if isinstance(value, float):
                met = value >= target if op == ">=" else value <= target
                res.goals = {key: {"target": f"{op} {target}", "value": value, "met": met}}

    return step


STEPS = {
    "environment": step_environment,
    "install": step_install,
    "grpo": step_grpo,
    "rollout_roofline": bench_step(
        "rollout_gpu_roofline.py",
        [],
        ["--cpu", "--preset", "tiny", "--batch", "4", "--prompt-len", "8", "--new-tokens", "8", "--repeats", "1"],
        ("pct_roofline", ">=", 30.0),
    ),
    "actor_mfu": bench_step(
        "actor_update_mfu.py",
        [],
        ["--preset", "tiny", "--seq-len", "64", "--repeats", "1"],
        ("mfu_pct", ">=", 45.0),
    ),
    # the same update with use_fused_kernels=true (log-probs from the hidden states, no whole logits)
    "actor_mfu_fused": bench_step(
        "actor_update_mfu.py",
        ["--fused"],
        ["--preset", "tiny", "--seq-len", "64", "--repeats", "1", "--fused"],
        ("mfu_pct", ">=", 45.0),
    ),
    "weight_sync": bench_step("weight_sync.py", [], ["--preset", "tiny", "--repeats", "2"], ("seconds", "<=", 0.5)),
    # last: the longest step; a run that ends in it has its figures already
    "gpu_tests": step_gpu_tests,
}
# Steps that check a GPU path only; on CPU (dry run) they run with tiny sizes but their figures
# say nothing about the GPU.
RUNS_WITHOUT_BUNDLE = {"environment", "install"}


def write_reports(ctx: Context, results: list[StepResult], started: str) -> dict:
    env = next((r.figures for r in results if r.name == "environment"), {})
    report = {
        "started": started,
        "mode": "cpu-dry-run" if ctx.dry_run else "gpu",
        "machine": {k: env.get(k) for k in ("gpu", "gpu_memory_gib", "python", "torch", "cuda", "nccl") if k in env},
        "passed": all(r.status in ("passed", "skipped") for r in results)
        and any(r.status == "passed" for r in results),
        "steps": [asdict(r) for r in results],
    }
    (ctx.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# GPU acceptance ({report['mode']}), {started}",
        "",
        "machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()),
        "",
        "| step | status | seconds | figures | goals | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        figures = ", ".join(f"{k}={v}" for k, v in r.figures.items() if k != "failed_tests")
        goals = ", ".join(
            f"{k} {g['value']} ({g['target']}: {'met' if g['met'] else 'NOT met'})" for k, g in r.goals.items()
        )
        note = r.note.replace("\n", " ").replace("|", "/")[:300]
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {figures} | {goals} | {note} |")
    failures = [f for r in results for f in r.figures.get("failed_tests", [])]
    if failures:
        lines += ["", "## Failed tests", ""]
        lines += [f"- `{f['test']}` ({f['kind']}): {f['message'][:300]}".replace("\n", " ") for f in failures]
    lines += ["", f"overall: {'PASSED' if report['passed'] else 'FAILED'}", ""]
    (ctx.out / "summary.md").write_text("\n".join(lines))
    (ctx.out / "logs.txt").write_text("\n".join(ctx.log))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--bundle", type=Path, help="offline bundle to install first (scripts/offline_bundle.py)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same steps, tiny sizes, on CPU")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for all steps")
    parser.add_argument("--only", help=f"comma-separated subset of: {','.join(STEPS)}")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(
        out=args.out,
        scratch=Path(tempfile.mkdtemp(prefix="va-", dir="/tmp")),  # short: Ray's socket paths live under it
        dry_run=args.cpu_dry_run,
        bundle=args.bundle.resolve() if args.bundle else None,
        deadline=time.monotonic() + args.budget_s,
    )
    chosen = args.only.split(",") if args.only else list(STEPS)
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown step; choose from {','.join(STEPS)}")
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    results = []
    for name in STEPS:
        res = StepResult(name)
        results.append(res)
        if name not in chosen:
            res.note = "not selected (--only)"
            continue
        if ctx.deadline - time.monotonic() < 10:
            res.note = "out of the run's time budget"
            continue
        start = time.monotonic()
        try:
            STEPS[name](ctx, res)
        except Exception as err:  # a broken step must not stop the others
            res.status, res.note = "failed", f"{type(err).__name__}: {err}"
        res.seconds = round(time.monotonic() - start, 1)
        write_reports(ctx, results, started)  # after each step: a killed run still leaves its results
    kill_processes_mentioning(ctx.scratch)  # Ray processes a timed-out step left behind
    report = write_reports(ctx, results, started)
    print((ctx.out / "summary.md").read_text())
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
