"""A one-endpoint JSON-over-HTTP service on the standard library: what the local stand-ins of the services
upstream's tools call are built on (`verl.tools.sandbox_fusion_service`'s `/run_code`,
`verl.tools.retrieval_service`'s `/retrieve`).

A subclass sets `ENDPOINT` and implements `handle(request) -> (HTTP status, reply JSON)`; the base answers
POST `ENDPOINT` with it, another path with 404, a body that is not a JSON object with 400 naming the problem,
and serves from a daemon thread (`start()` / `stop()`) or in the foreground (`serve_until_interrupted()`).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonPostService(ThreadingHTTPServer):
    ENDPOINT = "/"
    """The one path served (POST)."""

    daemon_threads = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), _Handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}{self.ENDPOINT}"

    def handle(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__}.handle")

    def start(self) -> JsonPostService:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, name=type(self).__name__, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def serve_until_interrupted(self) -> None:
        """Serve in this thread until Ctrl-C (the command line's)."""
        try:
            self.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: JsonPostService

    def log_message(self, *args) -> None:  # one line per request would drown a training log
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        endpoint = self.server.ENDPOINT
        if self.path.rstrip("/") != endpoint.rstrip("/"):
            self._reply(404, {"detail": f"unknown endpoint {self.path!r}; this service answers POST {endpoint}"})
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            self._reply(400, {"detail": f"the request body is not JSON: {e}"})
            return
        if not isinstance(request, dict):
            self._reply(400, {"detail": "the request body must be a JSON object"})
            return
        self._reply(*self.server.handle(request))
