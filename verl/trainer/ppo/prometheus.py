"""The Prometheus scrape config of the rollout's metrics endpoints (`rollout.prometheus.*`).

Each rollout engine rank serves its metrics over HTTP (`verl.workers.rollout.metrics_server`).
After the workers are built the driver asks them for their addresses and writes, as upstream does,
a Prometheus config at `prometheus.file` on every Ray node: a `ray` job reading Ray's own service
discovery file and a `rollout` job scraping the engines' endpoints. It then asks a Prometheus
listening on `prometheus.port` of each node to reload its config (`POST /-/reload`, which needs
Prometheus started with `--web.enable-lifecycle`); a node without one is skipped, as upstream's
reload skips it. Starting Prometheus itself is the user's (upstream's `ray metrics
launch-prometheus`).
"""

from __future__ import annotations

import logging
import os
import urllib.request
from typing import Any

import yaml

from verl.utils.ray_utils import node_ip

__all__ = ["prometheus_config", "publish_rollout_metrics", "rollout_metrics_addresses", "write_prometheus_config"]

logger = logging.getLogger(__name__)

RAY_SERVICE_DISCOVERY = "/tmp/ray/prom_metrics_service_discovery.json"


def prometheus_config(addresses: list[str]) -> dict:
    """The scrape config (upstream's layout): Ray's metrics and the rollout endpoints `addresses`."""
    return {
        "global": {"scrape_interval": "10s", "evaluation_interval": "10s"},
        "scrape_configs": [
            {"job_name": "ray", "file_sd_configs": [{"files": [RAY_SERVICE_DISCOVERY]}]},
            {"job_name": "rollout", "static_configs": [{"targets": list(addresses)}]},
        ],
    }


def write_prometheus_config(path: str, addresses: list[str]) -> None:
    """Write `prometheus_config(addresses)` as YAML at `path` (its folder created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(prometheus_config(addresses), f, default_flow_style=False, indent=2)


def _reload(port: int) -> bool:
    """Ask this node's Prometheus to reload its config; False when none answers."""
    request = urllib.request.Request(f"http://{node_ip()}:{port}/-/reload", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5):
            return True
    except OSError:
        return False


def _write_and_reload(path: str, addresses: list[str], port: int) -> bool:
    write_prometheus_config(path, addresses)
    return _reload(port)


def rollout_metrics_addresses(groups: dict[str, Any]) -> list[str]:
    """The `host:port` of every rollout engine's metrics endpoint among the worker `groups`."""
    addresses = []
    for name in ("actor_rollout_wg", "rollout_wg"):
        group = groups.get(name)
        if group is not None and hasattr(group, "rollout_metrics_address"):
            addresses += [a for a in group.rollout_metrics_address() if a]
    return addresses


def publish_rollout_metrics(prometheus, groups: dict[str, Any]) -> list[str]:
    """With `prometheus.enable` (a `PrometheusConfig`), write the scrape config of the engines'
    endpoints on every Ray node and reload Prometheus where one runs; returns the addresses."""
    if not prometheus.enable:
        return []
    import ray

    addresses = rollout_metrics_addresses(groups)
    if not addresses:
        raise RuntimeError(
            "actor_rollout_ref.rollout.prometheus.enable=true, but no rollout worker serves metrics (the worker "
            "class has no rollout_metrics_address RPC or built no engine); use the built-in worker classes or set "
            "prometheus.enable=false"
        )
    task = ray.remote(num_cpus=0)(_write_and_reload)
    nodes = [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]]
    reloaded = ray.get(
        [
            task.options(resources={f"node:{ip}": 0.001}).remote(prometheus.file, addresses, prometheus.port)
            for ip in nodes
        ]
    )
    logger.info(
        "wrote the Prometheus config %s on %d node(s) with %d rollout endpoint(s); Prometheus reloaded on %d",
        prometheus.file,
        len(nodes),
        len(addresses),
        sum(reloaded),
    )
    return addresses
