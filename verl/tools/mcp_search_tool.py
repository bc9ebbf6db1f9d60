"""`MCPSearchTool`: an MCP search server's answers cut down to their result lists (upstream verl's class).

A search server (Tavily's, for one) answers text parts holding a JSON (or Python-repr) object such as
`{"query": "...", "results": [{"title": ..., "url": ..., "content": ...}, ...]}`. The tool's text is the
`results` lists of the parts, concatenated; its metadata counts the parts' queries (`queries`, `query_count`)
and their results (`total_results`: the `"title":` keys seen), as upstream's. Single quotes are read as double
quotes first (upstream's rule, so Python-repr answers parse; it also rewrites apostrophes inside the text).

Differs from upstream's: the `results` list is cut at its own closing bracket, brackets inside strings and
nested lists included (upstream's pattern stops at the first `]`, truncating a result that holds a list).
"""

from __future__ import annotations

import re

from verl.tools.mcp_base_tool import MCPBaseTool

__all__ = ["MCPSearchTool"]

_QUERY = re.compile(r'query"\s*:\s*"([^"]+)"')
_TITLE = re.compile(r'"title"\s*:')
_RESULTS = re.compile(r'"results"\s*:\s*\[')


def _balanced_list(text: str, start: int) -> str:
    """The JSON list that opens at `text[start] == "["`, up to its own closing bracket (strings skipped);
    the rest of the text when it never closes."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return text[start:]


class MCPSearchTool(MCPBaseTool):
    """An MCP search tool (module docstring)."""

    def _parse_tool_result(self, content: list) -> tuple[str, dict]:
        results, total, queries = [], 0, []
        for part in content:
            if getattr(part, "type", None) != "text":
                continue
            text = part.text.replace("'", '"')
            query = _QUERY.search(text)
            queries.append(query.group(1) if query else "")
            total += len(_TITLE.findall(text))
            opened = _RESULTS.search(text)
            if opened:
                results.append(_balanced_list(text, opened.end() - 1))
        metadata = {
            "api_request_error": "",
            "status": "success",
            "queries": queries,
            "query_count": len(queries),
            "total_results": total,
        }
        return "".join(results), metadata
