"""A real MCP server for the MCP tools' tests (FastMCP, stdio by default, SSE with `--sse PORT`).

Tools: `search(query, top_k=2)` answers upstream's search-server shape (`{"query", "results": [{"title", ...}]}`)
with `top_k` deterministic hits; `whoami()` answers the request's Authorization header ("none" over stdio);
`fail(code)` raises, so the server reports the call as an error; `count()` answers how many calls the server has
run so far (the rate limit's test reads it); `calculator(expression)` is the examples' calculator
(`verl.tools.calculator_tool.calculate`) served over MCP (the multi-turn main_ppo test trains with it).
"""

from __future__ import annotations

import argparse
import json

from fastmcp import FastMCP
from fastmcp.server.dependencies import get_http_headers

from verl.tools.calculator_tool import calculate

server = FastMCP("search-fixture")
calls = {"n": 0}


@server.tool
def search(query: str, top_k: int = 2) -> str:
    """Search the fixture corpus."""
    calls["n"] += 1
    hits = [
        {"title": f"{query} #{i}", "url": f"https://example.org/{i}", "tags": [query, str(i)]} for i in range(top_k)
    ]
    return json.dumps({"query": query, "results": hits})


@server.tool
def whoami() -> str:
    """The Authorization header of the request."""
    calls["n"] += 1
    return get_http_headers(include={"authorization"}).get("authorization", "none")


@server.tool
def fail(code: int) -> str:
    """Always raises."""
    calls["n"] += 1
    raise ValueError(f"fixture failure {code}")


@server.tool
def count() -> int:
    """Calls served so far."""
    calls["n"] += 1
    return calls["n"]


@server.tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."""
    calls["n"] += 1
    return calculate(expression)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sse", type=int, default=None, help="serve SSE on 127.0.0.1:PORT instead of stdio")
    args = parser.parse_args()
    if args.sse is None:
        server.run(show_banner=False, log_level="WARNING")
    else:
        server.run(transport="sse", host="127.0.0.1", port=args.sse, show_banner=False, log_level="WARNING")
