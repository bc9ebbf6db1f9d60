"""SearchTool (upstream's names and config) end to end against the local BM25 retrieval service over
real HTTP; the retrieval service's ranking against hand-worked BM25 scores."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from verl.tools import search_tool
from verl.tools.retrieval_service import BM25Index, RetrievalService, load_corpus
from verl.tools.sandbox_fusion_tools import ExecutionWorker
from verl.tools.search_tool import SearchTool
from verl.tools.utils import search_r1_like_utils
from verl.tools.utils.search_r1_like_utils import call_search_api, perform_single_search_batch
from verl.tools.utils.tool_registry import initialize_tools_from_config

CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "2", "contents": '"Mount Everest"\nEverest is the highest mountain on Earth.'},
]

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web for relevant information based on the given query.",
        "parameters": {
            "type": "object",
            "properties": {"query_list": {"type": "array", "item": {"type": "string"}, "description": "queries"}},
            "required": ["query_list"],
        },
    },
}


class InProcessPool:
    """The execution pool's interface (`execute.remote(fn, *args)` awaitable) over an `ExecutionWorker`
    in a thread, for the default tier; the Ray actor pool itself is tested in test_sandbox_fusion_tools."""

    def __init__(self):
        worker = ExecutionWorker(enable_global_rate_limit=False)
        self.calls = 0

        class _Execute:
            def remote(_, fn, *args):
                self.calls += 1
                return asyncio.to_thread(worker.execute, fn, *args)

        self.execute = _Execute()


@pytest.fixture
def service():
    server = RetrievalService(BM25Index(CORPUS)).start()
    yield server
    server.stop()


def test_bm25_scores_match_a_hand_worked_computation():
    index = BM25Index(CORPUS)
    # tokens: title + text, e.g. doc 0 is "paris paris is the capital of france" (7); doc 2 has 9
    # "capital": in docs 0 and 1 (df=2 of n=3), tf=1 in each; lengths 7 and 7, average 23/3
    lengths, avg = [7, 7, 9], 23 / 3
    assert index._lengths == lengths
    idf = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))
    expected = idf * 1 * 1.9 / (1 + 0.9 * (1 - 0.4 + 0.4 * lengths[0] / avg))
    scores = index.scores("capital")
    assert set(scores) == {0, 1}
    assert scores[0] == pytest.approx(expected, rel=1e-12) and scores[1] == pytest.approx(expected, rel=1e-12)
    # "france" only in doc 0, so doc 0 ranks first; ties keep corpus order; no shared token: no hit
    assert [doc["id"] for doc, _ in index.search("capital of France", 3)] == ["0", "1"]
    assert [doc["id"] for doc, _ in index.search("capital", 1)] == ["0"]
    assert index.search("volcano", 3) == []


def test_the_service_speaks_upstreams_retrieve_api(service):
    reply, error = call_search_api(service.url, ["highest mountain", "Germany"], topk=2, return_scores=True)
    assert error is None
    assert [[hit["document"]["id"] for hit in hits] for hits in reply["result"]] == [["2"], ["1"]]
    assert reply["result"][0][0]["document"] == CORPUS[2] and reply["result"][0][0]["score"] > 0
    plain, _ = call_search_api(service.url, ["Germany"], return_scores=False)
    assert plain == {"result": [[CORPUS[1]]]}


def test_a_malformed_request_is_a_400_that_names_the_problem_and_is_not_retried(service):
    reply, error = call_search_api(service.url, ["x"], topk=0)
    assert reply is None and error.startswith("HTTP 400") and "'topk' must be a positive integer" in error


def test_results_are_formatted_as_upstreams_doc_blocks(service):
    text, metadata = perform_single_search_batch(service.url, ["capital of France", "Everest"], topk=2)
    assert json.loads(text) == {
        "result": 'Doc 1 (Title: "Paris")\nParis is the capital of France.\n\n'
        'Doc 2 (Title: "Berlin")\nBerlin is the capital of Germany.'
        '\n---\nDoc 1 (Title: "Mount Everest")\nEverest is the highest mountain on Earth.'
    }
    assert (metadata["status"], metadata["total_results"], metadata["query_count"]) == ("success", 3, 2)


def test_an_unreachable_service_is_retried_then_reported(monkeypatch):
    monkeypatch.setattr(search_r1_like_utils, "MAX_RETRIES", 2)
    monkeypatch.setattr(search_r1_like_utils, "INITIAL_RETRY_DELAY", 0)
    server = RetrievalService(BM25Index(CORPUS))
    url = server.url
    server.server_close()  # a port nothing listens on
    text, metadata = perform_single_search_batch(url, ["x"], timeout=2)
    assert metadata["status"] == "api_error"
    assert json.loads(text)["result"].startswith(f"Search error: cannot reach the retrieval service at {url}")
    assert "(after 2 attempts)" in metadata["api_request_error"]


def test_search_tool_end_to_end_from_upstreams_tool_config(service, tmp_path):
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(
        "tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    config:\n"
        f"      retrieval_service_url: {service.url}\n      num_workers: 120\n      rate_limit: 120\n"
        "      timeout: 30\n      type: native\n"
        f"    tool_schema: {json.dumps(SCHEMA)}\n"
    )
    (tool,) = initialize_tools_from_config(str(path))
    assert (type(tool), tool.name, tool.topk, tool.timeout, tool.enable_global_rate_limit) == (
        SearchTool,
        "search",
        3,
        30,
        True,
    )
    assert tool.timeout_s == 10 * 30 + 45  # ten attempts of 30 s and 1+2+...+9 s between them
    tool.execution_pool = pool = InProcessPool()

    async def session():
        instance_id, _ = await tool.create()
        first = await tool.execute(instance_id, {"query_list": ["capital of Germany"]})
        empty = await tool.execute(instance_id, {"query_list": []})
        rewards = await tool.calc_reward(instance_id)
        await tool.release(instance_id)
        return first, empty, rewards

    (response, step_reward, metrics), empty, rewards = asyncio.run(session())
    assert json.loads(response.text)["result"].startswith('Doc 1 (Title: "Berlin")\nBerlin is the capital')
    assert step_reward == 0.0
    assert metrics == {"query_count": 1, "status": "success", "total_results": 2, "api_request_error": None}
    assert "'query_list' is missing, empty, or not a list" in json.loads(empty[0].text)["result"]
    assert pool.calls == 1  # the bad call never reached the pool
    assert rewards == [response.text]
    assert tool._instance_dict == {}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({}, "retrieval_service_url=None is not an http"),
        ({"retrieval_service_url": "localhost:8000"}, "is not an http"),
        ({"retrieval_service_url": "http://h/retrieve", "topk": 0}, "topk=0 must be a positive"),
        ({"retrieval_service_url": "http://h/retrieve", "num_workers": -1}, "num_workers=-1"),
    ],
)
def test_bad_config_is_refused_when_the_tool_is_built(config, match):
    with pytest.raises(ValueError, match=match):
        SearchTool(config, SCHEMA)


def test_building_the_tool_starts_no_ray_pool():
    tool = SearchTool({"retrieval_service_url": "http://127.0.0.1:1/retrieve"}, SCHEMA)
    assert tool._execution_pool is None
    assert search_tool.init_search_execution_pool is search_tool.init_execution_pool


def test_the_service_runs_as_a_module(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    assert load_corpus(str(corpus)) == CORPUS
    server = RetrievalService(BM25Index([]))
    port = server.server_address[1]
    server.server_close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl.tools.retrieval_service", "--corpus", str(corpus), "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "over 3 documents" in proc.stdout.readline()
        deadline = time.monotonic() + 20
        while True:
            try:
                reply, error = call_search_api(f"http://127.0.0.1:{port}/retrieve", ["Paris"], topk=1)
                break
            except urllib.error.URLError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert error is None and reply["result"][0][0]["document"]["id"] == "0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_corpus_line_without_contents_is_refused_with_its_position():
    with pytest.raises(ValueError, match="corpus document 1 must be a JSON object with a string 'contents'"):
        BM25Index([{"contents": "a"}, {"text": "b"}])


@pytest.mark.slow  # two actor processes start (~4 s on a busy 2-core machine)
def test_search_runs_through_the_ray_execution_pool(service, ray_session):
    ray = ray_session
    tool = SearchTool({"retrieval_service_url": service.url, "num_workers": 2, "rate_limit": 2}, SCHEMA)

    async def two_calls():
        return await asyncio.gather(*(tool.execute(str(i), {"query_list": ["Everest"]}) for i in range(2)))

    try:
        for response, step_reward, metrics in asyncio.run(two_calls()):
            assert json.loads(response.text)["result"].startswith('Doc 1 (Title: "Mount Everest")')
            assert (step_reward, metrics["status"]) == (0.0, "success")
    finally:
        ray.kill(tool.execution_pool)
        ray.kill(ray.get_actor(search_tool.RATE_LIMITER_NAME))
