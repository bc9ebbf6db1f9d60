"""Upstream's MCP tools against a real MCP server (tests/tools/mcp/fixture_server.py, over stdio and over SSE with
a bearer token): tool configs of `config.type: mcp`, the schemas the server publishes, calls and their answers,
the rate limit, and the mistakes a user can make."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("fastmcp")

from mcp.types import TextContent, Tool

from verl.tools.mcp_base_tool import MCPBaseTool
from verl.tools.mcp_search_tool import MCPSearchTool
from verl.tools.utils import tool_registry
from verl.tools.utils.mcp_clients import McpClientManager
from verl.tools.utils.mcp_clients.utils import TokenBucket, mcp2openai
from verl.tools.utils.tool_registry import initialize_tools_from_config

SERVER = str(Path(__file__).with_name("fixture_server.py"))


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    """Each test's servers files and tool names in a manager of its own (the process-wide one is upstream's)."""
    manager = McpClientManager.MCPClientManager()
    monkeypatch.setattr(McpClientManager, "ClientManager", manager)
    return manager


def stdio_servers(tmp_path, name="servers.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"mcpServers": {"fixture": {"command": sys.executable, "args": [SERVER]}}}))
    return path


def tool_config(tmp_path, text: str) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def one_mcp_entry(
    tmp_path,
    servers,
    config: str,
    selected: str | None = None,
    class_name: str = "verl.tools.mcp_base_tool.MCPBaseTool",
) -> str:
    """A tool config of one MCP entry: the class, `config` (YAML flow), the servers file, the selection."""
    selection = f", tool_selected_list: {selected}" if selected else ""
    return tool_config(
        tmp_path,
        f"tools:\n  - class_name: {class_name}\n"
        f"    config: {config}\n    mcp: {{mcp_servers_config_path: {servers}{selection}}}\n",
    )


def run(coro):
    return asyncio.run(coro)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- rate limiter


def test_token_bucket_allows_bursts_of_rate_and_refills_at_rate_per_second():
    now = [100.0]
    bucket = TokenBucket(2, clock=lambda: now[0])
    assert [bucket.acquire() for _ in range(3)] == [True, True, False]  # a burst of 2, then empty
    assert bucket.seconds_until_available() == pytest.approx(0.5)  # one token at 2/s
    now[0] += 0.25  # half a token
    assert not bucket.acquire()
    now[0] += 0.25
    assert bucket.acquire()
    now[0] += 100.0  # refills to the capacity (2), not to 200 tokens
    assert [bucket.acquire() for _ in range(3)] == [True, True, False]


@pytest.mark.parametrize("rate", [0, -1, None])
def test_token_bucket_refuses_a_rate_that_is_not_positive(rate):
    with pytest.raises(ValueError, match="rate_limit=.* must be a positive number"):
        TokenBucket(rate)


def test_mcp2openai_gives_the_openai_function_schema_without_touching_the_servers_tool():
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    tool = Tool(name="find", description=None, input_schema=schema)
    assert mcp2openai(tool) == {
        "type": "function",
        "function": {
            "name": "find",
            "description": "",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": []},
            "strict": False,
        },
    }
    assert "required" not in schema


# ---------------------------------------------------------------------------------------------- stdio server


def test_an_mcp_entry_becomes_one_tool_per_server_tool_with_the_servers_schema(tmp_path):
    stdio_servers(tmp_path)
    path = tool_config(
        tmp_path,
        """
        tools:
          - class_name: verl.tools.mcp_base_tool.MCPBaseTool
            config: {type: mcp, rate_limit: 50, timeout: 20}
            mcp: {mcp_servers_config_path: servers.json}
          - class_name: tests.tools.utils.test_tool_registry.multiply
        """,
    )
    tools = initialize_tools_from_config(path)  # servers.json is found next to the tool config
    assert [t.name for t in tools] == ["search", "whoami", "fail", "count", "calculator", "multiply"]
    search = tools[0]
    assert isinstance(search, MCPBaseTool) and search.timeout == 20 and search.timeout_s == 20.0
    assert search.config == {"type": "mcp", "rate_limit": 50, "timeout": 20}
    assert search.schema_dict()["function"]["description"] == "Search the fixture corpus."
    parameters = search.schema_dict()["function"]["parameters"]
    assert parameters["properties"] == {"query": {"type": "string"}, "top_k": {"type": "integer", "default": 2}}
    assert parameters["required"] == ["query"]

    async def episode():
        instance, _ = await search.create()
        response, reward, metrics = await search.execute(instance, {"query": "cats", "top_k": 1})
        failed, _, fail_metrics = await tools[2].execute(instance, {"code": 7})
        rewards = await search.calc_reward(instance)
        await search.release(instance)
        return response, reward, metrics, failed, fail_metrics, rewards, instance in search._instance_dict

    response, reward, metrics, failed, fail_metrics, rewards, kept = run(episode())
    hit = {"title": "cats #0", "url": "https://example.org/0", "tags": ["cats", "0"]}
    assert response.text == json.dumps({"query": "cats", "results": [hit]})  # the text part, whole
    assert reward == 0.0
    assert metrics == {"query_count": 0, "status": "unknown", "total_results": 0, "api_request_error": None}
    # the server reports the tool's exception as an error result; the model reads its text (upstream's)
    assert failed.text == "Error calling tool 'fail': fixture failure 7"
    assert fail_metrics["api_request_error"] is None
    assert rewards == [response.text]  # upstream's calc_reward: the instance's result texts
    assert not kept


def test_mcp_search_tool_keeps_the_result_lists_and_counts_queries_and_results(tmp_path):
    servers = stdio_servers(tmp_path)
    config = "{type: mcp, rate_limit: 50, timeout: 20}"
    path = one_mcp_entry(tmp_path, servers, config, "[search]", class_name="verl.tools.mcp_search_tool.MCPSearchTool")
    (search,) = initialize_tools_from_config(path)
    assert isinstance(search, MCPSearchTool) and search.name == "search"

    async def call():
        instance, _ = await search.create()
        return await search.execute(instance, {"query": "dogs", "top_k": 3})

    response, _, metrics = run(call())
    hits = [{"title": f"dogs #{i}", "url": f"https://example.org/{i}", "tags": ["dogs", str(i)]} for i in range(3)]
    assert json.loads(response.text) == hits  # the whole list: the nested tag lists do not cut it
    assert metrics == {"query_count": 1, "status": "success", "total_results": 3, "api_request_error": None}


def test_mcp_search_parser_on_hand_written_answers():
    tool = MCPSearchTool({}, {"type": "function", "function": {"name": "s"}})
    python_repr = "{'query': 'rain', 'results': [{'title': 'a', 'body': 'x [1] y'}, {'title': 'b'}]}"
    text, meta = tool._parse_tool_result(
        [
            TextContent(type="text", text=python_repr),
            TextContent(type="text", text='{"query": "sun", "results": []}'),
            TextContent(type="text", text="no results here"),
        ]
    )
    # single quotes read as double quotes, each list cut at its own bracket (not at the "]" inside a string)
    assert text == '[{"title": "a", "body": "x [1] y"}, {"title": "b"}][]'
    assert meta["queries"] == ["rain", "sun", ""]
    assert (meta["query_count"], meta["total_results"], meta["status"]) == (3, 2, "success")


def test_calls_wait_for_the_rate_limit(tmp_path):
    servers = stdio_servers(tmp_path)
    path = one_mcp_entry(tmp_path, servers, "{type: mcp, rate_limit: 2}", "[count]")
    (count,) = initialize_tools_from_config(path)

    async def five_calls():
        start = time.monotonic()
        answers = await asyncio.gather(*(count.execute("i", {}) for _ in range(5)))
        return time.monotonic() - start, sorted(int(a[0].text) for a in answers)

    elapsed, answers = run(five_calls())
    assert answers == [1, 2, 3, 4, 5]  # every call reached the server, one session
    # 2 calls a second with a burst of 2: the 5th call gets its token 1.5 s after the first
    assert elapsed >= 1.5


# ---------------------------------------------------------------------------------------------- SSE server


@pytest.fixture
def sse_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--sse", str(port)])
    yield port, proc
    proc.terminate()
    proc.wait(timeout=30)


def test_an_sse_server_with_auth_token_gets_the_bearer_header(tmp_path, sse_server):
    port, proc = sse_server
    servers = tmp_path / "remote.json"
    servers.write_text(
        json.dumps({"mcpServers": {"remote": {"url": f"http://127.0.0.1:{port}/sse", "auth_token": "s3cret"}}})
    )
    path = one_mcp_entry(tmp_path, servers, "{type: mcp, rate_limit: 10}", "[whoami, search]")
    search, whoami = initialize_tools_from_config(path)  # retried while the server starts; the server's order
    assert (search.name, whoami.name) == ("search", "whoami")
    response, _, metrics = run(whoami.execute("i", {}))
    assert response.text == "Bearer s3cret" and metrics["api_request_error"] is None

    proc.terminate()
    proc.wait(timeout=30)
    response, reward, metrics = run(search.execute("i", {"query": "x"}))
    # the server is gone: the model reads that the call failed, the rollout goes on
    # (fastmcp raises a RuntimeError naming the failed connection: upstream's catch-all text, as there)
    assert response.text.startswith("\n An unexpected error occurred: ") and "connect" in response.text
    assert metrics["api_request_error"] == response.text and reward == 0.0


# ---------------------------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize(
    ("entry", "error", "match"),
    [
        ("mcp: {mcp_servers_config_path: SERVERS, tool_selected_list: [search, serch]}", ValueError,
         r"do not offer: \['serch'\]; they offer \['search', 'whoami', 'fail', 'count', 'calculator'\]"),
        ("mcp: {mcp_servers_config_path: nowhere.json}", FileNotFoundError, "nowhere.json.* is not a file"),
        ("mcp: {mcp_servers_config_path: SERVERS, tools: [search]}", ValueError,
         "mcp_servers_config_path \\(required\\) and tool_selected_list; got \\['mcp_servers_config_path', 'tools'\\]"),
        ("mcp: {tool_selected_list: [search]}", ValueError, "mcp_servers_config_path \\(required\\)"),
        ("mcp: {mcp_servers_config_path: SERVERS}\n    tool_schema: {type: function, function: {name: s}}",
         ValueError, r"unknown keys \['tool_schema'\]; an MCP entry has class_name, config and mcp"),
    ],
)  # fmt: skip
def test_mistakes_in_an_mcp_entry_are_explained(tmp_path, entry, error, match):
    servers = stdio_servers(tmp_path)
    path = tool_config(
        tmp_path,
        "tools:\n  - class_name: verl.tools.mcp_base_tool.MCPBaseTool\n    config: {type: mcp}\n    "
        + entry.replace("SERVERS", str(servers))
        + "\n",
    )
    with pytest.raises(error, match=match):
        initialize_tools_from_config(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "is not valid JSON"),
        ('{"servers": {}}', "needs a non-empty 'mcpServers' object"),
        ('{"mcpServers": {"a": "python server.py"}}', r"servers \['a'\] must be JSON objects"),
        ('{"mcpServers": {"a": {"auth_token": "t"}}}', "server 'a' has an auth_token but no url"),
    ],
)
def test_a_bad_servers_file_is_explained(tmp_path, content, match):
    (tmp_path / "servers.json").write_text(content)
    path = one_mcp_entry(tmp_path, "servers.json", "{type: mcp}")
    with pytest.raises(ValueError, match=match):
        initialize_tools_from_config(path)


def test_one_servers_file_with_two_rate_limits_is_refused(tmp_path):
    servers = stdio_servers(tmp_path)
    path = tool_config(
        tmp_path,
        f"""
        tools:
          - class_name: verl.tools.mcp_base_tool.MCPBaseTool
            config: {{type: mcp, rate_limit: 5}}
            mcp: {{mcp_servers_config_path: {servers}, tool_selected_list: [search]}}
          - class_name: verl.tools.mcp_base_tool.MCPBaseTool
            config: {{type: mcp, rate_limit: 6}}
            mcp: {{mcp_servers_config_path: {servers}, tool_selected_list: [count]}}
        """,
    )
    with pytest.raises(ValueError, match=r"different config.rate_limit values \(5.0 and 6.0\)"):
        initialize_tools_from_config(path)


def test_an_unreachable_server_fails_after_the_retries(tmp_path, monkeypatch):
    monkeypatch.setattr(tool_registry, "MCP_CONNECT_ATTEMPTS", 2)
    monkeypatch.setattr(tool_registry, "MCP_RETRY_INTERVAL_S", 0.01)
    servers = tmp_path / "down.json"
    servers.write_text(
        json.dumps({"mcpServers": {"down": {"url": f"http://127.0.0.1:{free_port()}/sse", "auth_token": "t"}}})
    )
    path = one_mcp_entry(tmp_path, servers, "{type: mcp}")
    with pytest.raises(RuntimeError, match="no tools from the MCP servers of .*down.json.* after 2 attempts"):
        initialize_tools_from_config(path)


def test_a_native_entry_with_an_mcp_section_is_explained(tmp_path):
    path = tool_config(
        tmp_path,
        """
        tools:
          - class_name: verl.tools.mcp_base_tool.MCPBaseTool
            mcp: {mcp_servers_config_path: servers.json}
        """,
    )
    with pytest.raises(ValueError, match="an entry with an `mcp:` section is an MCP tool; set config.type: mcp"):
        initialize_tools_from_config(path)
