"""`MCPBaseTool`: a tool served by an MCP server (upstream verl's class, its names and answers).

Tool config (upstream's `mcp_tool_config.yaml`):

    tools:
      - class_name: verl.tools.mcp_search_tool.MCPSearchTool   # or verl.tools.mcp_base_tool.MCPBaseTool
        config: {type: mcp, rate_limit: 120, timeout: 120}
        mcp:
          mcp_servers_config_path: ./mcp_server.json   # {"mcpServers": {...}}, see McpClientManager
          tool_selected_list: [tavily_search_tool]      # optional: default every tool the servers offer

One entry becomes one tool object per MCP tool the servers offer (selected), each with the schema the server
publishes (`verl.tools.utils.tool_registry`). `execute(instance_id, parameters)` runs the call through
`verl.tools.utils.mcp_clients.McpClientManager.ClientManager` (rate-limited, bounded by `config.timeout`,
default 30 s) and answers `(ToolResponse(text=...), 0.0, metrics)` with upstream's metrics `query_count`,
`status`, `total_results`, `api_request_error`. The text is the result's text parts joined by spaces
(`_parse_tool_result`, which subclasses override for a server's own format, as `MCPSearchTool` does); a call
that fails answers upstream's texts ("\\n Tool call failed: ..." for an error the server or client raised,
"\\n Connection failed: ..." when the server cannot be reached, "\\n An unexpected error occurred: ..."). A
tool whose server reports the call as an error (`isError`) answers the server's text, as upstream's.
`calc_reward` returns the list of the instance's result texts (upstream's; not a number).

Needs the fastmcp client (`pip install 'verl[mcp]'`).
"""

from __future__ import annotations

import json
import logging
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.tools.utils.mcp_clients import McpClientManager
from verl.utils.rollout_trace import rollout_trace_op

logger = logging.getLogger(__name__)

__all__ = ["MCPBaseTool"]

DEFAULT_MCP_TIMEOUT_S = 30


def _client_error_types() -> tuple[type[BaseException], ...]:
    try:
        from fastmcp.exceptions import ClientError, McpError
    except ImportError:  # fastmcp < 2.x names; the generic branch then answers
        return ()
    return (ClientError, McpError)


class MCPBaseTool(BaseTool):
    """One MCP tool: its schema is the server's, its calls go to the server (module docstring)."""

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | dict | None):
        config = dict(config or {})
        config.setdefault("timeout", DEFAULT_MCP_TIMEOUT_S)
        super().__init__(config, tool_schema)
        self.timeout = self.config["timeout"]
        self._instance_dict: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "reward": []}
        return instance_id, ToolResponse()

    async def _call_tool(self, instance_id: str, parameters: dict[str, Any]) -> tuple[str, dict]:
        """(text, metadata) of one call; a failure's text says what failed, in `metadata["api_request_error"]`."""
        try:
            result = await McpClientManager.ClientManager.call_tool(self.name, parameters, self.timeout)
        except _client_error_types() as e:
            error = f"\n Tool call failed: {e}"
        except (ConnectionError, OSError) as e:
            error = f"\n Connection failed: {e}"
        except Exception as e:  # the model reads why the call failed; the rollout goes on
            error = f"\n An unexpected error occurred: {e}"
        else:
            text, metadata = self._parse_tool_result(result.content)
            metadata["api_request_error"] = None
            return text, metadata
        logger.warning("MCP tool %s (instance %s) failed:%s", self.name, instance_id, error)
        return error, {"api_request_error": error}

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        if not self.name or parameters is None:
            message = "Error: 'parameters' is missing or empty."
            return ToolResponse(text=json.dumps({"result": message})), 0.0, {}
        try:
            text, metadata = await self._call_tool(instance_id, parameters)
            self._instance_dict.setdefault(instance_id, {"response": "", "reward": []})["reward"].append(text.strip())
        except Exception as e:  # a subclass's parser failing
            logger.error("MCP tool %s: execution failed: %s", self.name, e)
            return ToolResponse(text=json.dumps({"result": f"Tool execution failed: {e}"})), 0.0, {"error": str(e)}
        metrics = {
            "query_count": metadata.get("query_count", 0),
            "status": metadata.get("status", "unknown"),
            "total_results": metadata.get("total_results", 0),
            "api_request_error": metadata.get("api_request_error"),
        }
        return ToolResponse(text=text), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs) -> list[str]:
        return self._instance_dict[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)

    def _parse_tool_result(self, content: list) -> tuple[str, dict]:
        """(text, metadata) of a result's content parts: the text parts joined by spaces, no metadata."""
        return " ".join(part.text for part in content if getattr(part, "type", None) == "text"), {}
