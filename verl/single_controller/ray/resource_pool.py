"""Resource pools on Ray: placement groups that hold a pool's devices, one bundle per worker.

`RayResourcePool(process_on_nodes=[n, ...], use_gpu=..., max_colocate_count=...)` reserves one
STRICT_PACK placement group per node with one bundle per worker: `{"CPU": 1, "GPU": 1}` on GPU,
`{"CPU": 1}` without. Each actor takes `1/max_colocate_count` of its bundle, so that many worker
groups can share the devices. Placement groups are created on first use, checked against the
cluster's totals first (an impossible request fails at once, naming what is missing) and then
awaited with a deadline (`VERL_PLACEMENT_TIMEOUT_S`, default 300 s). Each entry of a
multi-node pool is pinned to its own node (Ray's `ray.io/node-id` label), chosen among the nodes
with room: `[1, 1]` means two machines, never two bundles packed on one, and asking for more
nodes than the cluster has fails at once instead of waiting. Nodes are ordered by IP address,
then node id (several Ray nodes on one machine share an IP), so ranks are contiguous per node
and rank r lands on the same node every time on the same cluster.

`split_resource_pool(pool, size)` cuts a pool's bundles into consecutive sub-pools (a worker
group each, e.g. several rollout replicas); `merge_resource_pool(a, b)` joins two pools' placement
groups into one (a's bundles first). Sub-pools and merged pools share the original placement
groups: remove those through the original pools.

This module knows nothing of workers: `worker_slots()` is all a worker group asks of a pool, and
`ResourcePoolManager` (resource_pool_manager.py) uses the node helpers to check a whole layout
of pools before any is built.
"""

from __future__ import annotations

import inspect
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from verl.single_controller.base.errors import ResourceUnavailableError
from verl.single_controller.base.worker_group import ResourcePool

__all__ = [
    "DEFAULT_PLACEMENT_TIMEOUT_S",
    "NODE_ID_LABEL",
    "NodeInfo",
    "RayResourcePool",
    "SubRayResourcePool",
    "alive_nodes",
    "assign_nodes",
    "bundles_that_fit",
    "merge_resource_pool",
    "placement_timeout_s",
    "sort_placement_groups_by_node",
    "split_resource_pool",
]

DEFAULT_PLACEMENT_TIMEOUT_S = 300.0

# Ray's built-in label holding each node's id (label selectors exist from Ray 2.49).
NODE_ID_LABEL = "ray.io/node-id"


def placement_timeout_s() -> float:
    return float(os.environ.get("VERL_PLACEMENT_TIMEOUT_S", DEFAULT_PLACEMENT_TIMEOUT_S))


def _node_sort_key(ip: str, node_id: str) -> tuple:
    """Rank order of nodes: by IP address (numerically for IPv4), then node id (nodes that share an
    IP, e.g. several Ray nodes on one machine, keep one order for the cluster's lifetime)."""
    parts = ip.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return (0, tuple(int(p) for p in parts), "", node_id)
    return (1, (), ip, node_id)  # IPv6 or a host name: after every IPv4 address, never compared with one


def sort_placement_groups_by_node(items: Sequence[tuple[str, str]]) -> list[int]:
    """Order of placement groups given `(node_ip, node_id)` per group: by IP address (numerically
    for IPv4), then node id; groups on the same node keep their creation order."""
    return sorted(range(len(items)), key=lambda i: (*_node_sort_key(*items[i]), i))


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node: its IP, id, and free and total resources (`{"CPU": 3.0, "GPU": 1.0}`)."""

    ip: str
    node_id: str
    free: dict[str, float]
    total: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"


def alive_nodes() -> list[NodeInfo]:
    """Every alive node with its resources, in rank order (see `_node_sort_key`)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except (ImportError, AttributeError):  # private API moved: fall back to node totals
        free = {n["NodeID"]: n["Resources"] for n in alive}
    nodes = [
        NodeInfo(n["NodeManagerAddress"], n["NodeID"], dict(free.get(n["NodeID"], {})), dict(n["Resources"]))
        for n in alive
    ]
    return sorted(nodes, key=lambda n: _node_sort_key(n.ip, n.node_id))


