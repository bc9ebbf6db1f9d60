"""`Worker`: the base class of every process a worker group drives.

A worker learns its place from the standard torch.distributed environment variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE), which the worker group sets
for each process, so the same class also runs under torchrun. Without them it is rank 0 of 1,
which keeps worker logic usable in a plain Python process.

Creating the torch.distributed process group is left to the subclass (`self.init_process_group()`
in `__init__` or an `init_model` RPC) because some workers need none and others need it only after
loading a model. It always has a deadline: a peer that never starts, or a collective that never
completes, is an error after the timeout the caller passes (the workers pass
`actor_rollout_ref.nccl_timeout`), else `VERL_DIST_TIMEOUT_S` seconds, else 600 s, not a hang.
Groups created later in the process (megatron's model-parallel groups) ask `dist_timeout_s()` for
the same deadline, since torch gives a new group its own 30-minute default.

On CUDA the group is created as `cpu:gloo,cuda:nccl` (see `verl.utils.device`): the trainer's small
host-side collectives on CPU tensors go through gloo, everything on the device through NCCL. It is
bound to this rank's device (`device_id`): NCCL's communicator is created at once (a missing peer
fails here, within the deadline, rather than at the first collective), barriers know their device
and subgroups are split from it (ncclCommSplit) instead of bootstrapped one by one.

For tensor- or pipeline-parallel layouts a worker records, per device mesh, its data-parallel rank
and whether its output is collected (`_register_dispatch_collect_info`); the mesh-aware dispatch
mode reads this.

Every call from a worker group enters through `_verl_rpc`, which turns an exception into one that
names the rank and the method and carries the traceback as text. A class with `async def`
registered methods also gets `_verl_rpc_async` (added when the class is defined), through which
the group calls those methods so they run on the actor's event loop; classes without async
methods keep no async attribute at all, since one would turn their Ray actor into an asyncio actor. Blocking calls with large payloads
enter through `_verl_rpc_shm`, which first reads its arguments from the shared-memory channel and
sends a large result back the same way (verl/single_controller/shm.py).
"""

from __future__ import annotations

import datetime
import inspect
import os
import pickle
import random
import socket
import traceback

from verl.single_controller import shm
from verl.single_controller._env import env_int as _env_int
from verl.single_controller.base.decorator import Dispatch, get_registered_methods, register
from verl.single_controller.base.errors import _WorkerSideError

DEFAULT_DIST_TIMEOUT_S = 600.0


# Ports below the kernel's ephemeral range and above Ray's worker ports (10002-19999 by default).
_PORT_FLOOR = 20000
_EPHEMERAL_FALLBACK = (32768, 60999)  # Linux's default ip_local_port_range


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _EPHEMERAL_FALLBACK


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
        except OSError:
            return False
    return True


def get_free_port(rng: random.Random | None = None) -> int:
    """A TCP port that was free a moment ago, for a server another process binds later (MASTER_PORT).

    Why not `bind(("", 0))`: that hands out a port of the ephemeral range, the same pool the kernel
    draws from for every outgoing connection and every other `bind(0)`; between this pick and rank 0's
    bind (a worker start: seconds on a busy machine) Ray's many connections can take it, and rank 0
    fails with EADDRINUSE. A port between 20000 and the ephemeral range is never handed out by the
    kernel, so only another explicit pick of the same number in that window can collide. Falls back
    to `bind(0)` where that range is empty or full.
    """
    rng = rng or random.SystemRandom()
    lo, _ = _ephemeral_range()
    if lo - _PORT_FLOOR > 100:
        for _ in range(64):
            port = rng.randrange(_PORT_FLOOR, lo)
            if _port_is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def dist_timeout_s(timeout_s: float | None = None) -> float:
    """The torch.distributed timeout: the argument; else the one this process's group was created
    with (by `init_process_group`); else `VERL_DIST_TIMEOUT_S`; else 600 s."""
    if timeout_s is not None:
        return float(timeout_s)
    if _group_timeout_s is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            return _group_timeout_s
    return float(os.environ.get("VERL_DIST_TIMEOUT_S", DEFAULT_DIST_TIMEOUT_S))


