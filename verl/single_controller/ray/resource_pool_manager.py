"""`ResourcePoolManager`: which role runs on which resource pool, checked before anything starts.

`resource_pool_spec` names the pools (`{"global_pool": [8, 8]}`: two nodes of eight workers),
`mapping` assigns each role to one (`{Role.ActorRollout: "global_pool", Role.Critic:
"global_pool"}`). `create_resource_pool()` first checks that the cluster's free resources can hold
every pool, each entry of a pool on a distinct node (the rule RayResourcePool places by), and
fails with a message that says what is missing (a node, or devices on one); only then does it
build the `RayResourcePool`s. The trainer re-exports this class (upstream keeps it in
verl/trainer/ppo/ray_trainer.py).

Bundles: one per worker, holding one GPU (and one CPU) or one CPU. `use_gpu=None` follows the
device the run asked for (`trainer.device`, which reaches here as `VERL_DEVICE`): GPU bundles for
`cuda`, CPU bundles for `cpu` (even on a GPU cluster: the workers then train on CPU and must not
hold GPUs), and for `auto` GPU bundles when the cluster has any GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import ray

from verl.single_controller.base.errors import ResourceUnavailableError
from verl.single_controller.ray.resource_pool import RayResourcePool, alive_nodes, assign_nodes, bundles_that_fit

__all__ = ["ResourcePoolManager", "bundles_hold_gpus"]


def bundles_hold_gpus(device: str, cluster_gpus: float) -> bool:
    """Whether worker bundles hold a GPU for `trainer.device=device` on a cluster with `cluster_gpus` GPUs."""
    if device == "cpu":
        return False
    if device == "auto":
        return cluster_gpus > 0
    return True  # cuda: a cluster without GPUs then fails the resource check with a message saying so


def _role_name(role: Any) -> str:
    return getattr(role, "name", str(role))


@dataclass
class ResourcePoolManager:
    """Roles -> resource pools (see the module docstring)."""

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Any, str]
    use_gpu: bool | None = None
    max_colocate_count: int = (
        3  # upstream's value: up to 3 worker groups (processes) per bundle, e.g. a megatron critic in its own layout
    )
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
        if self.use_gpu is not None:
            return self.use_gpu
        return bundles_hold_gpus(os.environ.get("VERL_DEVICE", "auto"), ray.cluster_resources().get("GPU", 0))

    def create_resource_pool(self) -> None:
        """Check the cluster, then build one RayResourcePool per spec entry."""
        use_gpu = self._resolved_use_gpu()
        self._check_resource_available(use_gpu)
        # CPU threads per worker divide a node's cores among the workers of every pool that may share
        # it (a rollout pool runs beside the trainer pool), not only the pool's own.
        sharing_node = sum(max(nodes) for nodes in self.resource_pool_spec.values())
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes,
                use_gpu=use_gpu,
                max_colocate_count=self.max_colocate_count,
                name_prefix=name,
            )
            self.resource_pool_dict[name].workers_sharing_node = sharing_node

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
        """Raise ResourceUnavailableError unless every pool fits the free resources now: each
        entry of a pool on its own node (pools may share nodes), largest entry first."""
        use_gpu = self._resolved_use_gpu() if use_gpu is None else use_gpu
        device = "GPU" if use_gpu else "CPU"
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        nodes = alive_nodes()
        capacity = [bundles_that_fit(node.free, bundle) for node in nodes]
        unplaced, short_of_nodes = [], []
        for pool, process_on_nodes in self.resource_pool_spec.items():
            placement = assign_nodes(process_on_nodes, capacity)
            for entry, node in enumerate(placement):
                if node is None:
                    unplaced.append((pool, process_on_nodes[entry]))
                else:
                    capacity[node] -= process_on_nodes[entry]
            if len(process_on_nodes) > len(nodes):
                short_of_nodes.append(f"pool {pool!r} spans {len(process_on_nodes)} nodes {process_on_nodes}")
        if not unplaced:
            return
        problems = "cannot place " + ", ".join(
            f"{n} {device}{'s' * (n != 1)} on one node for pool {pool!r}" for pool, n in unplaced
        )
        if short_of_nodes:
            problems += f" ({'; '.join(short_of_nodes)} but the cluster has {len(nodes)} alive node(s))"
        free_desc = ", ".join(f"{n.label}: {n.free.get(device, 0.0):g} {device} free" for n in nodes) or "none"
        total_free = sum(n.free.get(device, 0.0) for n in nodes)
        if use_gpu and total_free == 0:
            hint = "no GPU is visible to Ray; run on CPU (trainer.device=cpu) or start Ray on GPU nodes"
        else:
            hint = (
                "start the missing nodes (`ray start --address=<head-ip>:<port>` on each), lower trainer.nnodes / "
                "trainer.n_gpus_per_node (or the pool sizes), or free the resources other jobs hold"
            )
        raise ResourceUnavailableError(
            f"the Ray cluster cannot hold the resource pools {self.resource_pool_spec} (one {device} per worker, "
            f"each list entry on a distinct node): {problems}. Nodes now: {free_desc}. To fix: {hint}"
        )
