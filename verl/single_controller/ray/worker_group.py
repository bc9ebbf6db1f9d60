"""`RayWorkerGroup`: one Ray actor per bundle of a resource pool, driven as one object, calls with deadlines.

`RayWorkerGroup(resource_pool, RayClassWithInitArgs(cls, ...))` starts rank r in bundle r with
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (also as upstream's RAY_LOCAL_WORLD_SIZE),
MASTER_ADDR and MASTER_PORT in its environment (the driver picks rank 0's address and a free
port before starting anyone), so the workers form one torch.distributed group with
`Worker.init_process_group()` (gloo on CPU, NCCL on GPU). `worker_env={...}` adds variables of
the caller's; overriding one the group sets itself is an error. Workers of a CPU pool also start
with glibc malloc settings that keep freed memory (fewer page faults per step; see
`cpu_allocator`, which also says how the user's own settings win). The constructor waits (with the
placement deadline) until every worker is scheduled: a group that finds no room on its pool (more
groups than `max_colocate_count`) fails naming the limit instead of waiting silently. Where the
bundles are is the pool's business (resource_pool.py); what each actor is, the class's
(worker_class.py).

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
import logging
import os
import re
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from verl.single_controller import shm
from verl.single_controller.base.errors import (
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerGroupError,
    WorkerMethodError,
    WorkerTimeoutError,
    _WorkerSideError,
)
from verl.single_controller.base.worker import Worker, get_free_port
from verl.single_controller.base.worker_group import WorkerGroup
from verl.single_controller.ray.cpu_allocator import cpu_worker_malloc_env
from verl.single_controller.ray.resource_pool import RayResourcePool, placement_timeout_s
from verl.single_controller.ray.worker_class import RayClassWithInitArgs, async_method_names
from verl.utils.cpu_layout import cpu_worker_thread_env

logger = logging.getLogger(__name__)

__all__ = ["RAY_SYSTEM_CONFIG", "RayWorkerGroup"]

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


def _check_device_name(device_name: str | None, pool) -> str:
    """Upstream's `device_name` of a worker group, checked against what its pool's bundles hold."""
    from verl.utils.device import ACCELERATOR_NAME

    holds_gpus = pool.use_gpu if pool is not None else None
    if device_name is None or device_name == "auto":  # trainer.device=auto: what the pool holds
        return ACCELERATOR_NAME if holds_gpus or holds_gpus is None else "cpu"
    if device_name not in (ACCELERATOR_NAME, "cpu"):
        raise ValueError(
            f"RayWorkerGroup(device_name={device_name!r}): this build runs workers on {ACCELERATOR_NAME} or cpu "
            f"({device_name!r} is hardware it does not support); pass the trainer's device_name (trainer.device)"
        )
    if holds_gpus is not None and holds_gpus != (device_name == ACCELERATOR_NAME):
        raise ValueError(
            f"RayWorkerGroup(device_name={device_name!r}) on a resource pool whose bundles "
            f"{'hold GPUs' if holds_gpus else 'hold no GPUs'}: pass the trainer's device_name (trainer.device) so the "
            "group and its pool agree"
        )
    return device_name


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per bundle of a resource pool, driven as one object.

    Either start workers (`resource_pool` + `ray_cls_with_init`) or attach to running ones
    (`worker_handles` or `worker_names`, with `ray_cls_with_init` naming their class).
    `role` names the group in errors (default: the worker class's name); `timeout_s` is the
    deadline of every blocking call (default: `VERL_RPC_TIMEOUT_S`, else 3600 s); `worker_env`
    adds environment variables to every worker started (see the module docstring);
    `ray_wait_register_center_timeout` (upstream's name, `trainer.ray_wait_register_center_timeout`)
    is how many seconds the workers may take to start (default: `VERL_PLACEMENT_TIMEOUT_S`, else 300 s).

    Upstream's trainer also passes `device_name` (`cuda` or `cpu`: checked against the pool, whose bundles
    hold GPUs or not; `auto` is the pool's; `npu` is refused), `profile_steps` and `worker_nsight_options` (with both, each
    worker starts under `nsys profile` with those options, capture ending after 6 ranges per profiled
    step unless they say otherwise, as upstream's).
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
        ray_wait_register_center_timeout: float | None = None,
        device_name: str | None = None,
        profile_steps: Sequence[int] | None = None,
        worker_nsight_options: Mapping[str, Any] | None = None,
    ):
        if ray_cls_with_init is None:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init=RayClassWithInitArgs(cls=YourWorker, ...)")
        self.device_name = _check_device_name(device_name, resource_pool)
        self.profile_steps = list(profile_steps) if profile_steps is not None else None
        self.worker_nsight_options = dict(worker_nsight_options) if worker_nsight_options is not None else None
        if self.profile_steps and self.worker_nsight_options is not None and worker_handles is None:
            options = dict(self.worker_nsight_options)
            if options.get("capture-range-end") is None:
                options["capture-range-end"] = f"repeat-shutdown:{6 * len(self.profile_steps)}"
            self.worker_nsight_options = options
            ray_cls_with_init.update_options({"runtime_env": {"nsight": options}})
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
        self.start_timeout_s = ray_wait_register_center_timeout
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
        self._async_methods = async_method_names(user_cls)
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
        timeout, knob = placement_timeout_s(), "VERL_PLACEMENT_TIMEOUT_S"
        if self.start_timeout_s is not None:
            timeout, knob = float(self.start_timeout_s), "trainer.ray_wait_register_center_timeout"
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
                f"this pool holds (ray status shows what is in use), or raise {knob} if the workers are only slow "
                "to start."
            )

    def _pick_master_address(self, node_id: str) -> tuple[str, int]:
        """Rank 0's node IP and a free port there, chosen before any worker starts."""
        if node_id == ray.get_runtime_context().get_node_id():
            return ray.util.get_node_ip_address(), get_free_port()
        ref = _node_ip_and_free_port.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        ).remote()
        try:
            return ray.get(ref, timeout=placement_timeout_s())
        except GetTimeoutError:
            raise ResourceUnavailableError(
                f"{self.name_prefix}: could not run a task on node {node_id} to pick MASTER_PORT within "
                f"{placement_timeout_s():g} s; is the node alive?"
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
