"""A local retrieval service with upstream's `/retrieve` API: BM25 over a JSONL corpus, standard library only.

    python -m verl.tools.retrieval_service --corpus wiki.jsonl --port 8000
    # then the SearchTool's config: retrieval_service_url: http://127.0.0.1:8000/retrieve

For tests and offline users of `verl.tools.search_tool.SearchTool`. Upstream's retriever
(`examples/sglang_multiturn/search_r1_like/local_dense_retriever/retrieval_server.py`) is a dense
e5 + faiss server over the Search-R1 Wikipedia dump, with a GPU and tens of GB of index; this one
ranks by Okapi BM25 (k1=0.9, b=0.4, Pyserini's defaults) over lower-cased alphanumeric tokens, so
its hits differ from the dense retriever's, but the API and the corpus format are the same:

- corpus: JSON lines, each an object with a string `contents` (Search-R1's layout: `"Title"\\nText`)
  and any other fields (`id`, ...), returned as the hit's `document`;
- request: POST `/retrieve` `{"queries": [...], "topk": k, "return_scores": bool}` (`topk` defaults
  to `--topk`);
- reply: `{"result": [[{"document": {...}, "score": s}, ...], ...]}` with scores, one list per query,
  best first (ties in corpus order); without `return_scores`, the lists hold the documents
  themselves. Documents sharing no token with the query are not returned, so a list may be shorter
  than `topk`. A malformed request gets HTTP 400 naming the problem.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import re
from collections import Counter
from typing import Any

from verl.tools.utils.json_service import JsonPostService

_TOKEN_RE = re.compile(r"[0-9a-z]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text.lower())


class BM25Index:
    """Okapi BM25 over a list of documents, each a dict with a string `contents`."""

    def __init__(self, documents: list[dict[str, Any]], k1: float = 0.9, b: float = 0.4):
        for i, doc in enumerate(documents):
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                raise ValueError(
                    f"corpus document {i} must be a JSON object with a string 'contents', got {doc!r:.200}"
                )
        self.documents, self.k1, self.b = documents, float(k1), float(b)
        self._term_counts = [Counter(tokenize(doc["contents"])) for doc in documents]
        self._lengths = [sum(counts.values()) for counts in self._term_counts]
        self._avg_length = (sum(self._lengths) / len(documents)) if documents else 0.0
        self._postings: dict[str, list[int]] = {}
        for i, counts in enumerate(self._term_counts):
            for term in counts:
                self._postings.setdefault(term, []).append(i)

    def idf(self, term: str) -> float:
        n, df = len(self.documents), len(self._postings.get(term, ()))
        return math.log(1.0 + (n - df + 0.5) / (df + 0.5))

    def scores(self, query: str) -> dict[int, float]:
        """BM25 score of every document sharing a token with the query (a repeated query token counts once per repeat)."""
        scores: dict[int, float] = {}
        for term in tokenize(query):
            idf = self.idf(term)
            for i in self._postings.get(term, ()):
                tf = self._term_counts[i][term]
                norm = self.k1 * (1.0 - self.b + self.b * self._lengths[i] / self._avg_length)
                scores[i] = scores.get(i, 0.0) + idf * tf * (self.k1 + 1.0) / (tf + norm)
        return scores

    def search(self, query: str, topk: int) -> list[tuple[dict[str, Any], float]]:
        best = heapq.nsmallest(topk, self.scores(query).items(), key=lambda item: (-item[1], item[0]))
        return [(self.documents[i], score) for i, score in best]


def load_corpus(path: str) -> list[dict[str, Any]]:
    documents = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                documents.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{line_number} is not a JSON line: {e}") from e
    return documents


class RetrievalService(JsonPostService):
    """The service (module docstring); `start()` serves from a daemon thread, `url` is its `/retrieve` URL."""

    ENDPOINT = "/retrieve"

    def __init__(self, index: BM25Index, host: str = "127.0.0.1", port: int = 0, default_topk: int = 3):
        super().__init__(host, port)
        self.index, self.default_topk = index, int(default_topk)

    def handle(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self.retrieve(request)

    def retrieve(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, reply JSON) for one request (module docstring)."""
        queries = request.get("queries")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return 400, {"detail": "the request needs 'queries', a list of strings"}
        topk = request.get("topk")
        topk = self.default_topk if topk is None else topk
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            return 400, {"detail": f"'topk' must be a positive integer, got {topk!r}"}
        hits = [self.index.search(query, topk) for query in queries]
        if request.get("return_scores", False):
            return 200, {"result": [[{"document": doc, "score": score} for doc, score in q] for q in hits]}
        return 200, {"result": [[doc for doc, _ in q] for q in hits]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="JSONL file, one {'contents': ...} object a line")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3, help="hits per query when a request gives no topk")
    args = parser.parse_args(argv)
    service = RetrievalService(BM25Index(load_corpus(args.corpus)), args.host, args.port, args.topk)
    print(f"BM25 retrieval service over {len(service.index.documents)} documents at {service.url}", flush=True)
    service.serve_until_interrupted()


if __name__ == "__main__":
    main()
