"""Worker groups on Ray: placement groups, one actor per bundle, calls with deadlines.

- `RayResourcePool(process_on_nodes=[n, ...], use_gpu=..., max_colocate_count=...)` reserves one
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
- `RayWorkerGroup(resource_pool, RayClassWithInitArgs(cls, ...))` starts rank r in bundle r with
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (also as upstream's RAY_LOCAL_WORLD_SIZE),
  MASTER_ADDR and MASTER_PORT in its environment (the driver picks rank 0's address and a free
  port before starting anyone), so the workers form one torch.distributed group with
  `Worker.init_process_group()` (gloo on CPU, NCCL on GPU). `worker_env={...}` adds variables of
  the caller's; overriding one the group sets itself is an error. Workers of a CPU pool also start
  with glibc malloc settings that keep freed memory (fewer page faults per step; see
  `cpu_allocator`, which also says how the user's own settings win). The constructor waits (with the
  placement deadline) until every worker is scheduled: a group that finds no room on its pool (more
  groups than `max_colocate_count`) fails naming the limit instead of waiting silently.
- `split_resource_pool(pool, size)` cuts a pool's bundles into consecutive sub-pools (a worker
  group each, e.g. several rollout replicas); `merge_resource_pool(a, b)` joins two pools' placement
  groups into one (a's bundles first). Sub-pools and merged pools share the original placement
  groups: remove those through the original pools.
- `create_colocated_worker_cls({role: cls})` fuses several roles into one actor class; methods
  appear as `<role>_<method>`, and `wg.spawn(prefix_set=...)` returns one view per role
  (`wg.fuse(prefix_set)` sets them as `wg.<role>`). `create_colocated_worker_raw_cls` is the
  fused class itself, `create_colocated_worker_cls_fused` upstream's name for the same pairing;
  in the process the roles reach each other through `self.fused_worker_dict`.

Transport: a DataProto pickles as flat out-of-band buffers (verl/protocol/_wire.py). A blocking call to
a worker on the driver's host sends large ones through that worker's shared-memory channel
(verl/single_controller/shm.py; Ray carries only the pickle stream), both ways. Otherwise Ray
inlines them into the call (up to `max_direct_call_object_size`, see RAY_SYSTEM_CONFIG) or copies
them once into its shared-memory object store. Each chunk of a data-parallel call travels once,
to its one destination; an argument shared by every worker (ONE_TO_ALL) is put in the object
store once with `ray.put` and every worker reads that one copy. Results that the dispatch mode
concatenates and that come through Ray are unpickled as views of Ray's buffers and copied once,
straight into the concatenated result.

Failures: see base/errors.py. A worker that died makes the call fail with `WorkerDiedError` as soon
as Ray notices (milliseconds after the process exits), never after the deadline.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from verl.single_controller import shm
from verl.single_controller.base.decorator import _REGISTER_ATTR, RegisteredMethod, get_registered_methods
from verl.single_controller.base.errors import (
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerGroupError,
    WorkerMethodError,
    WorkerTimeoutError,
    _WorkerSideError,
)
from verl.single_controller.base.worker import Worker, enable_async_rpc, get_free_port
from verl.single_controller.base.worker_group import ClassWithInitArgs, ResourcePool, WorkerGroup
from verl.single_controller.ray.cpu_allocator import cpu_worker_malloc_env
from verl.utils.cpu_layout import cpu_worker_thread_env

logger = logging.getLogger(__name__)

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "SubRayResourcePool",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "merge_resource_pool",
    "sort_placement_groups_by_node",
    "split_resource_pool",
]

DEFAULT_PLACEMENT_TIMEOUT_S = 300.0

# Ray's built-in label holding each node's id (label selectors exist from Ray 2.49).
NODE_ID_LABEL = "ray.io/node-id"

# Arguments shared by several workers are put in the object store once when at least this large;
# smaller ones are cheaper to inline into each call (a ray.put costs about a millisecond).
_SHARE_MIN_BYTES = 64 * 1024


# Ray sends task arguments and results above 100 KiB through the shared-memory object store;
# for the few-MB DataProto chunks of an RPC, the direct (inlined) path is several times faster
# (1 MB round trip on 2 CPU workers: ~36 ms through the store, ~9 ms inlined, measured here);
# from about 8 MB on the store wins again. Applied when verl starts a local cluster.
RAY_SYSTEM_CONFIG = {
    "max_direct_call_object_size": 4 * 1024 * 1024,
    "task_rpc_inlined_bytes_limit": 32 * 1024 * 1024,
}


def _placement_timeout_s() -> float:
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
        timeout = _placement_timeout_s()
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


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class (plain or `ray.remote`-decorated) plus its constructor arguments and actor
    options (`update_options`, `set_additional_resource`)."""

    def __init__(self, cls, *args, **kwargs):
        super().__init__(cls, *args, **kwargs)
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, float] = {}

    @property
    def worker_cls(self) -> type:
        """The user's class, unwrapped from `ray.remote`."""
        return getattr(self.cls, "__ray_actor_class__", self.cls)

    def update_options(self, options: Mapping[str, Any]) -> None:
        self._options.update(options)

    def set_additional_resource(self, additional_resource: Mapping[str, float]) -> None:
        self._additional_resource = dict(additional_resource)

    def create_actor(self, options: Mapping[str, Any], env_vars: Mapping[str, str]):
        """Start one actor with our options plus the user's, and `env_vars` in its environment."""
        merged = {**self._options, **options}
        runtime_env = dict(self._options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env_vars}
        merged["runtime_env"] = runtime_env
        if self._additional_resource:
            merged["resources"] = {**merged.get("resources", {}), **self._additional_resource}
        actor_cls = ray.remote(self.worker_cls) if not hasattr(self.cls, "__ray_actor_class__") else self.cls
        return actor_cls.options(**merged).remote(*self.args, **self.kwargs)


