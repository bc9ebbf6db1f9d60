"""`ResourcePoolManager`: which role runs on which resource pool, checked before anything starts.

`resource_pool_spec` names the pools (`{"global_pool": [8, 8]}`: two nodes of eight workers),
`mapping` assigns each role to one (`{Role.ActorRollout: "global_pool", Role.Critic:
"global_pool"}`). `create_resource_pool()` first checks that the cluster's free resources can hold
every pool, node by node, and fails with a message that says what is missing; only then does it
build the `RayResourcePool`s. The trainer re-exports this class (upstream keeps it in
verl/trainer/ppo/ray_trainer.py).

Bundles: one per worker, holding one GPU (and one CPU) on GPU clusters and one CPU otherwise;
`use_gpu=None` picks GPU bundles when the cluster has any GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from verl.single_controller.base.errors import ResourceUnavailableError
from verl.single_controller.ray.base import RayResourcePool

__all__ = ["ResourcePoolManager"]


def _role_name(role: Any) -> str:
    return getattr(role, "name", str(role))


def _free_per_node() -> dict[str, dict[str, float]]:
    """Free resources of every alive node, keyed by node IP (node id when IPs repeat)."""
    try:
        from ray._private.state import available_resources_per_node

        per_node = available_resources_per_node()
    except (ImportError, AttributeError):  # private API moved: fall back to node totals
        per_node = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive")}
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    named = {}
    for node_id, free in per_node.items():
        label = ips.get(node_id, node_id)
        named[label if label not in named else f"{label} ({node_id[:8]})"] = free
    return named


@dataclass
class ResourcePoolManager:
    """Roles -> resource pools (see the module docstring)."""

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Any, str]
    use_gpu: bool | None = None
    max_colocate_count: int = 1
    resource_pool_dict: dict[str, RayResourcePool] = field(default_factory=dict)

    def __post_init__(self):
        for name, nodes in self.resource_pool_spec.items():
            if not nodes or any(not isinstance(n, int) or n <= 0 for n in nodes):
                raise ValueError(
                    f"resource pool {name!r}: {nodes!r} must be a non-empty list of positive worker counts per node"
                )
        unknown = {_role_name(r): p for r, p in self.mapping.items() if p not in self.resource_pool_spec}
        if unknown:
            raise ValueError(
                f"roles mapped to undefined resource pools: {unknown}; defined pools: {sorted(self.resource_pool_spec)}"
            )

    def _resolved_use_gpu(self) -> bool:
        if self.use_gpu is None:
            return ray.cluster_resources().get("GPU", 0) > 0
        return self.use_gpu

    def create_resource_pool(self) -> None:
        """Check the cluster, then build one RayResourcePool per spec entry."""
        use_gpu = self._resolved_use_gpu()
        self._check_resource_available(use_gpu)
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes,
                use_gpu=use_gpu,
                max_colocate_count=self.max_colocate_count,
                name_prefix=name,
            )

    def get_resource_pool(self, role) -> RayResourcePool:
        if role not in self.mapping:
            raise KeyError(
                f"role {_role_name(role)} has no resource pool; mapped roles: {[_role_name(r) for r in self.mapping]}"
            )
        if not self.resource_pool_dict:
            raise RuntimeError("call create_resource_pool() before get_resource_pool()")
        return self.resource_pool_dict[self.mapping[role]]

    def get_n_gpus(self) -> int:
        """Workers (devices) over all pools."""
        return sum(sum(nodes) for nodes in self.resource_pool_spec.values())

    def _check_resource_available(self, use_gpu: bool | None = None) -> None:
        """Raise ResourceUnavailableError unless every pool's per-node demand fits the free
        resources (first-fit, largest demand first, each node entry on a single node)."""
        use_gpu = self._resolved_use_gpu() if use_gpu is None else use_gpu
        device = "GPU" if use_gpu else "CPU"
        free = _free_per_node()
        capacity = {node: {"CPU": res.get("CPU", 0.0), "GPU": res.get("GPU", 0.0)} for node, res in free.items()}
        demands = sorted(
            ((n, pool) for pool, nodes in self.resource_pool_spec.items() for n in nodes),
            key=lambda item: -item[0],
        )
        unplaced = []
        for n, pool in demands:
            need = {"CPU": n, "GPU": n} if use_gpu else {"CPU": n}
            node = next((nd for nd, cap in capacity.items() if all(cap[r] >= v for r, v in need.items())), None)
            if node is None:
                unplaced.append((pool, n))
                continue
            for resource, amount in need.items():
                capacity[node][resource] -= amount
        if unplaced:
            total_needed = self.get_n_gpus()
            total_free = sum(res.get(device, 0.0) for res in free.values())
            nodes_desc = ", ".join(f"{node}: {res.get(device, 0.0):g} {device}" for node, res in free.items()) or "none"
            missing = ", ".join(f"{n} {device}s on one node for pool {pool!r}" for pool, n in unplaced)
            hint = (
                "no GPU is visible to Ray; run on CPU (trainer.device=cpu) or start Ray on GPU nodes"
                if use_gpu and total_free == 0
                else "lower trainer.n_gpus_per_node / trainer.nnodes (or the pool sizes), free resources held by "
                "other jobs, or add nodes"
            )
            raise ResourceUnavailableError(
                f"the Ray cluster cannot hold the resource pools {self.resource_pool_spec} ({total_needed} {device}s, "
                f"one per worker): cannot place {missing}. Free now: {nodes_desc} ({total_free:g} {device}s in "
                f"total). {hint}"
            )
