"""Calling a Search-R1 style retrieval service, and the text the model reads (upstream verl's names).

The service's API (upstream's `retrieval_server.py`, and `python -m verl.tools.retrieval_service`):

    POST <url>  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
    -> {"result": [[{"document": {"id": ..., "contents": "Title\\nText"}, "score": 1.2}, ...], ...]}

one list of hits per query. `call_search_api` POSTs one batch, retrying (with a growing delay:
`INITIAL_RETRY_DELAY` x attempt seconds, up to `MAX_RETRIES` attempts) on a connection error, a
timeout and HTTP 500/502/503/504; a 4xx or a reply that is not JSON ends it at once.
`perform_single_search_batch` turns the hits into the text the model reads, each query's hits as

    Doc 1 (Title: <first line of contents>)
    <rest of contents>

queries separated by `\\n---\\n`, wrapped as the JSON `{"result": "<that text>"}` as upstream does
(also for errors: `{"result": "Search error: ..."}`), plus a metadata dict for metrics.

Differences from upstream: the standard library's urllib instead of `requests` (no extra dependency);
a 4xx error carries the service's reply body, which says what was wrong with the request.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

DEFAULT_TIMEOUT = 30
"""Seconds one HTTP request may take."""
MAX_RETRIES = 10
INITIAL_RETRY_DELAY = 1
RETRY_STATUS_CODES = (500, 502, 503, 504)

logger = logging.getLogger(__name__)


def call_search_api(
    retrieval_service_url: str,
    query_list: list[str],
    topk: int = 3,
    return_scores: bool = True,
    timeout: int = DEFAULT_TIMEOUT,
) -> tuple[dict[str, Any] | None, str | None]:
    """(reply JSON, None) on success, (None, what went wrong) after the retries (module docstring)."""
    payload = json.dumps({"queries": list(query_list), "topk": topk, "return_scores": return_scores}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    last_error = None
    for attempt in range(1, MAX_RETRIES + 1):
        request = urllib.request.Request(retrieval_service_url, data=payload, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
            try:
                return json.loads(body), None
            except ValueError as e:
                return None, f"the retrieval service's reply is not JSON ({e}): {body[:200]!r}"
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            last_error = f"HTTP {e.code} from {retrieval_service_url}: {detail}"
            if e.code not in RETRY_STATUS_CODES:
                return None, last_error
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            last_error = f"cannot reach the retrieval service at {retrieval_service_url}: {reason}"
        logger.warning("search attempt %d/%d failed: %s", attempt, MAX_RETRIES, last_error)
        if attempt < MAX_RETRIES:
            time.sleep(INITIAL_RETRY_DELAY * attempt)
    return None, f"{last_error} (after {MAX_RETRIES} attempts)"


def _passages2string(retrieval_result: list[dict[str, Any]]) -> str:
    """One query's hits as the numbered `Doc i (Title: ...)` blocks the model reads."""
    blocks = []
    for idx, hit in enumerate(retrieval_result, start=1):
        title, _, text = hit["document"]["contents"].partition("\n")
        blocks.append(f"Doc {idx} (Title: {title})\n{text}")
    return "\n\n".join(blocks).strip()


def perform_single_search_batch(
    retrieval_service_url: str,
    query_list: list[str],
    topk: int = 3,
    concurrent_semaphore: threading.Semaphore | None = None,
    timeout: int = DEFAULT_TIMEOUT,
) -> tuple[str, dict[str, Any]]:
    """(result text for the model, metadata) for one batch of queries (module docstring)."""
    if concurrent_semaphore is not None:
        with concurrent_semaphore:
            api_response, error = call_search_api(retrieval_service_url, query_list, topk, True, timeout)
    else:
        api_response, error = call_search_api(retrieval_service_url, query_list, topk, True, timeout)
    metadata: dict[str, Any] = {
        "query_count": len(query_list),
        "queries": query_list,
        "api_request_error": error,
        "api_response": api_response,
        "status": "unknown",
        "total_results": 0,
        "formatted_result": None,
    }
    if error is not None:
        metadata["status"] = "api_error"
        return json.dumps({"result": f"Search error: {error}"}, ensure_ascii=False), metadata
    try:
        raw_results = api_response.get("result", [])
        if not raw_results:
            metadata["status"] = "no_results"
            return json.dumps({"result": "No search results found."}, ensure_ascii=False), metadata
        formatted = "\n---\n".join(_passages2string(hits) for hits in raw_results)
        metadata.update(
            status="success", total_results=sum(len(hits) for hits in raw_results), formatted_result=formatted
        )
        return json.dumps({"result": formatted}, ensure_ascii=False), metadata
    except (AttributeError, KeyError, TypeError) as e:
        metadata["status"] = "processing_error"
        message = f"Error processing search results: the reply does not have the expected layout ({e!r})"
        return json.dumps({"result": message}, ensure_ascii=False), metadata
