"""Building tools from a tool config file (`actor_rollout_ref.rollout.multi_turn.tool_config_path`).

The YAML format is upstream verl's:

    tools:
      - class_name: verl.tools.calculator_tool.CalculatorTool
        config: {timeout: 5}
        tool_schema:
          type: function
          function:
            name: calculator
            description: Evaluate an arithmetic expression.
            parameters:
              type: object
              properties:
                expression: {type: string, description: for example 12+34*5}
              required: [expression]

`class_name` is the import path of a `BaseTool` subclass, built as `cls(config, tool_schema)`, or
of a plain function or async callable, wrapped in a `FunctionTool` (its schema derived from the
signature when `tool_schema` is omitted). `config` and `tool_schema` are optional for classes that
supply their own schema (the built-in calculator and Python sandbox do). `config.timeout` bounds
each call (seconds). Tool names must be unique.

`config.type` is upstream's tool type: `native` (the default) or `mcp`. An `mcp` entry (upstream's
`MCPBaseTool` / `MCPSearchTool` or a subclass) names a servers file instead of a schema:

    - class_name: verl.tools.mcp_search_tool.MCPSearchTool
      config: {type: mcp, rate_limit: 120, timeout: 120}
      mcp: {mcp_servers_config_path: ./mcp_server.json, tool_selected_list: [tavily_search_tool]}

and becomes one tool per MCP tool its servers offer (those of `tool_selected_list` when given), each built as
`cls(config, schema)` with the schema the server publishes (`verl.tools.utils.mcp_clients`). The schemas are
fetched on an event loop of their own (in a thread), so this works inside a running loop too; servers that are
still starting are retried (`MCP_CONNECT_ATTEMPTS` x `MCP_RETRY_INTERVAL_S`). A relative
`mcp_servers_config_path` is read from the working directory, else next to the tool config file. Differs from
upstream: a selected tool no server offers is an error naming the tools they do offer (upstream drops it),
`config.rate_limit` defaults to 10 calls a second (upstream's client manager default; its registry needs the
key), and a `tool_schema` on an MCP entry is refused (the server's schema is the one used).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import FunctionTool

logger = logging.getLogger(__name__)

MCP_CONNECT_ATTEMPTS = 10
MCP_RETRY_INTERVAL_S = 2.0
NOT_IMPLEMENTED_UPSTREAM_TOOLS = {
    "verl.tools.image_zoom_in_tool": "upstream's ImageZoomInTool answers with images (ToolResponse.image), and this "
    "verl's agent loop takes text-only tool answers",
}
"""Upstream tool modules this verl does not have, with the reason (docs/multi_turn.md#upstreams-tools)."""


def _import(path: str, where: str):
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}: class_name={path!r} must be an import path like my_pkg.tools.MyTool")
    if module_name in NOT_IMPLEMENTED_UPSTREAM_TOOLS:
        raise NotImplementedError(
            f"{where}: class_name={path!r} is not implemented: {NOT_IMPLEMENTED_UPSTREAM_TOOLS[module_name]}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"{where}: cannot import {module_name!r} for class_name={path!r}: {e}") from e
    if not hasattr(module, attr):
        raise AttributeError(f"{where}: module {module_name!r} has no {attr!r} (class_name={path!r})")
    return getattr(module, attr)


class ToolType(Enum):
    """Upstream's `config.type` values."""

    NATIVE = "native"
    MCP = "mcp"


def get_tool_class(cls_name: str):
    """Upstream's: the class (or function) at import path `cls_name`."""
    return _import(cls_name, "tool")


def _tool_type(entry, where: str) -> str:
    if not isinstance(entry, dict) or "class_name" not in entry:
        raise ValueError(f"{where}: each entry of `tools:` needs a class_name, got {entry!r}")
    tool_type = (entry.get("config") or {}).get("type", "native")
    if tool_type not in {t.value for t in ToolType}:
        raise ValueError(f"{where}: config.type={tool_type!r} is not a tool type; use native (or omit it) or mcp")
    if tool_type == "native" and "mcp" in entry:
        raise ValueError(f"{where}: an entry with an `mcp:` section is an MCP tool; set config.type: mcp")
    return tool_type


def build_tool(entry: dict, where: str = "tool") -> BaseTool:
    """One tool from one native `tools:` entry."""
    if _tool_type(entry, where) == "mcp":
        raise ValueError(f"{where}: an MCP entry (config.type: mcp) becomes several tools; use build_tools")
    unknown = set(entry) - {"class_name", "config", "tool_schema"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; an entry has class_name, config and tool_schema")
    target = _import(str(entry["class_name"]), where)
    config, schema = dict(entry.get("config") or {}), entry.get("tool_schema")
    if inspect.isclass(target) and issubclass(target, BaseTool):
        return target(config, schema)
    if callable(target) and not inspect.isclass(target):
        return FunctionTool(target, config=config, tool_schema=schema)
    raise TypeError(f"{where}: class_name={entry['class_name']!r} is neither a BaseTool subclass nor a function")


def build_tools(entry: dict, where: str = "tool", config_dir: str | None = None) -> list[BaseTool]:
    """The tools of one `tools:` entry: one for a native entry, one per selected server tool for an MCP entry
    (`config_dir`: the tool config file's directory, where a relative servers file is also looked for)."""
    if _tool_type(entry, where) == "native":
        return [build_tool(entry, where)]
    tool_cls = _import(str(entry["class_name"]), where)
    if not (inspect.isclass(tool_cls) and issubclass(tool_cls, BaseTool)):
        raise TypeError(f"{where}: class_name={entry['class_name']!r} of an MCP entry must be a BaseTool subclass")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcp tool list fetcher") as pool:
        return pool.submit(asyncio.run, initialize_mcp_tool(tool_cls, entry, where, config_dir)).result()


async def initialize_mcp_tool(tool_cls, tool_config, where: str = "tool", config_dir: str | None = None) -> list:
    """Upstream's: the tools of one MCP entry (`tool_config`: the entry, a dict or OmegaConf node), built as
    `tool_cls(config, schema)` for each selected tool its servers offer. Runs on the caller's event loop (the
    clients then belong to it until their calls end)."""
    if not isinstance(tool_config, dict):
        from omegaconf import OmegaConf

        tool_config = OmegaConf.to_container(tool_config, resolve=True)
    unknown = set(tool_config) - {"class_name", "config", "mcp"}
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {sorted(unknown)}; an MCP entry has class_name, config and mcp (its schemas "
            "come from the servers)"
        )
    mcp = tool_config.get("mcp") or {}
    if set(mcp) - {"mcp_servers_config_path", "tool_selected_list"} or "mcp_servers_config_path" not in mcp:
        raise ValueError(
            f"{where}: the mcp section has mcp_servers_config_path (required) and tool_selected_list; got {sorted(mcp)}"
        )
    servers_file = _servers_file(str(mcp["mcp_servers_config_path"]), config_dir, where)
    config = dict(tool_config.get("config") or {})
    schemas = await _fetch_mcp_schemas(servers_file, config, list(mcp.get("tool_selected_list") or []), where)
    return [tool_cls(dict(config), schema) for schema in schemas]


def _servers_file(path: str, config_dir: str | None, where: str) -> str:
    from verl.utils.fs import find_relative_file

    found, candidates = find_relative_file(path, ["", config_dir])  # "": the working directory
    if found is not None:
        return found
    raise FileNotFoundError(
        f"{where}: mcp.mcp_servers_config_path={path!r} is not a file (looked for {candidates}, working directory "
        f'{os.getcwd()!r}); it is a JSON file of MCP servers: {{"mcpServers": {{...}}}}'
    )


async def _fetch_mcp_schemas(servers_file: str, config: dict, selected: list[str], where: str) -> list[dict]:
    """The selected tools' schemas from the servers of `servers_file`, retrying while they start."""
    from verl.tools.utils.mcp_clients.McpClientManager import ClientManager

    await ClientManager.initialize(servers_file, config.get("rate_limit", 10.0))
    clients = ClientManager.clients_of(servers_file)
    last_error = None
    for attempt in range(MCP_CONNECT_ATTEMPTS):
        try:
            schemas = await ClientManager.fetch_tool_schemas(None, clients)
        except ValueError:  # two servers offer one name: no retry helps
            raise
        except Exception as e:  # a server still starting (connection refused), or down
            last_error = e
            logger.info("MCP servers of %s not ready (attempt %d): %s", servers_file, attempt + 1, e)
        else:
            if schemas:
                break
            last_error = None
        if attempt + 1 < MCP_CONNECT_ATTEMPTS:
            await asyncio.sleep(MCP_RETRY_INTERVAL_S)
    else:
        reason = f"the last attempt failed: {last_error!r}" if last_error else "they offer no tools"
        raise RuntimeError(
            f"{where}: no tools from the MCP servers of {servers_file!r} after {MCP_CONNECT_ATTEMPTS} attempts "
            f"{MCP_RETRY_INTERVAL_S:g} s apart; {reason}"
        )
    offered = [schema["function"]["name"] for schema in schemas]
    missing = [name for name in selected if name not in offered]
    if missing:
        raise ValueError(
            f"{where}: mcp.tool_selected_list names tools the servers of {servers_file!r} do not offer: {missing}; "
            f"they offer {offered}"
        )
    return [schema for schema in schemas if not selected or schema["function"]["name"] in selected]


def initialize_tools_from_config(tools_config_file: str) -> list[BaseTool]:
    """The tools listed in a tool config YAML file (module docstring), in file order."""
    from omegaconf import OmegaConf

    path = os.path.expanduser(str(tools_config_file))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_config_file!r} does not exist "
            f"(working directory {os.getcwd()!r}); point it at a YAML file with a `tools:` list"
        )
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"tool config {path!r} must have a top-level `tools:` list")
    config_dir = os.path.dirname(os.path.abspath(path))
    tools = [
        tool
        for i, entry in enumerate(entries)
        for tool in build_tools(entry, where=f"{path}, tools[{i}]", config_dir=config_dir)
    ]
    names = [tool.name for tool in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tool config {path!r} declares these tool names more than once: {duplicates}")
    return tools