@ray.remote(num_cpus=0)
def _node_ip_and_free_port() -> tuple[str, int]:
    return ray.util.get_node_ip_address(), get_free_port()


def _estimated_nbytes(value) -> int:
    """A cheap lower bound of a value's pickled size, enough to decide whether to ray.put it."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, bytes | bytearray | str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_estimated_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_estimated_nbytes(v) for v in value)
    batch = getattr(value, "batch", None)  # DataProto
    if batch is not None and hasattr(batch, "values"):
        return sum(t.nbytes for t in batch.values() if hasattr(t, "nbytes"))
    return 0


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per bundle of a resource pool, driven as one object.

    Either start workers (`resource_pool` + `ray_cls_with_init`) or attach to running ones
    (`worker_handles` or `worker_names`, with `ray_cls_with_init` naming their class).
    `role` names the group in errors (default: the worker class's name); `timeout_s` is the
    deadline of every blocking call (default: `VERL_RPC_TIMEOUT_S`, else 3600 s); `worker_env`
    adds environment variables to every worker started (see the module docstring).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: Sequence[str] | None = None,
        worker_handles: Sequence[Any] | None = None,
        role: str | None = None,
        timeout_s: float | None = None,
        worker_env: Mapping[str, str] | None = None,
    ):
        if ray_cls_with_init is None:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init=RayClassWithInitArgs(cls=YourWorker, ...)")
        self.customized_worker_env = dict(worker_env or {})
        bad = {k: v for k, v in self.customized_worker_env.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise TypeError(f"worker_env must map variable names to strings, got {bad}")
        user_cls = ray_cls_with_init.worker_cls
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(
                f"{user_cls!r} is not a subclass of verl.single_controller.base.Worker; worker classes must derive "
                "from Worker (and call super().__init__()) so the group can set their rank and dispatch their methods"
            )
        roles = getattr(user_cls, "_verl_roles", None)
        role = role or ("+".join(roles) if roles else user_cls.__name__)
        self.ray_cls_with_init = ray_cls_with_init
        self.name_prefix = name_prefix or f"verl_{uuid.uuid4().hex[:8]}"
        self.detached = detached
        if worker_handles is None and worker_names is not None:
            worker_handles = [ray.get_actor(name) for name in worker_names]
        if worker_handles is not None:
            self._workers = list(worker_handles)
            self._worker_names = list(worker_names) if worker_names is not None else []
        else:
            if resource_pool is None:
                raise ValueError("RayWorkerGroup needs a resource_pool to start workers (or worker_handles to attach)")
            self._workers, self._worker_names = self._start_workers(resource_pool, ray_cls_with_init, role)
        super().__init__(world_size=len(self._workers), role=role, timeout_s=timeout_s)
        self._actor_rank = {w._actor_id.hex(): rank for rank, w in enumerate(self._workers)}
        self._shm_links = shm.DriverLinks(self._workers) if shm.enabled() else None
        self._async_methods = _async_method_names(user_cls)
        self._bind_worker_methods(user_cls)

    # --- starting and attaching -----------------------------------------------------------------

    def _start_workers(self, pool: RayResourcePool, ray_cls: RayClassWithInitArgs, role: str):
        slots = pool.worker_slots()
        master_addr, master_port = self._pick_master_address(slots[0][3])
        world_size = len(slots)
        # The driver's VERL_* settings (device, timeouts, logging level) hold in the workers too.
        passthrough = {k: v for k, v in os.environ.items() if k.startswith("VERL_")}
        class_env = (ray_cls._options.get("runtime_env") or {}).get("env_vars") or {}
        malloc = cpu_worker_malloc_env(pool.use_gpu, os.environ, self.customized_worker_env, class_env)
        if malloc:
            logger.info("%s: CPU workers start with %s (see verl.single_controller.ray.cpu_allocator)", role, malloc)
        workers, names = [], []
        for rank, (pg, bundle, local_world_size, _) in enumerate(slots):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(bundle),
                "LOCAL_WORLD_SIZE": str(local_world_size),
                "RAY_LOCAL_WORLD_SIZE": str(local_world_size),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "VERL_ROLE": role,
                "WG_PREFIX": self.name_prefix,
                "WG_BACKEND": "ray",
            }
            clash = sorted(set(env) & set(self.customized_worker_env))
            if clash:
                raise ValueError(
                    f"worker_env sets {clash}, which the worker group sets itself for every rank (rank, world size, "
                    "rendezvous address); remove them from worker_env"
                )
            # CPU: the node's cores split among its workers, unless the user set OMP_NUM_THREADS.
            sharing = max(local_world_size, pool.workers_sharing_node)
            threads = cpu_worker_thread_env(pool.use_gpu, sharing, os.environ, self.customized_worker_env, class_env)
            env = {**malloc, **threads, **passthrough, **self.customized_worker_env, **env}
            name = f"{self.name_prefix}:{rank}"
            options = {
                **pool.actor_resources(),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle
                ),
                "name": name,
            }
            if self.detached:
                options["lifetime"] = "detached"
            workers.append(ray_cls.create_actor(options, env))
            names.append(name)
        self._await_scheduled(workers, pool, role)
        return workers, names

    def _await_scheduled(self, workers: list, pool: RayResourcePool, role: str) -> None:
        """Wait, with the placement deadline, until every worker has been constructed.

        An actor whose bundle share is taken (more worker groups on one pool than its
        `max_colocate_count`) is never scheduled, and without this the first call to the group
        would wait for its whole RPC deadline with nothing said. A constructor that raises counts as
        started here: the group's first call reports it, naming the rank and its __init__ error.
        """
        timeout = _placement_timeout_s()
        pending = {w.__ray_ready__.remote(): rank for rank, w in enumerate(workers)}
        _, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        if not_ready:
            ranks = sorted(pending[ref] for ref in not_ready)
            for w in workers:
                ray.kill(w)
            raise ResourceUnavailableError(
                f"worker group {role!r} ({self.name_prefix}): ranks {ranks} of {len(workers)} did not start within "
                f"{timeout:g} s. Each worker takes {pool.actor_resources()} of its bundle {pool.bundle()}, so at most "
                f"max_colocate_count={pool.max_colocate_count} worker groups fit on one pool; check how many groups "
                "this pool holds (ray status shows what is in use), or raise VERL_PLACEMENT_TIMEOUT_S if the "
                "workers are only slow to start."
            )

    def _pick_master_address(self, node_id: str) -> tuple[str, int]:
        """Rank 0's node IP and a free port there, chosen before any worker starts."""
        if node_id == ray.get_runtime_context().get_node_id():
            return ray.util.get_node_ip_address(), get_free_port()
        ref = _node_ip_and_free_port.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        ).remote()
        try:
            return ray.get(ref, timeout=_placement_timeout_s())
        except GetTimeoutError:
            raise ResourceUnavailableError(
                f"{self.name_prefix}: could not run a task on node {node_id} to pick MASTER_PORT within "
                f"{_placement_timeout_s():g} s; is the node alive?"
            ) from None

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: Sequence[str] | None = None,
        worker_handles: Sequence[Any] | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        role: str | None = None,
        timeout_s: float | None = None,
    ) -> RayWorkerGroup:
        """Attach to running named workers: by handles, by names, or by the group's `name_prefix`
        (every actor named `<name_prefix>:<rank>` in the current namespace, in rank order)."""
        if worker_handles is None and worker_names is None:
            if name_prefix is None:
                raise ValueError("from_detached needs worker_handles, worker_names or the group's name_prefix")
            pattern = re.compile(rf"^{re.escape(name_prefix)}:(\d+)$")
            found = sorted(
                (int(m.group(1)), name)
                for name in ray.util.list_named_actors()
                if (m := pattern.match(name if isinstance(name, str) else name["name"]))
            )
            if not found or [rank for rank, _ in found] != list(range(len(found))):
                raise ValueError(
                    f"no complete worker group named {name_prefix!r} in this Ray namespace (found ranks "
                    f"{[rank for rank, _ in found]}); was it created with detached=True and this name_prefix?"
                )
            worker_names = [name for _, name in found]
        return cls(
            ray_cls_with_init=ray_cls_with_init,
            name_prefix=name_prefix,
            worker_names=worker_names,
            worker_handles=worker_handles,
            role=role,
            timeout_s=timeout_s,
        )

    def spawn(self, prefix_set) -> dict[str, RayWorkerGroup]:
        """Per-role views of a colocated group: {role: group whose methods drop the role prefix}."""
        roles = getattr(self.ray_cls_with_init.worker_cls, "_verl_roles", None)
        if roles is None:
            raise TypeError("spawn() needs a group of a colocated class; build it with create_colocated_worker_cls")
        unknown = sorted(set(prefix_set) - set(roles))
        if unknown:
            raise KeyError(f"unknown role(s) {unknown}; this colocated group has roles {list(roles)}")
        views = {}
        for prefix in prefix_set:
            view = object.__new__(type(self))
            view.ray_cls_with_init = self.ray_cls_with_init
            view.name_prefix = self.name_prefix
            view.detached = self.detached
            view._workers = self._workers
            view._worker_names = self._worker_names
            view._actor_rank = self._actor_rank
            view._shm_links = self._shm_links
            view._async_methods = self._async_methods
            view.customized_worker_env = self.customized_worker_env
            WorkerGroup.__init__(view, world_size=self.world_size, role=prefix, timeout_s=self.timeout_s)
            view._bind_worker_methods(self.ray_cls_with_init.worker_cls, prefix=prefix)
            views[prefix] = view
        return views

    def fuse(self, prefix_set) -> None:
        """Attach the per-role views of `spawn(prefix_set)` to this group as `self.<role>`."""
        for role, view in self.spawn(prefix_set).items():
            if hasattr(self, role):
                raise AttributeError(
                    f"cannot fuse role {role!r}: the worker group already has an attribute of that name"
                )
            setattr(self, role, view)

    @property
    def workers(self) -> list:
        return self._workers

    def shm_speed_path(self):
        """Whether this group's large calls go through shared memory (`verl.single_controller.shm.speed_path`)."""
        return shm.speed_path(self._shm_links)

    @property
    def worker_names(self) -> list[str]:
        return self._worker_names

    def shutdown(self) -> None:
        """Kill every worker of the group (detached ones included)."""
        if self._shm_links is not None:
            self._shm_links.close()
        for worker in self._workers:
            ray.kill(worker, no_restart=True)

    # --- the call path --------------------------------------------------------------------------

    def _submit(
        self, remote_name: str, calls: list[tuple[tuple, dict]], lease: list | None = None, large_results: bool = False
    ) -> list:
        shared = self._put_repeated_args(calls) if len(calls) > 1 else {}
        links = self._shm_links.links if lease is not None and self._shm_links is not None else None
        refs = []
        try:
            for rank, (worker, (args, kwargs)) in enumerate(zip(self._workers, calls)):
                # A small call with a small result skips the channel (its entry costs ~0.1 ms).
                large_args = (
                    links is not None and not shared and shm.out_of_band_nbytes((args, kwargs)) >= shm.min_bytes()
                )
                channel = links is not None and (large_results or large_args)
                if shared:
                    args = tuple(shared.get(id(a), a) for a in args)
                    kwargs = {k: shared.get(id(v), v) for k, v in kwargs.items()}
                if remote_name in self._async_methods:  # runs on the actor's event loop; no shm channel
                    refs.append(worker._verl_rpc_async.remote(remote_name, *args, **kwargs))
                elif channel and links[rank].acquire():
                    lease.append((rank, links[rank]))
                    envelope, args, kwargs = links[rank].envelope(args, kwargs, pack=large_args)
                    refs.append(worker._verl_rpc_shm.remote(remote_name, envelope.wire(), *args, **kwargs))
                else:
                    refs.append(worker._verl_rpc.remote(remote_name, *args, **kwargs))
        except BaseException:
            self._settle(lease, failed=True)
            raise
        return refs

    @staticmethod
    def _settle(lease: list | None, failed: bool) -> None:
        """Give back the channels a call held (abandoning their segments if it failed)."""
        while lease:
            _, link = lease.pop()
            if failed:
                link.abandon()
            link.release()

    @staticmethod
    def _put_repeated_args(calls: list[tuple[tuple, dict]]) -> dict[int, ray.ObjectRef]:
        """ray.put each large argument object that goes to several workers (ONE_TO_ALL, or the
        same chunk to the tensor-parallel ranks of one shard) once; {id(object): reference}."""
        counts: Counter = Counter()
        objects = {}
        for args, kwargs in calls:
            for value in (*args, *kwargs.values()):
                counts[id(value)] += 1
                objects[id(value)] = value
        return {
            key: ray.put(objects[key])
            for key, count in counts.items()
            if count > 1
            and not isinstance(objects[key], ray.ObjectRef)
            and _estimated_nbytes(objects[key]) >= _SHARE_MIN_BYTES
        }

    def _wait(self, refs: list, ranks: list[int], role: str, method: str, lease: list | None = None) -> list:
        if not lease:
            return self._get(refs, ranks, role, method)
        try:
            outputs = self._get(refs, ranks, role, method)
            for rank, link in lease:
                index = ranks.index(rank)
                outputs[index] = link.receive(outputs[index])
        except BaseException:
            self._drain(refs, ranks, lease)
            self._settle(lease, failed=True)
            raise
        self._settle(lease, failed=False)
        return outputs

    @staticmethod
    def _drain(refs: list, ranks: list[int], lease: list) -> None:
        """After a failed call: read the replies that did arrive (one may name a new segment file,
        which only its reader removes)."""
        for rank, link in lease:
            ref = refs[ranks.index(rank)]
            with contextlib.suppress(Exception):
                if ray.wait([ref], timeout=0)[0]:
                    link.receive(ray.get(ref, timeout=0))

    def _get(self, refs: list, ranks: list[int], role: str, method: str) -> list:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except RayTaskError as exc:
            error = self._method_error(exc, refs, ranks, role, method)
            # A rank that died takes its peers' collectives down with it, and which of the two reports
            # reaches us first is a race: the death is the cause, so it wins if it shows up shortly.
            died = self._dead_peer(refs, role, method, then=str(error).splitlines()[0])
            raise (died or error) from None
        except RayActorError as exc:
            # The same race from the other side: the death arrived first; the peers' errors it caused
            # follow within moments and are named after it, so the report reads the same either way.
            then = self._peer_error(exc, refs, ranks, role, method)
            raise self._died_error(exc, role, method, then) from None
        except GetTimeoutError:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            pending_ranks = [ranks[refs.index(r)] for r in pending]
            raise WorkerTimeoutError(
                f"{role}.{method}() did not finish within {self.timeout_s:g} s; rank(s) {pending_ranks} of "
                f"{self.world_size} had not answered (they may be hung, e.g. in a collective waiting for a peer). "
                "Raise the deadline with RayWorkerGroup(timeout_s=...) or VERL_RPC_TIMEOUT_S if the work is just slow",
                role=role,
                rank=pending_ranks[0] if pending_ranks else None,
                method=method,
            ) from None
        except RayError as exc:  # object lost, owner died, out of memory, ...
            raise WorkerGroupError(f"{role}.{method}() failed in Ray: {exc}", role=role, method=method) from exc

    _PEER_DEATH_GRACE_S = 5.0  # how long a failed call waits for news of a dead peer

    def _died_error(self, exc: RayActorError, role: str, method: str, then: str = "") -> WorkerDiedError:
        rank = self._actor_rank.get(getattr(exc, "actor_id", None) or "", None)
        where = f"{role} rank {rank}" if rank is not None else f"a {role} rank"
        if "creation task" in str(exc):
            what = f"{where} is dead: its __init__ raised (so {method}() could not run)"
        else:
            what = f"{where} died during {method}() (killed, out of memory or crashed)"
        then = f" Then {then}." if then else ""
        return WorkerDiedError(f"{what}.{then} Ray's report: {exc}", role=role, rank=rank, method=method)

    def _dead_peer(self, refs: list, role: str, method: str, then: str) -> WorkerDiedError | None:
        """After one rank's method raised: a WorkerDiedError for a rank of the same call that died,
        when Ray reports one within `_PEER_DEATH_GRACE_S`; else None."""
        death = self._first_failure(refs, RayActorError)
        return None if death is None else self._died_error(death, role, method, then)

    def _peer_error(self, death: RayActorError, refs: list, ranks: list[int], role: str, method: str) -> str:
        """After one rank of a call died: the first line of the error another rank of the same call
        raised within `_PEER_DEATH_GRACE_S`, or ""."""
        error = self._first_failure(refs, RayTaskError)
        return "" if error is None else str(self._method_error(error, refs, ranks, role, method)).splitlines()[0]

    def _first_failure(self, refs: list, kind: type[Exception]) -> Exception | None:
        """The first `kind` error among the calls of `refs` that finish within `_PEER_DEATH_GRACE_S`
        (the ranks still running are not waited for longer than that)."""
        ray.wait(refs, num_returns=len(refs), timeout=self._PEER_DEATH_GRACE_S)
        for ref in refs:
            if not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                ray.get(ref, timeout=0)
            except kind as exc:
                return exc
            except Exception:  # a failure of the other kind
                continue
        return None

    def _method_error(self, exc: RayTaskError, refs, ranks, role: str, method: str) -> WorkerGroupError:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, _WorkerSideError):
            return WorkerMethodError(
                f"{role} rank {cause.rank}: {method}() raised {cause.exc_type}: {cause.message}\n"
                f"--- traceback on {role} rank {cause.rank} ---\n{cause.traceback_text}",
                role=role,
                rank=cause.rank,
                method=method,
                exc_type=cause.exc_type,
                remote_traceback=cause.traceback_text,
                remote_exception=cause.original,
            )
        # Raised outside _verl_rpc (a plain actor method, argument deserialization): find the rank.
        rank = None
        for ref, candidate in zip(refs, ranks):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    ray.get(ref, timeout=0)
                except Exception:
                    rank = candidate
                    break
        return WorkerMethodError(
            f"{role} rank {rank if rank is not None else '?'}: {method}() failed: {exc}",
            role=role,
            rank=rank,
            method=method,
            exc_type=type(cause).__qualname__ if cause is not None else "",
            remote_traceback=str(exc),
            remote_exception=cause,
        )

    def _query_all(self, worker_method: str, *args) -> list:
        refs = [getattr(w, worker_method).remote(*args) for w in self._workers]
        return self._wait(refs, ranks=list(range(len(refs))), role=self.role, method=worker_method)


