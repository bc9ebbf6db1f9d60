"""sandbox_fusion: the SandboxFusion HTTP client against the local service on 127.0.0.1.

The service is `verl.tools.sandbox_fusion_service` (the real `run_code` API, Python run in our
sandbox); the test subclass records requests and injects failures: special markers in the code make it
answer a compile error or a sandbox error, and `fail_next_504` makes it answer "504 Gateway Timeout"
that many times first.
"""

import json
import threading
import time

import pytest

from verl.tools.sandbox_fusion_service import LocalSandboxService
from verl.utils.reward_score import default_compute_score, sandbox_fusion
from verl.utils.reward_score.sandbox_fusion import utils as sf_utils


class RecordingService(LocalSandboxService):
    def __init__(self):
        super().__init__()
        self.requests = []
        self.fail_next_504 = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay_s = 0.0
        self.lock = threading.Lock()

    def run_code(self, request):
        with self.lock:
            self.requests.append(request)
            if self.fail_next_504 > 0:
                self.fail_next_504 -= 1
                return 504, {"message": "gateway timeout"}
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay_s)
            if "SANDBOX_BROKEN" in request["code"]:
                return 200, {"status": "SandboxError", "message": "worker crashed"}
            if "COMPILE_ERROR" in request["code"]:
                compile_result = {"status": "Finished", "return_code": 1, "stderr": "error: expected ';'"}
                return 200, {"status": "Failed", "compile_result": compile_result, "run_result": None}
            return super().run_code(request)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture
def service():
    server = RecordingService().start()
    yield server
    server.stop()


ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = {"inputs": ["1 2", "3 4", "5 5"], "outputs": ["3", "7", "10"]}


def test_request_follows_the_run_code_api(service):
    score, meta = sandbox_fusion.compute_score(service.url, None, 512, ADD, json.dumps(CASES))
    assert score == 1.0 and [m["status"] for m in meta] == ["success"] * 3
    request = min(service.requests, key=lambda r: r["stdin"])
    assert request == {
        "compile_timeout": 10,
        "run_timeout": 10,
        "code": "\na, b = map(int, input().split())\nprint(a + b)\n\n\n",
        "stdin": "1 2",
        "memory_limit_MB": 512,
        "language": "python",
        "files": {},
        "fetch_files": [],
    }


def test_score_is_the_fraction_of_passing_cases(service):
    cases = {"inputs": ["1 2", "3 4", "5 5", "0 0"], "outputs": ["3", "8", "10", "1"]}
    score, meta = sandbox_fusion.compute_score(service.url, None, None, ADD, cases)
    assert score == 0.5 and [m["status"] for m in meta] == ["success", "wrong_answer", "success", "wrong_answer"]
    many = {"inputs": ["1 1"] * 12, "outputs": ["2"] * 10 + ["0", "0"]}
    assert sandbox_fusion.compute_score(service.url, None, None, ADD, many, continuous=True)[0] == 1.0
    assert sandbox_fusion.compute_score(service.url, None, None, ADD, many)[0] == pytest.approx(10 / 12)


def test_runtime_errors_timeouts_and_sandbox_errors_are_classified(service):
    program = (
        "import sys\nx = input()\nif x == 'crash': raise ValueError(x)\nif x == 'hang':\n    while True: pass\nprint(x)"
    )
    cases = {"inputs": ["ok", "crash", "hang"], "outputs": ["ok", "", ""]}
    results, meta = sf_utils.check_correctness(service.url, cases, program, timeout=1)
    assert results == [True, -2, -3]
    assert "ValueError: crash" in meta[1]["stderr"]
    results, _ = sf_utils.check_correctness(service.url, {"inputs": [""], "outputs": [""]}, "SANDBOX_BROKEN = 1")
    assert results == [-1]


def test_a_compile_error_fails_every_later_case(service):
    cases = {"inputs": ["a", "b", "c"], "outputs": ["", "", ""], "assert_case": ["", "", ""]}
    results, meta = sf_utils.check_correctness(service.url, cases, "int main() { COMPILE_ERROR }", language="cpp")
    assert results == [-4, -4, -4] and meta[0]["status"] == "compile_error"


