"""The MCP servers of the tool configs, through the `fastmcp` client (upstream's `MCPClientManager`).

A servers file is upstream's JSON (`mcp_servers_config_path`, Claude-desktop style):

    {"mcpServers": {
        "search": {"url": "https://.../sse", "auth_token": "..."},
        "local": {"command": "python", "args": ["my_server.py"]}}}

A server with an `auth_token` gets its own SSE client that sends `Authorization: Bearer <token>`; the others
(`command` + `args` for stdio, `url` for HTTP/SSE, whatever fastmcp's MCP config takes) share one client, which
names their tools `<server>_<tool>` when there are several of them (fastmcp's rule). Every call opens the
client's session for its duration (`async with`): concurrent calls on one event loop share it, and the client
never outlives the event loop that used it (the schemas are fetched on a loop of their own, the calls run on
the agent loop's).

`ClientManager` is the process-wide manager the MCP tools call. Differences from upstream's: each servers file
is read once (upstream reads only the first one any tool config names and silently drops the rest) and keeps
the rate limit of its entry (one `TokenBucket` per file; the same file with another rate limit is an error);
the `timeout` a tool passes bounds the call (upstream's is not applied); a missing or unreadable file, a
server entry that is not a JSON object, and a tool name two servers share are errors that say so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from verl.tools.utils.mcp_clients.utils import TokenBucket, mcp2openai

logger = logging.getLogger(__name__)

INSTALL_HINT = "MCP tools need the fastmcp client: pip install 'verl[mcp]' (or pip install fastmcp)"


def import_fastmcp():
    """(Client, SSETransport) from fastmcp, or an ImportError that says how to install it."""
    try:
        from fastmcp import Client
        from fastmcp.client.transports import SSETransport
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return Client, SSETransport


class MCPClientManager:
    """The clients of every servers file the tool configs name, which client serves which tool, and the rate
    limiters (see the module docstring)."""

    rootServerName = "mcpServers"

    def __init__(self):
        self.clients: list = []
        self.tool_client_mapping: dict[str, Any] = {}
        self.rate_limiter: TokenBucket | None = None  # the first file's (upstream's attribute)
        self.initialized = False
        self._files: dict[str, dict] = {}  # real path -> {"clients": [...], "limiter": TokenBucket, "rate": float}
        self._limiters: dict[int, TokenBucket] = {}  # id(client) -> its file's limiter

    async def initialize(self, config_path: str, rate_limit: float = 10.0) -> None:
        """Connect (lazily) to the servers of `config_path`, calls to them limited to `rate_limit` a second."""
        path = os.path.realpath(os.path.expanduser(str(config_path)))
        rate = float(rate_limit) if rate_limit is not None else 10.0
        known = self._files.get(path)
        if known is not None:
            if known["rate"] != rate:
                raise ValueError(
                    f"MCP servers file {config_path!r} is named by tool config entries with different "
                    f"config.rate_limit values ({known['rate']} and {rate}); the limit is per servers file, give "
                    "the entries the same rate_limit"
                )
            return
        Client, SSETransport = import_fastmcp()
        servers = self._load_config(path)[self.rootServerName]
        clients, shared = [], {}
        for name, server in servers.items():
            if "auth_token" in server:
                if "url" not in server:
                    raise ValueError(f"MCP servers file {config_path!r}: server {name!r} has an auth_token but no url")
                headers = {"Authorization": f"Bearer {server['auth_token']}"}
                clients.append(Client(SSETransport(url=server["url"], headers=headers)))
            else:
                shared[name] = server
        if shared:
            clients.append(Client({self.rootServerName: shared}))
        limiter = TokenBucket(rate)
        self._files[path] = {"clients": clients, "limiter": limiter, "rate": rate}
        for client in clients:
            self._limiters[id(client)] = limiter
        self.clients.extend(clients)
        if self.rate_limiter is None:
            self.rate_limiter = limiter
        self.initialized = True

    def clients_of(self, config_path: str) -> list:
        """The clients `initialize(config_path)` made."""
        return list(self._files[os.path.realpath(os.path.expanduser(str(config_path)))]["clients"])

    async def fetch_tool_schemas(self, tool_selected_list: list[str] | None, clients: list | None = None) -> list[dict]:
        """OpenAI schemas of the tools the servers offer (of `clients`, default every client), only those named
        in `tool_selected_list` when it is non-empty; each tool is mapped to the client that serves it."""
        selected = set(tool_selected_list or ())
        schemas = []
        for client in self.clients if clients is None else clients:
            async with client:
                listed = await client.list_tools_mcp()
            for tool in listed.tools:
                if selected and tool.name not in selected:
                    continue
                owner = self.tool_client_mapping.get(tool.name)
                if owner is not None and owner is not client:
                    raise ValueError(
                        f"MCP tool {tool.name!r} is offered by two servers; tool names must be unique (select one "
                        "with mcp.tool_selected_list, or give the servers separate tool config entries and files)"
                    )
                self.tool_client_mapping[tool.name] = client
                schemas.append(mcp2openai(tool))
        return schemas

    async def call_tool(self, tool_name: str, parameters: dict, timeout: float | None):
        """The server's `CallToolResult` for one call, once the rate limit allows it, bounded by `timeout` s."""
        client = self.get_client_with_tool_name(tool_name)
        limiter = self._limiters.get(id(client)) or self.rate_limiter
        if limiter is not None:
            while not limiter.acquire():
                await asyncio.sleep(max(limiter.seconds_until_available(), 0.01))
        async with client:
            return await client.call_tool_mcp(tool_name, parameters, timeout=timeout)

    def get_client_with_tool_name(self, tool_name: str):
        try:
            return self.tool_client_mapping[tool_name]
        except KeyError:
            raise KeyError(
                f"no MCP server offers a tool named {tool_name!r} (known: {sorted(self.tool_client_mapping)}); "
                "its tool config entry must be loaded first (initialize_tools_from_config)"
            ) from None

    def _load_config(self, file: str) -> dict[str, Any]:
        """The servers file as a dict with a `mcpServers` object of server objects; errors name the file."""
        try:
            with open(file) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"MCP servers file {file!r} (mcp.mcp_servers_config_path) does not exist; it is a JSON file "
                '{"mcpServers": {"<name>": {"url": ..., "auth_token": ...} or {"command": ..., "args": [...]}}}'
            ) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"MCP servers file {file!r} is not valid JSON: {e}") from e
        servers = config.get(self.rootServerName) if isinstance(config, dict) else None
        if not isinstance(servers, dict) or not servers:
            raise ValueError(f"MCP servers file {file!r} needs a non-empty {self.rootServerName!r} object of servers")
        bad = sorted(name for name, server in servers.items() if not isinstance(server, dict))
        if bad:
            raise ValueError(f"MCP servers file {file!r}: servers {bad} must be JSON objects")
        return config


ClientManager = MCPClientManager()