def assign_nodes(
    process_on_nodes: Sequence[int], capacity: Sequence[float], fallback: Sequence[float] | None = None
) -> list[int | None]:
    """Put each entry of `process_on_nodes` (workers on one node) on a node of its own.

    `capacity[j]` is how many bundles node j can take, nodes in preference order. The largest
    entry goes first, each to the first unused node that fits it. Entries left over then go, the
    same way, to unused nodes by `fallback` capacity (e.g. free room first, total size second);
    an entry that still fits nowhere gets None. Returns one node index (or None) per entry.
    """
    placement: list[int | None] = [None] * len(process_on_nodes)
    used: set[int] = set()
    order = sorted(range(len(process_on_nodes)), key=lambda i: -process_on_nodes[i])
    for caps in (capacity, fallback) if fallback is not None else (capacity,):
        for entry in order:
            if placement[entry] is not None:
                continue
            need = process_on_nodes[entry]
            node = next((j for j, cap in enumerate(caps) if j not in used and cap >= need), None)
            if node is not None:
                used.add(node)
                placement[entry] = node
    return placement


def bundles_that_fit(free: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of `bundle` fit into the free resources `free`."""
    return int(min(free.get(resource, 0.0) // amount for resource, amount in bundle.items()))


def _node_ips() -> dict[str, str]:
    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}


class RayResourcePool(ResourcePool):
    """Workers per node, held as Ray placement groups (see the module docstring)."""

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
        detached: bool = False,
    ):
        super().__init__(process_on_nodes, max_colocate_count)
        self.use_gpu = use_gpu
        self.name_prefix = name_prefix or ""
        # Workers of all pools on one node (set by ResourcePoolManager; 0: this pool's own): a CPU
        # worker's threads are the node's cores divided by them.
        self.workers_sharing_node = 0
        self.detached = detached
        self.pgs: list[PlacementGroup] | None = None
        self.pg_node_ids: list[str] = []

    @property
    def device_resource(self) -> str:
        return "GPU" if self.use_gpu else "CPU"

    def bundle(self) -> dict[str, float]:
        return {"CPU": 1, "GPU": 1} if self.use_gpu else {"CPU": 1}

    def actor_resources(self) -> dict[str, float]:
        """The `num_cpus` / `num_gpus` options of one actor in one bundle."""
        share = 1.0 / self.max_colocate_count
        return {"num_cpus": share, "num_gpus": share} if self.use_gpu else {"num_cpus": share}

    def check_cluster_totals(self) -> None:
        """Fail at once when the whole cluster could never hold this pool."""
        totals = ray.cluster_resources()
        for resource, per_bundle in self.bundle().items():
            need = per_bundle * self.world_size
            have = totals.get(resource, 0)
            if have < need:
                hint = (
                    "; no GPU is visible to Ray: use CPU bundles (use_gpu=False, trainer.device=cpu)"
                    if resource == "GPU" and have == 0
                    else "; lower the number of workers or add nodes"
                )
                raise ResourceUnavailableError(
                    f"resource pool {self.name_prefix or '(unnamed)'} needs {need:g} {resource} "
                    f"({self.world_size} workers in bundles of {self.bundle()}, process_on_nodes={self.store}) but the "
                    f"Ray cluster has {have:g} {resource} in total{hint}"
                )

    def get_placement_groups(self, strategy: str = "STRICT_PACK", name: str | None = None) -> list[PlacementGroup]:
        if self.pgs is not None:
            return self.pgs
        self.check_cluster_totals()
        prefix = f"{name or self.name_prefix or 'verl_pool'}_{uuid.uuid4().hex[:8]}"
        lifetime = "detached" if self.detached else None
        targets = self._target_nodes(prefix) if len(self.store) > 1 else [None]
        pgs = []
        for i, (n, node_id) in enumerate(zip(self.store, targets)):
            pin = {"bundle_label_selector": [{NODE_ID_LABEL: node_id}] * n} if node_id else {}
            bundles = [self.bundle() for _ in range(n)]
            pgs.append(placement_group(bundles, strategy=strategy, name=f"{prefix}_node{i}", lifetime=lifetime, **pin))
        timeout = placement_timeout_s()
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout)
        if len(ready) < len(pgs):
            for pg in pgs:
                remove_placement_group(pg)
            raise ResourceUnavailableError(
                f"resource pool {prefix}: only {len(ready)} of {len(pgs)} node placement groups "
                f"(process_on_nodes={self.store}, bundles of {self.bundle()}) could be placed within {timeout:g} s. "
                f"Free resources now: {ray.available_resources()}. Other worker groups may hold the devices, or no "
                "single node has enough free for one node's bundles; free them, lower the request, or raise "
                "VERL_PLACEMENT_TIMEOUT_S"
            )
        node_ids = [placement_group_table(pg)["bundles_to_node_id"][0] for pg in pgs]
        ips = _node_ips()
        order = sort_placement_groups_by_node([(ips.get(node, ""), node) for node in node_ids])
        self.pgs = [pgs[i] for i in order]
        self.pg_node_ids = [node_ids[i] for i in order]
        self._store = [self.store[i] for i in order]
        return self.pgs

    def _target_nodes(self, prefix: str) -> list[str]:
        """One distinct node per entry of `process_on_nodes`.

        Without pinning, Ray may pack several "nodes" of a pool onto one machine, or wait forever
        for a machine that is not there. Nodes with free room now are preferred, then nodes big
        enough to hold the entry at all (busy ones: the placement then waits, with its deadline,
        for them to free up); an entry no node is big enough for is an immediate error.
        """
        if "bundle_label_selector" not in inspect.signature(placement_group).parameters:
            raise ResourceUnavailableError(
                f"resource pool {prefix}: placing process_on_nodes={self.store} on distinct nodes needs Ray >= 2.49 "
                f"(placement-group label selectors); this is Ray {ray.__version__}. Upgrade Ray or use one node"
            )
        nodes = alive_nodes()
        free = [bundles_that_fit(node.free, self.bundle()) for node in nodes]
        total = [bundles_that_fit(node.total, self.bundle()) for node in nodes]
        placement = assign_nodes(self.store, free, fallback=total)
        if None not in placement:
            return [nodes[j].node_id for j in placement]
        sizes = ", ".join(f"{node.label}: {cap} bundle(s)" for node, cap in zip(nodes, total)) or "none"
        raise ResourceUnavailableError(
            f"resource pool {prefix}: process_on_nodes={self.store} needs {len(self.store)} distinct nodes, entry i "
            f"on a node that holds process_on_nodes[i] bundles of {self.bundle()}, but the cluster has "
            f"{len(nodes)} alive node(s), sized {sizes}. Start the missing nodes (`ray start "
            "--address=<head-ip>:<port>` on each) or ask for fewer or smaller nodes (trainer.nnodes, "
            "trainer.n_gpus_per_node)"
        )

    def worker_slots(self) -> list[tuple[PlacementGroup, int, int, str]]:
        """Where each rank runs, in rank order: (placement group, bundle index, workers on that node,
        node id). Creates the placement groups on first use."""
        pgs = self.get_placement_groups()
        return [
            (pg, bundle, count, node)
            for pg, count, node in zip(pgs, self.store, self.pg_node_ids)
            for bundle in range(count)
        ]

    def remove_placement_groups(self) -> None:
        """Give the reserved resources back to Ray (kill the pool's worker groups first)."""
        for pg in self.pgs or []:
            remove_placement_group(pg)
        self.pgs = None
        self.pg_node_ids = []


class SubRayResourcePool(RayResourcePool):
    """Bundles `start_bundle_index` .. `start_bundle_index + subgroup_world_size - 1` (in rank order) of
    another pool's placement groups; a worker group on it has ranks 0..subgroup_world_size-1 whose
    LOCAL_RANK is their bundle's index on its node (as upstream)."""

    def __init__(
        self, parent: RayResourcePool, start_bundle_index: int, subgroup_world_size: int, name_prefix: str = ""
    ):
        super().__init__(
            parent.store,
            use_gpu=parent.use_gpu,
            name_prefix=name_prefix,
            max_colocate_count=parent.max_colocate_count,
            detached=parent.detached,
        )
        self.parent = parent
        self.workers_sharing_node = parent.workers_sharing_node
        self.start_bundle_index = int(start_bundle_index)
        self.subgroup_world_size = int(subgroup_world_size)

    @property
    def world_size(self) -> int:
        return self.subgroup_world_size

    def get_placement_groups(self, strategy: str = "STRICT_PACK", name: str | None = None) -> list[PlacementGroup]:
        pgs = self.parent.get_placement_groups(strategy, name)
        self.pgs, self.pg_node_ids = pgs, self.parent.pg_node_ids
        return pgs

    def worker_slots(self) -> list[tuple[PlacementGroup, int, int, str]]:
        slots = self.parent.worker_slots()
        return slots[self.start_bundle_index : self.start_bundle_index + self.subgroup_world_size]

    def remove_placement_groups(self) -> None:
        raise RuntimeError(
            f"sub-pool {self.name_prefix!r} shares its placement groups with its parent pool; remove them there"
        )


def split_resource_pool(resource_pool: RayResourcePool, split_size: int | Sequence[int]) -> list[SubRayResourcePool]:
    """Consecutive sub-pools of `resource_pool` (which may itself be a sub-pool): `split_size` workers
    each (an int that divides the world size), or the given sizes (a list summing to it)."""
    world = resource_pool.world_size
    if isinstance(split_size, int):
        if split_size < 1 or world % split_size:
            raise ValueError(f"split_size={split_size} does not divide the pool's {world} workers")
        sizes = [split_size] * (world // split_size)
    else:
        sizes = [int(n) for n in split_size]
        if any(n < 1 for n in sizes) or sum(sizes) != world:
            raise ValueError(f"split sizes {sizes} must be positive and sum to the pool's {world} workers")
    parent, offset = resource_pool, 0
    if isinstance(resource_pool, SubRayResourcePool):
        parent, offset = resource_pool.parent, resource_pool.start_bundle_index
    parent.get_placement_groups()
    pools, start = [], offset
    for i, size in enumerate(sizes):
        pools.append(SubRayResourcePool(parent, start, size, name_prefix=f"{resource_pool.name_prefix}_split_{i}"))
        start += size
    return pools


def merge_resource_pool(rp1: RayResourcePool, rp2: RayResourcePool) -> RayResourcePool:
    """One pool over both pools' placement groups, `rp1`'s bundles first (see the module docstring)."""
    for attr in ("use_gpu", "max_colocate_count", "detached"):
        if getattr(rp1, attr) != getattr(rp2, attr):
            raise ValueError(
                f"cannot merge resource pools with different {attr} ({getattr(rp1, attr)} vs {getattr(rp2, attr)})"
            )
    if isinstance(rp1, SubRayResourcePool) or isinstance(rp2, SubRayResourcePool):
        raise TypeError("merge_resource_pool takes whole pools; split the merged pool instead of merging sub-pools")
    pgs = rp1.get_placement_groups() + rp2.get_placement_groups()
    merged = RayResourcePool(
        rp1.store + rp2.store,
        use_gpu=rp1.use_gpu,
        name_prefix=f"{rp1.name_prefix}_{rp2.name_prefix}",
        max_colocate_count=rp1.max_colocate_count,
        detached=rp1.detached,
    )
    merged.pgs = pgs
    merged.pg_node_ids = rp1.pg_node_ids + rp2.pg_node_ids
    return merged
