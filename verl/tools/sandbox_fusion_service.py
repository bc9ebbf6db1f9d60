"""A local stand-in for the SandboxFusion code-execution service: its `run_code` API, Python only.

    python -m verl.tools.sandbox_fusion_service --port 8080      # then sandbox_fusion_url: http://127.0.0.1:8080/run_code

For users without SandboxFusion's docker image (ReTool's `sandbox_fusion_tool_config.yaml`, the
`reward_model.sandbox_fusion.url` code rewards) and for tests. It answers POST `/run_code` with the
JSON the real service gives, so `verl.utils.reward_score.sandbox_fusion.utils.call_sandbox_api` and
`verl.tools.sandbox_fusion_tools.SandboxFusionTool` cannot tell the difference:

- request: `code`, `stdin`, `language`, `run_timeout`, `memory_limit_MB` (`compile_timeout`, `files`
  and `fetch_files` are accepted and not used: Python compiles nothing, and no files are staged);
- reply: `status` "Success" (the program exited 0) or "Failed", `compile_result` null, `run_result`
  `{status: "Finished" | "TimeLimitExceeded", return_code, stdout, stderr, execution_time}`;
- a language other than `python` gets status "SandboxError" with a message saying so (the real
  service runs ~30 languages; this one runs only what our sandbox runs); a body that is not a JSON
  object with a string `code` gets HTTP 400 naming the problem.

Each request runs in its own thread through `verl.tools.sandbox_python_tool.run_python`. What that
isolates (see its module docstring): wall-clock and CPU time, memory (RLIMIT_AS), output size, files
outside a scratch directory, network (a new network namespace where the kernel allows it, and an
audit hook in any case), subprocesses and the environment. What it does NOT isolate: the audit hook
runs inside the sandboxed interpreter, so it stops accidents and naive escapes, not a determined
attacker; the code runs as the same user as this service. Serve on 127.0.0.1 (the default) and use
SandboxFusion's container for untrusted code at scale.

Tests subclass `LocalSandboxService` and override `run_code` to record requests or inject failures.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from verl.tools.sandbox_python_tool import run_python
from verl.tools.utils.json_service import JsonPostService

DEFAULT_RUN_TIMEOUT_S = 10
DEFAULT_MEMORY_LIMIT_MB = 1024
MAX_OUTPUT_BYTES = 1 << 20
"""stdout and stderr are each cut at this many bytes (the program is stopped when it writes more)."""


class LocalSandboxService(JsonPostService):
    """The service (module docstring); `start()` serves from a daemon thread, `url` is its `run_code` URL."""

    ENDPOINT = "/run_code"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_output_bytes: int = MAX_OUTPUT_BYTES):
        super().__init__(host, port)
        self.max_output_bytes = int(max_output_bytes)

    def handle(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self.run_code(request)

    def run_code(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, reply JSON) for one `run_code` request (module docstring)."""
        code = request.get("code")
        if not isinstance(code, str):
            return 400, {"detail": "the request needs a string field 'code'"}
        language = request.get("language") or "python"
        if language != "python":
            return 200, {
                "status": "SandboxError",
                "message": f"language {language!r} is not supported by this local service, which runs only python; "
                "use the SandboxFusion image (https://github.com/bytedance/SandboxFusion) for other languages",
                "compile_result": None,
                "run_result": None,
            }
        timeout_s = float(request.get("run_timeout") or DEFAULT_RUN_TIMEOUT_S)
        memory_mb = int(request.get("memory_limit_MB") or DEFAULT_MEMORY_LIMIT_MB)
        start = time.monotonic()
        result = asyncio.run(
            run_python(
                code,
                stdin=request.get("stdin") or "",
                timeout_s=timeout_s,
                memory_mb=memory_mb,
                max_output_bytes=self.max_output_bytes,
            )
        )
        run_result = {
            "status": "TimeLimitExceeded" if result.timed_out else "Finished",
            "execution_time": time.monotonic() - start,
            "return_code": result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr,
        }
        ok = not result.timed_out and result.exit_code == 0
        reply = {"status": "Success" if ok else "Failed", "message": "", "compile_result": None}
        return 200, {**reply, "run_result": run_result, "files": {}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    service = LocalSandboxService(args.host, args.port)
    print(f"SandboxFusion-compatible service (python only) at {service.url}", flush=True)
    service.serve_until_interrupted()


if __name__ == "__main__":
    main()
