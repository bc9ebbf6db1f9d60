"""The rollout's Prometheus endpoint (`actor_rollout_ref.rollout.prometheus.enable`).

Upstream starts its vLLM/SGLang HTTP servers with their engine metrics on (`/metrics`) and lists
those servers in a Prometheus scrape config. Here every engine runs inside its rollout worker and
serves no HTTP API, so each engine rank (`is_collect`) serves its own metrics instead: an HTTP
server on a free port of its node whose `/metrics` answers in the Prometheus text format
(`prometheus_client`), counting what its `generate_sequences` calls produced. The driver collects
the addresses and writes the scrape config (`verl.trainer.ppo.prometheus`).

What is counted (every series labelled `model_name` = `served_model_name`'s last path component,
and `engine` = `rollout.name`):
- `verl_rollout_requests_total`: sequences generated (rows of the batches, padding rows the
  dispatcher added included: the engine generated them);
- `verl_rollout_prompt_tokens_total`: their prompts' real tokens (attention mask);
- `verl_rollout_generation_tokens_total`: the tokens the model generated (`response_mask`; tool
  responses of a multi-turn rollout are not the model's and are not counted);
- `verl_rollout_generate_seconds`: a histogram of the wall time of each `generate_sequences` call.

Left out: the engines' own internal series (vLLM's `vllm:*`, SGLang's `sglang:*`: KV-cache use,
queue lengths), which need their HTTP server; the counters above mean the same on every engine.
A separate registry per server keeps two engines of one process (tests) and anything else that
registers in `prometheus_client`'s global registry apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl.utils.ray_utils import node_ip

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = ["RolloutMetricsServer", "served_model_name"]

_LATENCY_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def served_model_name(name: str | None, model_path: str) -> str:
    """The `model_name` label: `name` (else the model path), its last path component as upstream does."""
    name = name or model_path
    return str(name).rstrip("/").split("/")[-1]


class RolloutMetricsServer:
    """Counts one engine's generation and serves the counts over HTTP (`/metrics`)."""

    def __init__(self, model_name: str, engine: str, port: int = 0, host: str = "0.0.0.0"):
        """Starts serving at once, on `port` (0: a free port the system picks)."""
        try:
            import prometheus_client as prom
        except ImportError as e:
            raise ImportError(
                "actor_rollout_ref.rollout.prometheus.enable=true needs the prometheus_client package: "
                "pip install prometheus_client (or set prometheus.enable=false)"
            ) from e
        self.registry = prom.CollectorRegistry()
        labels = ("model_name", "engine")

        def counter(name, doc):
            return prom.Counter(name, doc, labels, registry=self.registry).labels(model_name, engine)

        self._requests = counter("verl_rollout_requests", "Sequences generated.")
        self._prompt_tokens = counter("verl_rollout_prompt_tokens", "Prompt tokens of the sequences generated.")
        self._generation_tokens = counter("verl_rollout_generation_tokens", "Tokens the model generated.")
        self._latency = prom.Histogram(
            "verl_rollout_generate_seconds",
            "Wall time of one generate_sequences call.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name, engine)
        self._server, self._thread = prom.start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_port)
        self.address = f"{node_ip()}:{self.port}"

    def observe(self, output: DataProto, seconds: float) -> None:
        """Count one `generate_sequences` result (`prompts`, `attention_mask`, `response_mask`)."""
        if len(output) == 0:
            return
        batch = output.batch
        prompt_len = batch["prompts"].shape[1]
        self._requests.inc(len(output))
        self._prompt_tokens.inc(int(batch["attention_mask"][:, :prompt_len].sum()))
        self._generation_tokens.inc(int(batch["response_mask"].sum()))
        self._latency.observe(seconds)

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
