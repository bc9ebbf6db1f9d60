"""Code-contest scoring of the PRIME project (APPS / CodeContests / TACO style test cases), run locally.

`compute_score(completion, test_cases, continuous=False) -> (score, metadata)`, as upstream's
`prime_code.compute_score`; `default_compute_score` uses it for the `codecontests`, `apps`,
`codeforces` and `taco` data sources when no SandboxFusion URL is configured.

- The program is the content of the completion's last ```` ```python ```` block (the whole
  completion when it has none).
- `test_cases` (a dict or its JSON text) holds `inputs` and `outputs`, one entry per case, and
  optionally `fn_name`. Without `fn_name` the program reads the case's input on stdin and its
  stdout is compared with the expected output: line by line with surrounding whitespace ignored,
  else token by token where two numbers are equal within 1e-5 (relative or absolute). With
  `fn_name` the function (or method of a class `Solution`) is called with the case's arguments (a
  list, or JSON lines) and its return value compared with the expected one (also with the
  expected value unwrapped from a one-element list, and tuples read as lists).
- Every case runs in its own throw-away interpreter through `verl.utils.reward_score.sandbox`
  (isolated, resource-limited, killed at the deadline): never in the scoring process, unlike
  upstream, which `exec`s the code in a forked copy of it.
- `continuous=False`: (True, metadata) when every case passes, else (False, metadata), stopping at
  the first failure. `continuous=True`: the fraction of the first 10 cases that pass.

`metadata` is one dict per case run: `case_index`, `status` (passed / wrong_answer / runtime_error
/ timeout), and on failure the input, expected and actual output (truncated).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["apps_check_correctness", "compute_score", "run_test_case"]

_CASE_TIMEOUT_S = 10.0
_CONTINUOUS_CASES = 10
_PREVIEW_CHARS = 200

# What the call-based harness appends to the program: read the arguments as JSON from stdin, call
# the function, print the result as JSON on a line of its own after a marker (the program may print too).
_MARKER = "@@verl_prime_code_result@@"
_HARNESS = """

def _verl_main():
    import json as _json
    import sys as _sys
    _raw = _sys.stdin.read()
    _args = _json.loads(_raw)
    _fn = globals().get({fn_name!r})
    if _fn is None and "Solution" in globals():
        _fn = getattr(globals()["Solution"](), {fn_name!r})
    if _fn is None:
        raise NameError("the program defines no function or Solution method named " + {fn_name!r})
    _result = _fn(*_args)
    if isinstance(_result, tuple):
        _result = list(_result)
    print()
    print({marker!r} + _json.dumps(_result))

_verl_main()
"""


def _extract_program(completion: str) -> str:
    return completion.split("```python")[-1].split("```")[0]


def _call_arguments(case_input) -> list:
    if isinstance(case_input, str):
        return [json.loads(line) for line in case_input.split("\n") if line.strip()]
    return list(case_input) if isinstance(case_input, (list, tuple)) else [case_input]


def _as_lists(value):
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        return [_as_lists(v) for v in value]
    return value


def _call_result_matches(result, expected) -> bool:
    expected = _as_lists(expected)
    if result == expected:
        return True
    return isinstance(expected, list) and len(expected) == 1 and result == expected[0]


def _numbers_close(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-8)


def stdout_matches(actual: str, expected) -> bool:
    """Whether a program's stdout is the expected output (see the module docstring)."""
    if isinstance(expected, list):
        expected = "\n".join(str(e) for e in expected)
    expected = str(expected)
    lines = [line.strip() for line in actual.strip().splitlines()]
    want = [line.strip() for line in expected.strip().splitlines()]
    if lines == want:
        return True
    got_tokens, want_tokens = actual.split(), expected.split()
    return len(got_tokens) == len(want_tokens) and all(
        g == w or _numbers_close(g, w) for g, w in zip(got_tokens, want_tokens)
    )


def _preview(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "..."


def run_test_case(program: str, case_input, expected, fn_name: str | None, timeout_s: float = _CASE_TIMEOUT_S) -> dict:
    """Run one case in the sandbox; the metadata dict of the module docstring (`passed` key added)."""
    from verl.utils.reward_score.sandbox import run_python

    if fn_name:
        code = program + _HARNESS.format(fn_name=fn_name, marker=_MARKER)
        stdin = json.dumps(_call_arguments(case_input))
    else:
        code, stdin = program, case_input if isinstance(case_input, str) else "\n".join(map(str, case_input))
    result = run_python(code, stdin=stdin, timeout_s=timeout_s)
    meta: dict[str, Any] = {"passed": False}
    if result.timed_out:
        meta["status"] = "timeout"
    elif result.returncode != 0:
        meta["status"] = "runtime_error"
        meta["stderr"] = result.stderr[-_PREVIEW_CHARS:]
    else:
        if fn_name:
            marked = [line for line in result.stdout.splitlines() if line.startswith(_MARKER)]
            actual = json.loads(marked[-1][len(_MARKER) :]) if marked else None
            passed = bool(marked) and _call_result_matches(actual, expected)
        else:
            actual = result.stdout
            passed = stdout_matches(actual, expected)
        meta["passed"] = passed
        meta["status"] = "passed" if passed else "wrong_answer"
        if not passed:
            meta.update(input=_preview(case_input), expected=_preview(expected), actual=_preview(actual))
    return meta


def compute_score(completion: str, test_cases, continuous: bool = False) -> tuple[bool | float, list[dict]]:
    """(score, metadata) of a completion on its test cases (see the module docstring)."""
    if not isinstance(test_cases, dict):
        test_cases = json.loads(test_cases)
    inputs, outputs = test_cases["inputs"], test_cases["outputs"]
    if len(inputs) != len(outputs):
        raise ValueError(f"test_cases has {len(inputs)} inputs but {len(outputs)} outputs; they must pair up")
    program = _extract_program(completion)
    fn_name = test_cases.get("fn_name")
    cases = list(zip(inputs, outputs))
    if continuous:
        cases = cases[:_CONTINUOUS_CASES]
    metadata = []
    for index, (case_input, expected) in enumerate(cases):
        meta = run_test_case(program, case_input, expected, fn_name)
        meta["case_index"] = index
        metadata.append(meta)
        if not continuous and not meta["passed"]:
            return False, metadata
    if continuous:
        return (sum(m["passed"] for m in metadata) / len(metadata) if metadata else 0.0), metadata
    return True, metadata


def apps_check_correctness(in_outs, generation: str, timeout: float = 10, debug: bool = True) -> tuple[list, list]:
    """Upstream's `apps_check_correctness`: `testing_util.run_test(in_outs, generation)` as
    (results, [metadata]). Each case runs in its own interpreter with `timeout` seconds, so no global
    timeout is needed around it (upstream's wraps the whole run in one process with one)."""
    from verl.utils.reward_score.prime_code.testing_util import run_test

    results, metadata = run_test(in_outs, test=generation, debug=debug, timeout=timeout)
    return results, [metadata]