# ---------------------------------------------------------------------------------------------
# Colocated roles
# ---------------------------------------------------------------------------------------------


def _async_method_names(cls) -> frozenset[str]:
    """Names of the `async def` methods of a worker class: the group calls them through `_verl_rpc_async`."""
    return frozenset(
        name for name in dir(cls) if not name.startswith("__") and inspect.iscoroutinefunction(getattr(cls, name, None))
    )


def _forwarder(role: str, method_name: str, info: RegisteredMethod):
    if info.is_async:

        async def forward(self, *args, **kwargs):
            return await getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    else:

        def forward(self, *args, **kwargs):
            return getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    forward.__name__ = f"{role}_{method_name}"
    # Same dispatch as the role's method; futures are materialized by that method itself.
    setattr(forward, _REGISTER_ATTR, info)
    return forward


def create_colocated_worker_cls(class_dict: Mapping[str, RayClassWithInitArgs | type]) -> RayClassWithInitArgs:
    """One worker class holding an instance of each role's class in the same process.

    `class_dict` maps a role name to a `RayClassWithInitArgs` (or a bare class, constructed without
    arguments). The fused class exposes each role's registered methods as `<role>_<method>`; its
    instances keep the role objects in `worker_dict` (also `fused_worker_dict`, and each role as an
    attribute of its own name), so roles may reach each other in-process.
    """
    fused_cls, options = _build_colocated_class(class_dict)
    fused = RayClassWithInitArgs(fused_cls)
    fused.update_options(options)
    return fused


