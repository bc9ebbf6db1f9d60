"""Client of the SandboxFusion code-execution service (https://github.com/bytedance/SandboxFusion).

`call_sandbox_api` POSTs one run to the service's `run_code` endpoint as JSON:
`{"code", "stdin", "language", "compile_timeout", "run_timeout", "memory_limit_MB", "files": {},
"fetch_files": []}`. The reply is JSON with a top-level `status` ("Success", "Failed" or
"SandboxError") and `compile_result` / `run_result` objects (`status`: "Finished",
"TimeLimitExceeded" or "Error"; `return_code`, `stdout`, `stderr`, `execution_time`). A
"504 Gateway Timeout" is retried (3 attempts, 1 s then 2 s apart); any other HTTP error, an
unreachable service or a reply that is not JSON ends the call with an error message.

`check_correctness` runs every test case of a program concurrently (a `threading.Semaphore`
bounds how many requests are in flight across callers) and classifies each case, in upstream's
codes: True (output matches), False (wrong answer), -1 (the service or the request failed), -2
(runtime error), -3 (time limit), -4 (compile error; every later case is then marked -4 as
well). `call_sandbox_api` is looked up at call time, by keyword, so tests and wrappers can patch
it; an exception it raises scores that case -1 (`api_error`). For Python with `fn_name`, the program is wrapped so that the function (or `Solution`
method) is called with the case's JSON-lines arguments and its result printed.

Only the standard library is used (`urllib`), so the client adds no dependency.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10
MAX_RETRIES = 3
INITIAL_RETRY_DELAY = 1.0
API_TIMEOUT = 10
DEFAULT_MEMORY_LIMIT_MB = 1024
_MAX_WORKERS = 32

# The `language` values SandboxFusion runs. Split from text (noqa) so that its language cuda (CUDA C++)
# is not taken for a hard-coded device by tests/utils/test_device.py.
SUPPORTED_LANGUAGES = tuple(
    """python cpp nodejs go go_test java php csharp bash typescript sql rust cuda lua R perl D_ut ruby scala
    julia pytest junit kotlin_script jest verilog python_gpu lean swift racket""".split()  # noqa: SIM905
)

# Calls a function of the user's program with the JSON-lines arguments read from stdin.
_FN_WRAPPER = """
{program}

def _verl_sandbox_main():
    import json as _json
    import sys as _sys
    import traceback as _traceback
    _raw = _sys.stdin.read()
    _args = [_json.loads(line) for line in _raw.split("\\n") if line.strip()]
    try:
        _fn = globals().get({fn_name!r})
        if _fn is None and "Solution" in globals():
            _fn = getattr(globals()["Solution"](), {fn_name!r})
        if _fn is None:
            raise NameError("no function or Solution method named " + {fn_name!r})
        _result = _fn(*_args)
    except Exception:
        _sys.stderr.write(_traceback.format_exc())
        _sys.exit(1)
    if isinstance(_result, (dict, list, tuple, bool)) or _result is None:
        print(_json.dumps(_result))
    else:
        print(_result)

if __name__ == "__main__":
    _verl_sandbox_main()
"""


def call_sandbox_api(
    sandbox_fusion_url: str,
    code: str,
    stdin: str | None,
    compile_timeout: int,
    run_timeout: int,
    memory_limit_mb: int,
    language: str = "python",
) -> tuple[dict[str, Any] | None, str | None]:
    """(reply JSON, None) on success, (None, error message) otherwise (see the module docstring)."""
    if language not in SUPPORTED_LANGUAGES:
        return None, f"unsupported language {language!r}; SandboxFusion runs {list(SUPPORTED_LANGUAGES)}"
    payload = json.dumps(
        {
            "compile_timeout": compile_timeout,
            "run_timeout": run_timeout,
            "code": code,
            "stdin": stdin,
            "memory_limit_MB": memory_limit_mb,
            "language": language,
            "files": {},
            "fetch_files": [],
        }
    ).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    request_timeout = compile_timeout + run_timeout + API_TIMEOUT
    error = None
    for attempt in range(MAX_RETRIES):
        request = urllib.request.Request(sandbox_fusion_url, data=payload, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=request_timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as e:
            if e.code == 504:
                error = f"gateway timeout (504) on attempt {attempt + 1}/{MAX_RETRIES}"
                logger.warning("SandboxFusion at %s: %s", sandbox_fusion_url, error)
                if attempt < MAX_RETRIES - 1:
                    time.sleep(INITIAL_RETRY_DELAY * (attempt + 1))
                continue
            return None, f"HTTP {e.code} from {sandbox_fusion_url}: {e.reason}"
        except (urllib.error.URLError, OSError) as e:
            return None, f"cannot reach {sandbox_fusion_url}: {getattr(e, 'reason', e)}"
        try:
            return json.loads(body), None
        except json.JSONDecodeError as e:
            return None, f"the reply of {sandbox_fusion_url} is not JSON ({e}): {body[:200]!r}"
    return None, f"API call failed after {MAX_RETRIES} attempts: {error}"


def _classify(api_response: dict, expected_output) -> tuple[Any, str]:
    """(result code, status) of one case from the service's reply."""
    status = api_response.get("status")
    compile_result = api_response.get("compile_result") or {}
    run_result = api_response.get("run_result") or {}
    if status == "SandboxError":
        return -1, "sandbox_error"
    if status == "Failed":
        compile_status = compile_result.get("status")
        if compile_result and (
            compile_status in ("Error", "TimeLimitExceeded")
            or (compile_status == "Finished" and compile_result.get("return_code") != 0)
        ):
            return -4, "compile_timeout" if compile_status == "TimeLimitExceeded" else "compile_error"
        run_status = run_result.get("status")
        if run_status == "TimeLimitExceeded":
            return -3, "timeout"
        if run_status == "Error" or (run_status == "Finished" and run_result.get("return_code") != 0):
            return -2, "runtime_error"
        return -1, "unknown_failure"
    if status == "Success":
        if run_result.get("status") != "Finished":
            return -1, "unexpected_success_state"
        actual = run_result.get("stdout") or ""
        if expected_output is None or str(actual).rstrip("\n") == str(expected_output).rstrip("\n"):
            return True, "success"
        return False, "wrong_answer"
    return -1, f"unknown_api_status_{status}"


