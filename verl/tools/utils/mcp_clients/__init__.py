"""MCP clients for the tools of `config.type: mcp` tool config entries (upstream's `verl.tools.utils.mcp_clients`).

`McpClientManager.ClientManager` connects to the servers of an `mcp_server.json` file through the `fastmcp`
client (`pip install 'verl[mcp]'`), lists their tools and runs calls under a rate limit; `utils` holds the
rate limiter (`TokenBucket`) and the MCP-to-OpenAI schema conversion (`mcp2openai`).
"""