# the timeout of the group `init_process_group` created in this process (None before it did)
_group_timeout_s: float | None = None


def init_process_group(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the global torch.distributed group described by the environment, with a deadline.

    Idempotent. `backend` defaults to gloo on CPU and `cpu:gloo,cuda:nccl` on GPU (see the module
    docstring). The timeout (`dist_timeout_s(timeout_s)`) covers both the rendezvous (a missing
    peer) and later collectives.
    """
    global _group_timeout_s
    import torch.distributed as dist

    from verl.utils.device import get_device, get_group_backend, set_device

    if dist.is_initialized():
        return
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(get_free_port())
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise RuntimeError(
            f"rank {rank} of {world_size}: MASTER_ADDR/MASTER_PORT are not set, so this process cannot find its "
            "peers; start workers through a worker group (which sets them) or torchrun"
        )
    backend = backend or get_group_backend()
    device_id = None
    if "nccl" in backend:
        set_device()
        device_id = get_device()
    timeout = dist_timeout_s(timeout_s)
    try:
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
            device_id=device_id,
        )
    except Exception as exc:
        raise RuntimeError(
            f"rank {rank} of {world_size} could not form the torch.distributed group ({backend}) at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout:g} s: {exc}. "
            "A peer worker probably failed to start or died; check the other ranks' logs "
            "(raise actor_rollout_ref.nccl_timeout or VERL_DIST_TIMEOUT_S if peers are just slow to start)"
        ) from exc
    _group_timeout_s = timeout


def _wrap_worker_error(worker: Worker, method_name: str, exc: Exception) -> _WorkerSideError:
    try:
        original = exc if pickle.loads(pickle.dumps(exc)) is not None else None
    except Exception:
        original = None
    return _WorkerSideError(
        worker._rank, method_name, type(exc).__qualname__, str(exc), traceback.format_exc(), original
    )


def _check_initialized(worker: Worker) -> None:
    if "_rank" not in worker.__dict__:
        raise RuntimeError(
            f"{type(worker).__name__}.__init__ did not call super().__init__(); Worker subclasses must, so that "
            "the worker knows its rank and mesh layout"
        )


async def _verl_rpc_async(self, method_name: str, *args, **kwargs):
    """`_verl_rpc` for `async def` methods: awaited on the actor's event loop."""
    _check_initialized(self)
    try:
        return await getattr(self, method_name)(*args, **kwargs)
    except Exception as exc:
        raise _wrap_worker_error(self, method_name, exc) from None


def enable_async_rpc(cls: type) -> None:
    """Give `cls` the async entry point when any of its registered methods is `async def`."""
    if any(info.is_async for info in get_registered_methods(cls).values()):
        cls._verl_rpc_async = _verl_rpc_async


class Worker:
    """Base class of remote workers. Subclasses call `super().__init__()` first."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        enable_async_rpc(cls)

    def __init__(self, cuda_visible_devices: str | None = None):
        world_size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", None)
        if rank is None:
            if world_size != 1:
                raise RuntimeError(f"WORLD_SIZE={world_size} is set but RANK is not; set both (or neither)")
            rank = 0
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
        self._rank = rank
        self._world_size = world_size
        self._local_rank = _env_int("LOCAL_RANK", 0)
        self._local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        self._master_addr = os.environ.get("MASTER_ADDR")
        self._master_port = os.environ.get("MASTER_PORT")
        self._cuda_visible_devices = cuda_visible_devices or os.environ.get("CUDA_VISIBLE_DEVICES")
        self._dispatch_collect_info: dict[str, tuple[int, bool]] = {}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        return self._master_addr, self._master_port

    def get_cuda_visible_devices(self) -> str | None:
        return self._cuda_visible_devices

    def init_process_group(self, backend: str | None = None, timeout_s: float | None = None) -> None:
        """Join the group's torch.distributed process group (see the module docstring)."""
        init_process_group(backend=backend, timeout_s=timeout_s)

    # --- per-mesh dispatch/collect info ---------------------------------------------------------

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Record this rank's data-parallel rank on `mesh_name` and whether its output is collected."""
        if mesh_name in self._dispatch_collect_info:
            raise ValueError(f"rank {self.rank}: mesh {mesh_name!r} is already registered")
        self._dispatch_collect_info[mesh_name] = (int(dp_rank), bool(is_collect))

    def _query_dispatch_info(self, mesh_name: str) -> int | None:
        info = self._dispatch_collect_info.get(mesh_name)
        return None if info is None else info[0]

    def _query_collect_info(self, mesh_name: str) -> bool | None:
        info = self._dispatch_collect_info.get(mesh_name)
        return None if info is None else info[1]

    def get_dispatch_collect(self) -> dict[str, dict]:
        """This worker's registered meshes, as keyword arguments for another worker's
        `set_dispatch_collect`: `{"dispatch_dp_rank": {mesh: dp_rank}, "collect_dp_rank": {mesh: is_collect}}`."""
        return {
            "dispatch_dp_rank": {mesh: dp for mesh, (dp, _) in self._dispatch_collect_info.items()},
            "collect_dp_rank": {mesh: collect for mesh, (_, collect) in self._dispatch_collect_info.items()},
        }

    def set_dispatch_collect(self, mesh_name: str, dispatch_dp_rank: dict[str, int], collect_dp_rank: dict[str, bool]):
        """Adopt another worker's mesh placement under `mesh_name`: a worker that hosts sub-workers (an
        actor with a reference model inside, say) exposes each sub-worker's data-parallel rank and
        collect flag as one of its own meshes. The sub-worker must have registered exactly one mesh."""
        if mesh_name in self._dispatch_collect_info:
            raise ValueError(f"rank {self.rank}: mesh {mesh_name!r} is already registered")
        if len(dispatch_dp_rank) != 1 or set(dispatch_dp_rank) != set(collect_dp_rank):
            raise ValueError(
                f"set_dispatch_collect({mesh_name!r}) needs the placement of exactly one mesh (from "
                f"get_dispatch_collect of a worker with one registered mesh), got meshes {sorted(dispatch_dp_rank)}"
            )
        (mesh,) = dispatch_dp_rank
        self._register_dispatch_collect_info(mesh_name, dispatch_dp_rank[mesh], collect_dp_rank[mesh])

    # --- helpers callable from the driver -------------------------------------------------------

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func, *args, **kwargs):
        """Run `func(self, *chunks)` on every worker, each with its chunk of the DataProto arguments;
        `func` returns a DataProto and the group concatenates them."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def execute_func_rank_zero(self, func, *args, **kwargs):
        """Run `func(self, *args, **kwargs)` on rank 0 only and return its result."""
        return func(self, *args, **kwargs)

    # --- the entry point of every group call ----------------------------------------------------

    def _verl_rpc(self, method_name: str, *args, **kwargs):
        _check_initialized(self)
        method = getattr(self, method_name)
        if inspect.iscoroutinefunction(method):
            # the group sends async methods to _verl_rpc_async; this is only reached by a caller that did not
            raise TypeError(f"{method_name} is async; call it through _verl_rpc_async")
        try:
            result = method(*args, **kwargs)
        except Exception as exc:
            raise _wrap_worker_error(self, method_name, exc) from None
        return result

    def _verl_rpc_shm(self, method_name: str, wire: tuple, *args, **kwargs):
        """`_verl_rpc` with the arguments and the result through the caller's shared-memory channel
        (`wire`: the `shm.Envelope`'s fields)."""
        envelope = shm.Envelope(*wire)
        args, kwargs = shm.worker_receive(envelope, args, kwargs)
        return shm.worker_reply(envelope, self._verl_rpc(method_name, *args, **kwargs))

    def _verl_shm_probe(self, envelope: shm.Envelope):
        return shm.worker_probe(envelope)

    def _verl_shm_stats(self) -> dict:
        return shm.worker_stats()