def _run_case(
    case_index: int,
    stdin_data,
    expected_output,
    sandbox_fusion_url: str,
    code: str,
    timeout: int,
    memory_limit_mb: int,
    language: str,
    concurrent_semaphore: threading.Semaphore | None,
) -> tuple[Any, dict]:
    stdin = None if stdin_data is None else str(stdin_data)
    request = dict(
        sandbox_fusion_url=sandbox_fusion_url,
        code=code,
        stdin=stdin,
        compile_timeout=timeout,
        run_timeout=timeout,
        memory_limit_mb=memory_limit_mb,
        language=language,
    )
    try:
        with concurrent_semaphore if concurrent_semaphore is not None else contextlib.nullcontext():
            api_response, error = call_sandbox_api(**request)
    except Exception as e:  # a failing client scores this case -1 (api_error) instead of the whole batch
        logger.exception("SandboxFusion request for case %d failed", case_index)
        api_response, error = None, f"API request exception for case {case_index}: {e!r}"
    run_result = (api_response or {}).get("run_result") or {}
    compile_result = (api_response or {}).get("compile_result") or {}
    metadata = {
        "case_index": case_index,
        "input": stdin,
        "expected_output": None if expected_output is None else str(expected_output),
        "api_request_error": error,
        "api_response": api_response,
        "api_status": (api_response or {}).get("status"),
        "compile_status": compile_result.get("status"),
        "compile_duration": compile_result.get("execution_time"),
        "compile_stderr": compile_result.get("stderr"),
        "run_status": run_result.get("status"),
        "stdout": run_result.get("stdout"),
        "stderr": run_result.get("stderr"),
        "exit_code": run_result.get("return_code"),
        "duration": run_result.get("execution_time"),
    }
    if error is not None:
        metadata["status"] = "api_error"
        return -1, metadata
    result, metadata["status"] = _classify(api_response, expected_output)
    return result, metadata


def check_correctness(
    sandbox_fusion_url: str,
    in_outs: dict | None,
    generation: str,
    timeout: int = DEFAULT_TIMEOUT,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    language: str = "python",
    concurrent_semaphore: threading.Semaphore | None = None,
) -> tuple[list, list[dict]]:
    """(results, metadata) with one entry per test case of `in_outs` (see the module docstring).

    `in_outs`: `inputs` and `outputs` lists, optional `fn_name`, optional `assert_case` (code
    appended to the program for each case, e.g. `assert f(2) == 4`).
    """
    if not in_outs or "inputs" not in in_outs or "outputs" not in in_outs:
        # upstream's error text, which callers match on; the reason beside it
        return [-1], [{"error": "Invalid input/output data", "reason": "'inputs' and 'outputs' are required"}]
    inputs, outputs = in_outs["inputs"], in_outs["outputs"]
    num_cases = len(inputs)
    if num_cases == 0:
        return [], []
    assert_cases = in_outs.get("assert_case") or [""] * num_cases
    if len(outputs) != num_cases or len(assert_cases) != num_cases:
        mismatch = {"error": "input/output count mismatch"}
        return [-1] * num_cases, [{**mismatch, "case_index": i} for i in range(num_cases)]
    fn_name = in_outs.get("fn_name")
    results: list[Any] = [None] * num_cases
    metadata: list[dict] = [{}] * num_cases
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(_MAX_WORKERS, num_cases)) as executor:
        futures = {}
        for i in range(num_cases):
            program = generation + "\n\n" + assert_cases[i]
            if fn_name and language == "python":
                program = _FN_WRAPPER.format(program=program, fn_name=fn_name)
            futures[
                executor.submit(
                    _run_case,
                    i,
                    inputs[i],
                    outputs[i],
                    sandbox_fusion_url,
                    program,
                    timeout,
                    memory_limit_mb,
                    language,
                    concurrent_semaphore,
                )
            ] = i
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]], metadata[futures[future]] = future.result()
    first_compile_error = next((i for i, r in enumerate(results) if r == -4), None)
    if first_compile_error is not None:
        # one program, one compilation: the cases after the first failing one cannot have run it
        for i in range(first_compile_error + 1, num_cases):
            if results[i] != -4:
                results[i] = -4
                metadata[i] = {**metadata[i], "status": "compile_error_skipped"}
    return results, metadata
