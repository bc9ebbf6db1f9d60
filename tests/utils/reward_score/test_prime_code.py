"""prime_code: local, sandboxed test-case execution (stdin programs and call-based functions)."""

import json

import pytest

from verl.utils.reward_score import default_compute_score, prime_code

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
STDIN_CASES = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7", "7\n"]}


def test_stdin_program_passes_every_case():
    ok, meta = prime_code.compute_score("Here you go:\n" + ADD, json.dumps(STDIN_CASES))
    assert ok is True and [m["status"] for m in meta] == ["passed"] * 3


def test_failure_stops_early_unless_continuous():
    wrong = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    ok, meta = prime_code.compute_score(wrong, STDIN_CASES)
    assert ok is False and [m["status"] for m in meta] == ["passed", "passed", "wrong_answer"]
    assert meta[-1]["actual"].strip() == "0" and meta[-1]["expected"] == "7\n"
    score, meta = prime_code.compute_score(wrong, STDIN_CASES, continuous=True)
    assert score == pytest.approx(2 / 3) and len(meta) == 3


def test_output_comparison_tolerates_whitespace_and_float_noise():
    assert prime_code.stdout_matches("1 2  \n3\n\n", "1 2\n3")
    assert prime_code.stdout_matches("0.3333333\n", "0.33333334")
    assert not prime_code.stdout_matches("0.34\n", "0.33")
    assert prime_code.stdout_matches("a\nb\n", ["a", "b"])


def test_call_based_function_and_solution_class():
    cases = {"fn_name": "twice", "inputs": [[2], [[1, 2]]], "outputs": [4, [[1, 2, 1, 2]]]}
    ok, _ = prime_code.compute_score("```python\ndef twice(x):\n    return x * 2\n```", cases)
    assert ok is True
    cls = "```python\nclass Solution:\n    def twice(self, x):\n        print('noise')\n        return (x * 2,)\n```"
    ok, _ = prime_code.compute_score(cls, {"fn_name": "twice", "inputs": ["3"], "outputs": [[6]]})
    assert ok is True


def test_runtime_errors_and_timeouts_fail_the_case():
    ok, meta = prime_code.compute_score("```python\nraise SystemExit(3)\n```", STDIN_CASES)
    assert ok is False and meta[0]["status"] == "runtime_error"
    loop = "```python\nwhile True:\n    pass\n```"
    from verl.utils.reward_score.prime_code import run_test_case

    assert run_test_case(prime_code._extract_program(loop), "", "x", None, timeout_s=1.0)["status"] == "timeout"


def test_code_sources_without_sandbox_url_run_locally():
    for source in ("codecontests", "apps", "codeforces", "taco"):
        assert default_compute_score(source, ADD, json.dumps(STDIN_CASES)) == 1.0
    half = {"inputs": ["1 1", "2 2"], "outputs": ["2", "5"]}
    assert default_compute_score("apps", ADD, half) == 0.5


def test_testing_util_run_test_reports_upstreams_codes_and_stops_at_the_first_failure():
    # the entry point verl-recipe r1's LiveCodeBench scorer imports
    from verl.utils.reward_score.prime_code.testing_util import run_test

    cases = {"inputs": ["1 2\n", "3 4\n", "5 6\n"], "outputs": ["3\n", "7\n", "11\n"]}
    adder = "a, b = map(int, input().split())\nprint(a + b)"
    assert run_test(cases, test=adder, timeout=10) == ([True, True, True], {})

    wrong_second = "a, b = map(int, input().split())\nprint(a + b if a == 1 else 0)"
    results, meta = run_test(json.dumps(cases), test=wrong_second, timeout=10)
    assert results == [True, False] and meta["error_code"] is False and meta["case_index"] == 1

    results, meta = run_test(cases, test="raise SystemExit(3)", timeout=10)
    assert results == [-1] and meta["status"] == "runtime_error"
    assert run_test(cases, test="def broken(:\n")[0] == [-2]

    call_based = {"inputs": ["[1, 2]"], "outputs": [[2, 1]], "fn_name": "flip"}
    assert run_test(call_based, test="def flip(xs):\n    return xs[::-1]")[0] == [True]
    with pytest.raises(ValueError, match="needs the program"):
        run_test(cases)


def test_upstreams_apps_check_correctness_reports_each_case_and_the_failure():
    from verl.utils.reward_score.prime_code import apps_check_correctness

    doubling = "n = int(input())\nprint(2 * n)\n"
    ok, meta = apps_check_correctness({"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10\n"]}, doubling, timeout=10)
    assert (ok, meta) == ([True, True], [{}])
    wrong, meta = apps_check_correctness({"inputs": ["3\n", "5\n"], "outputs": ["6\n", "11\n"]}, doubling, debug=False)
    assert wrong == [True, False] and meta[0]["case_index"] == 1 and meta[0]["error_code"] is False
    broken, meta = apps_check_correctness({"inputs": ["1\n"], "outputs": ["2\n"]}, "def f(:\n", debug=False)
    assert broken == [-2] and meta[0]["status"] == "compile_error"
