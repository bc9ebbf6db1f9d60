"""SandboxFusionTool (upstream's names and config) against the local SandboxFusion-compatible service,
over real HTTP; its execution pool's parts without Ray, and once through a real Ray actor pool."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from verl.experimental.agent_loop.tool_agent_loop import _response_text
from verl.tools.sandbox_fusion_service import LocalSandboxService
from verl.tools.sandbox_fusion_tools import (
    RATE_LIMITER_NAME,
    ExecutionWorker,
    PoolMode,
    SandboxFusionTool,
    TokenBucket,
    init_execution_pool,
)
from verl.tools.schemas import ToolResponse

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "A tool for executing code.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to execute."}},
            "required": ["code"],
        },
    },
}


class CountingService(LocalSandboxService):
    """The local service, counting the requests it runs at once."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    def run_code(self, request):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return super().run_code(request)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture
def service():
    server = CountingService().start()
    yield server
    server.stop()


def tool_for(url: str, **config) -> SandboxFusionTool:
    return SandboxFusionTool({"sandbox_fusion_url": url, **config}, SCHEMA)


def test_config_keys_and_defaults_are_upstreams(service):
    tool = tool_for(service.url)
    assert (tool.num_workers, tool.rate_limit, tool.default_timeout, tool.default_language) == (10, 10, 30, "python")
    assert (tool.enable_global_rate_limit, tool.memory_limit_mb, tool.name) == (True, 1024, "code_interpreter")
    # the agent loop's limit on a call outlasts the service call's own: 3 attempts x (compile + run + 10 s)
    assert tool.timeout_s == 3 * (2 * 30 + 10)
    assert tool_for(service.url, default_timeout=5, timeout=7).timeout_s == 7


def test_execute_code_answers_what_the_program_printed(service):
    tool = tool_for(service.url)
    assert tool.execute_code("a", "import math\nprint(math.comb(10, 3))") == ToolResponse(text="120\n")
    failed = tool.execute_code("a", "print('before')\n1/0").text
    assert failed.startswith("before\n") and failed.rstrip().endswith("ZeroDivisionError: division by zero")
    started = time.monotonic()
    slow = tool.execute_code("a", "print('partial', flush=True)\nwhile True: pass", timeout=1).text
    assert slow == "partial\n\n[the code ran longer than its 1 s time limit]"
    assert time.monotonic() - started < 30  # the loop never ends by itself: this proves it was stopped
    other = tool.execute_code("a", "int main() {}", language="cpp").text
    assert other.startswith("Error: the code sandbox failed: language 'cpp' is not supported by this local service")


def test_an_unreachable_service_is_an_error_message_for_the_model():
    free = LocalSandboxService()
    url = free.url
    free.server_close()  # nothing listens on that port any more
    text = tool_for(url).execute_code("a", "print(1)").text
    assert text.startswith(f"Error: the code sandbox could not run the code: cannot reach {url}")


@pytest.mark.parametrize("url", ["", None, "localhost:8080/run_code", "ftp://host/run_code", "http://"])
def test_a_url_that_is_not_http_is_refused_when_the_tool_is_built(url):
    with pytest.raises(ValueError, match="sandbox_fusion_url=.* is not an http\\(s\\) URL"):
        SandboxFusionTool({} if url is None else {"sandbox_fusion_url": url}, SCHEMA)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("num_workers", 0, "num_workers=0 must be a positive number"),
        ("rate_limit", -1, "rate_limit=-1 must be a positive number"),
        ("default_timeout", "30", "default_timeout='30' must be a positive number"),
        ("default_language", "cobol", "default_language='cobol' is not a SandboxFusion language"),
    ],
)
def test_bad_limits_are_refused_with_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        tool_for("http://127.0.0.1:1/run_code", **{key: value})


def test_instances_keep_their_state_until_released(service):
    tool = tool_for(service.url)
    instance_id, response = asyncio.run(tool.create(ground_truth="42"))
    assert response == ToolResponse() and tool._instance_dict[instance_id]["ground_truth"] == "42"
    assert asyncio.run(tool.create("mine"))[0] == "mine"
    assert asyncio.run(tool.calc_reward(instance_id)) == []
    asyncio.run(tool.release(instance_id))
    assert list(tool._instance_dict) == ["mine"]
    assert tool._execution_pool is None  # no call yet: no Ray actor was started


def test_token_bucket_holds_at_most_rate_limit_calls():
    bucket = TokenBucket(2)
    bucket.acquire()
    bucket.acquire()
    third = threading.Thread(target=bucket.acquire, daemon=True)
    third.start()
    third.join(0.2)
    assert third.is_alive() and bucket.get_current_count() == 2  # blocked: both tokens are out
    bucket.release()
    third.join(5)
    assert not third.is_alive() and bucket.get_current_count() == 2
    bucket.release()
    bucket.release()
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        bucket.release()
    with pytest.raises(ValueError, match="rate_limit=0 must be a positive"):
        TokenBucket(0)


def test_execution_worker_without_the_global_limit_calls_the_function():
    worker = ExecutionWorker(enable_global_rate_limit=False)
    assert worker.ping() and worker.execute(divmod, 17, 5) == (3, 2)
    with pytest.raises(ZeroDivisionError):
        worker.execute(divmod, 1, 0)
    with pytest.raises(NotImplementedError, match="ProcessMode is not implemented"):
        init_execution_pool(4, mode=PoolMode.ProcessMode)


def test_the_agent_loop_reads_the_recipes_return_value():
    """verl-recipe's ReTool tool returns (execute_code's ToolResponse, None, None)."""
    assert _response_text((ToolResponse(text="120\n"), None, None)) == "120\n"


def test_the_service_runs_as_a_module_and_speaks_run_code(tmp_path):
    probe = LocalSandboxService()
    port = probe.server_address[1]
    probe.server_close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl.tools.sandbox_fusion_service", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip().endswith(f"http://127.0.0.1:{port}/run_code")
        body = json.dumps({"code": "print(input()[::-1])", "stdin": "abc", "language": "python"}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/run_code", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            reply = json.loads(response.read())
        assert reply["status"] == "Success" and reply["compile_result"] is None
        assert (reply["run_result"]["status"], reply["run_result"]["return_code"]) == ("Finished", 0)
        assert reply["run_result"]["stdout"] == "cba\n"
        bad = urllib.request.Request(f"http://127.0.0.1:{port}/run_code", data=b"[1]", method="POST")
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(bad, timeout=30)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow  # two actor processes start (~4 s on a busy 2-core machine)
def test_execute_runs_through_a_ray_actor_pool_under_the_cluster_wide_limit(service, ray_session):
    ray = ray_session
    tool = tool_for(service.url, num_workers=4, rate_limit=1)
    program = "import time\ntime.sleep(0.2)\nprint('done')"

    async def three_calls():
        return await asyncio.gather(*(tool.execute(str(i), {"code": program}) for i in range(3)))

    try:
        results = asyncio.run(three_calls())
        assert results == [(ToolResponse(text="done\n"), None, None)] * 3
        assert service.max_in_flight == 1  # rate_limit=1: the pool's 4 threads took turns
        limiter = ray.get_actor(RATE_LIMITER_NAME)
        deadline = time.monotonic() + 30  # each release is sent without waiting for it
        while ray.get(limiter.get_current_count.remote()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.get(limiter.get_current_count.remote()) == 0
    finally:
        ray.kill(tool.execution_pool)
        ray.kill(ray.get_actor(RATE_LIMITER_NAME))