def test_fn_name_and_assert_cases(service):
    fn_cases = {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"]}
    score, _ = sandbox_fusion.compute_score(
        service.url, None, None, "```python\ndef add(a, b):\n    return a + b\n```", fn_cases
    )
    assert score == 1.0
    asserts = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    score, meta = sandbox_fusion.compute_score(
        service.url, None, None, "```python\ndef add(a, b):\n    return a + b\n```", asserts
    )
    assert score == 0.5 and meta[1]["status"] == "runtime_error"


def test_gateway_timeouts_are_retried(service, monkeypatch):
    monkeypatch.setattr(sf_utils, "INITIAL_RETRY_DELAY", 0.01)
    service.fail_next_504 = 2
    response, error = sf_utils.call_sandbox_api(service.url, "print(1)", "", 5, 5, 256)
    assert error is None and response["run_result"]["stdout"] == "1\n" and len(service.requests) == 3
    service.fail_next_504 = 3
    response, error = sf_utils.call_sandbox_api(service.url, "print(1)", "", 5, 5, 256)
    assert response is None and "504" in error and len(service.requests) == 6


def test_unreachable_service_and_bad_inputs(service):
    url = service.url
    service.shutdown()
    service.server_close()
    results, meta = sf_utils.check_correctness(url, CASES, "print(1)")
    assert results == [-1, -1, -1] and "cannot reach" in meta[0]["api_request_error"]
    assert sf_utils.call_sandbox_api(url, "x", "", 1, 1, 1, language="cobol")[1].startswith("unsupported language")
    assert sandbox_fusion.compute_score(url, None, None, "no code here", CASES) == (
        0.0,
        [{"error": "Invalid completion (missing code block)"}],
    )
    with pytest.raises(ValueError, match="needs 'inputs' and 'outputs'"):
        sandbox_fusion.compute_score(url, None, None, ADD, {"inputs": []})


def test_semaphore_bounds_requests_in_flight(service):
    service.delay_s = 0.2
    cases = {"inputs": ["1 1"] * 4, "outputs": ["2"] * 4}
    assert sandbox_fusion.compute_score(service.url, threading.Semaphore(1), None, ADD, cases)[0] == 1.0
    assert service.max_in_flight == 1
    service.max_in_flight = 0
    sandbox_fusion.compute_score(service.url, None, None, ADD, cases)
    assert service.max_in_flight > 1


def test_code_sources_use_the_service_when_a_url_is_given(service):
    cases = json.dumps({"inputs": ["2 2", "1 1"], "outputs": ["4", "3"]})
    assert default_compute_score("codecontests", ADD, cases, sandbox_fusion_url=service.url) == 0.5
    assert len(service.requests) == 2


def test_reward_model_sandbox_fusion_keys_route_the_built_in_scorer_to_the_service(service):
    """reward_model.sandbox_fusion.{url, max_concurrent} reach the reward manager's scorer (upstream's
    wiring), and the scorer survives pickling to a scoring process with its bound intact."""
    import pickle

    from verl.trainer.config import load_ppo_config
    from verl.trainer.ppo.reward import load_reward_manager

    cfg = load_ppo_config(
        [f"reward_model.sandbox_fusion.url={service.url}", "reward_model.sandbox_fusion.max_concurrent=1"],
        config_name="arith_demo",
    )
    manager = load_reward_manager(cfg, tokenizer=None, num_examine=0)
    scorer = pickle.loads(pickle.dumps(manager.compute_score))
    service.delay_s = 0.1
    cases = json.dumps({"inputs": ["2 2", "1 1", "3 3"], "outputs": ["4", "3", "6"]})
    assert scorer("codecontests", ADD, cases) == pytest.approx(2 / 3)
    assert len(service.requests) == 3 and service.max_in_flight == 1
    # without a url the built-in scorer runs code locally: the service sees nothing
    plain = load_reward_manager(load_ppo_config(config_name="arith_demo"), tokenizer=None, num_examine=0)
    assert plain.compute_score("codecontests", ADD, cases) == pytest.approx(2 / 3)
    assert len(service.requests) == 3


def test_sandbox_fusion_url_must_be_http():
    from verl.trainer.config import ConfigError, load_ppo_config

    with pytest.raises(ConfigError, match="is not an http\\(s\\) URL"):
        load_ppo_config(["reward_model.sandbox_fusion.url=localhost:8080"], config_name="arith_demo")


@pytest.mark.parametrize("in_outs", [None, {}, {"inputs": ["1"]}, {"outputs": ["1"]}])
def test_test_cases_without_inputs_and_outputs_score_minus_one_with_upstreams_error_text(in_outs):
    assert sf_utils.check_correctness("http://unused", in_outs, "print(1)") == (
        [-1],
        [{"error": "Invalid input/output data", "reason": "'inputs' and 'outputs' are required"}],
    )


def test_the_client_is_called_by_keyword_through_the_module_and_its_exceptions_score_that_case(monkeypatch):
    seen = []

    def fake_call(**kwargs):  # keywords only: a positional call would fail here
        seen.append(kwargs)
        if kwargs["stdin"] == "boom":
            raise ConnectionResetError("peer went away")
        return {"status": "Success", "run_result": {"status": "Finished", "stdout": kwargs["stdin"]}}, None

    monkeypatch.setattr(sf_utils, "call_sandbox_api", fake_call)
    cases = {"inputs": ["a", "boom", "c"], "outputs": ["a", "b", "x"]}
    results, meta = sf_utils.check_correctness("http://svc", cases, "prog", timeout=7, memory_limit_mb=64)
    assert results == [True, -1, False]
    assert [m["status"] for m in meta] == ["success", "api_error", "wrong_answer"]
    assert "ConnectionResetError('peer went away')" in meta[1]["api_request_error"]
    assert sorted(seen, key=lambda k: k["stdin"])[0] == {
        "sandbox_fusion_url": "http://svc",
        "code": "prog\n\n",
        "stdin": "a",
        "compile_timeout": 7,
        "run_timeout": 7,
        "memory_limit_mb": 64,
        "language": "python",
    }
