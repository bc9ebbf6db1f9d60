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

`config.type` is upstream's tool type: `native` (the default) or `mcp`. MCP tools (upstream's
`MCPBaseTool`, `MCPSearchTool`: schemas fetched from MCP servers through the `fastmcp` client, an
entry's `mcp: {mcp_servers_config_path: ...}`) are not implemented here; such an entry is refused
with a message saying so, rather than failing on the unknown `mcp` key.
"""

from __future__ import annotations

import importlib
import inspect
import os

from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import FunctionTool

_MCP_REASON = (
    "upstream's MCP tools fetch their schemas from MCP servers through the fastmcp client, which is not "
    "implemented here; wrap the service in a native tool (a BaseTool subclass or a plain function) instead"
)
NOT_IMPLEMENTED_UPSTREAM_TOOLS = {
    "verl.tools.image_zoom_in_tool": "upstream's ImageZoomInTool answers with images (ToolResponse.image), and this "
    "verl's agent loop takes text-only tool answers",
    "verl.tools.mcp_base_tool": _MCP_REASON,
    "verl.tools.mcp_search_tool": _MCP_REASON,
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


def build_tool(entry: dict, where: str = "tool") -> BaseTool:
    """One tool from one `tools:` entry."""
    if not isinstance(entry, dict) or "class_name" not in entry:
        raise ValueError(f"{where}: each entry of `tools:` needs a class_name, got {entry!r}")
    tool_type = (entry.get("config") or {}).get("type", "native")
    if tool_type == "mcp" or "mcp" in entry:
        raise NotImplementedError(
            f"{where}: MCP tools (config.type: mcp, class_name={entry['class_name']!r}) are not supported by this "
            f"verl: {_MCP_REASON} (config.type: native)"
        )
    if tool_type != "native":
        raise ValueError(f"{where}: config.type={tool_type!r} is not a tool type; use native (or omit it)")
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
    tools = [build_tool(entry, where=f"{path}, tools[{i}]") for i, entry in enumerate(entries)]
    names = [tool.name for tool in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tool config {path!r} declares these tool names more than once: {duplicates}")
    return tools