def create_colocated_worker_raw_cls(class_dict: Mapping[str, RayClassWithInitArgs | type]) -> type:
    """The fused Worker class of `create_colocated_worker_cls`, not wrapped (for `ray.remote` or direct use).

    Besides the `<role>_<method>` methods it has upstream's `_fuw_execute("<role>_fwmn_<method>",
    ...)`, which calls any method of a role by name, and `raw_cls_dict` ({role: class})."""
    return _build_colocated_class(class_dict)[0]


def create_colocated_worker_cls_fused(class_dict: Mapping[str, RayClassWithInitArgs | type]) -> RayClassWithInitArgs:
    """Upstream's name for the fused pairing: the same class as `create_colocated_worker_cls`, marked
    `fused_worker_used`; `wg.spawn(...)` / `wg.fuse(...)` give the per-role groups."""
    fused = create_colocated_worker_cls(class_dict)
    fused.fused_worker_used = True
    return fused


def _build_colocated_class(class_dict: Mapping[str, RayClassWithInitArgs | type]) -> tuple[type, dict]:
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one {role: worker class} entry")
    specs: dict[str, tuple[type, tuple, dict]] = {}
    options: dict[str, Any] = {}
    for role, spec in class_dict.items():
        if not role.isidentifier():
            raise ValueError(f"role name {role!r} must be a Python identifier (it prefixes method names)")
        if hasattr(Worker, role) or role in ("worker_dict", "fused_worker_dict", "raw_cls_dict"):
            raise ValueError(f"role name {role!r} is taken by a Worker attribute (each role is also an attribute)")
        if not isinstance(spec, ClassWithInitArgs):
            spec = RayClassWithInitArgs(spec)
        user_cls = getattr(spec.cls, "__ray_actor_class__", spec.cls)
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(f"role {role!r}: {user_cls!r} is not a subclass of verl.single_controller.base.Worker")
        specs[role] = (user_cls, spec.args, spec.kwargs)
        options.update(getattr(spec, "_options", {}))

    class WorkerDict(Worker):
        def __init__(self):
            super().__init__()
            self.worker_dict = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in specs.items()}
            self.fused_worker_dict = self.worker_dict
            for role, worker in self.worker_dict.items():
                setattr(self, role, worker)
                worker.fused_worker_dict = self.worker_dict  # the roles see each other, as upstream's

        def _fuw_execute(self, method_name: str, *args, **kwargs):
            role, sep, method = method_name.partition("_fwmn_")
            if not sep or role not in self.worker_dict:
                raise ValueError(
                    f"_fuw_execute({method_name!r}): expected '<role>_fwmn_<method>' with a role of {list(self.worker_dict)}"
                )
            return getattr(self.worker_dict[role], method)(*args, **kwargs)

        def _query_dispatch_info(self, mesh_name):
            for worker in (self, *self.worker_dict.values()):
                info = Worker._query_dispatch_info(worker, mesh_name)
                if info is not None:
                    return info
            return None

        def _query_collect_info(self, mesh_name):
            for worker in (self, *self.worker_dict.values()):
                info = Worker._query_collect_info(worker, mesh_name)
                if info is not None:
                    return info
            return None

    role_methods: dict[str, tuple[str, str]] = {}
    for role, (user_cls, _, _) in specs.items():
        for method_name, info in get_registered_methods(user_cls).items():
            fused_name = f"{role}_{method_name}"
            if fused_name in role_methods or hasattr(WorkerDict, fused_name):
                raise ValueError(
                    f"colocated method name {fused_name!r} is produced twice (role/method names overlap); rename a role"
                )
            setattr(WorkerDict, fused_name, _forwarder(role, method_name, info))
            role_methods[fused_name] = (role, method_name)
    WorkerDict._verl_roles = tuple(specs)
    WorkerDict._verl_role_methods = role_methods
    WorkerDict.raw_cls_dict = {role: user_cls for role, (user_cls, _, _) in specs.items()}
    WorkerDict.is_fused_worker = True
    WorkerDict.__qualname__ = WorkerDict.__name__ = "WorkerDict_" + "_".join(specs)
    enable_async_rpc(WorkerDict)  # its forwarders were added after the class statement
    return WorkerDict, options
