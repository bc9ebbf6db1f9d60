"""Upstream's `prime_code.testing_util.run_test`, which recipes import directly (verl-recipe r1's
LiveCodeBench scorer: `from verl.utils.reward_score.prime_code.testing_util import run_test`).

`run_test(in_outs, test, debug=False, timeout=15) -> (results, metadata)`: `in_outs` holds
`inputs`, `outputs` and optionally `fn_name` (see the package docstring for how a case runs and is
compared); `test` is the program. `results` has one entry per case run, in upstream's codes: True
(passed), False (wrong answer), -1 (runtime error or timeout), or a single -2 when the program does
not compile; running stops at the first case that does not pass, as upstream's does. `metadata` is
{} when every case passes, else the failing case's dict (package docstring) with upstream's
`error_code` added.

Each case runs in its own sandboxed interpreter (`run_test_case`), not by `exec` in this process:
upstream's `reliability_guard` disables parts of the calling process (os.kill, shutil.rmtree, ...)
for good, which this version has no need to do. `debug` only prints each case's outcome.
"""

from __future__ import annotations

import json

from verl.utils.reward_score.prime_code import run_test_case

__all__ = ["run_test"]

_COMPILE_ERROR = -2
_RUNTIME_ERROR = -1


def run_test(in_outs, test=None, debug: bool = False, timeout: float = 15) -> tuple[list, dict]:
    """Run the program `test` on every case of `in_outs` (module docstring)."""
    if test is None:
        raise ValueError("run_test needs the program to test (test=None); pass the generated code as `test`")
    if not isinstance(in_outs, dict):
        in_outs = json.loads(in_outs)
    inputs, outputs = in_outs["inputs"], in_outs["outputs"]
    if len(inputs) != len(outputs):
        raise ValueError(f"in_outs has {len(inputs)} inputs but {len(outputs)} outputs; they must pair up")
    try:
        compile(test, "<program>", "exec")
    except (SyntaxError, ValueError) as error:
        return [_COMPILE_ERROR], {"error": repr(error), "error_code": _COMPILE_ERROR, "status": "compile_error"}
    results: list = []
    for index, (case_input, expected) in enumerate(zip(inputs, outputs)):
        meta = run_test_case(test, case_input, expected, in_outs.get("fn_name"), timeout_s=timeout)
        if debug:
            print(f"run_test case {index}: {meta['status']}")
        if meta["passed"]:
            results.append(True)
            continue
        code = False if meta["status"] == "wrong_answer" else _RUNTIME_ERROR
        results.append(code)
        return results, {**meta, "case_index": index, "error_code": code}
    return results, {}
