"""The backend-neutral half of a worker group: resources, class specs and method binding.

`WorkerGroup` turns every `@register`-ed method of the worker class into a method of the group
object. A call runs dispatch -> submit -> wait -> collect; the backend (Ray, in ray/worker_group.py)
supplies only `_submit` (start the calls on the chosen ranks) and `_wait` (wait with a deadline,
turning failures into errors that name the role, the rank and the method).

Deadline: every blocking call waits at most `timeout_s` seconds: the constructor argument, else
the `VERL_RPC_TIMEOUT_S` environment variable, else one hour (generous on purpose: a generation or
update step on a large model can take many minutes; a dead worker is reported at once anyway).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from verl.single_controller.base.decorator import Execute, RegisteredMethod, _split_or_broadcast, get_registered_methods

DEFAULT_RPC_TIMEOUT_S = 3600.0


def rpc_timeout_s(timeout_s: float | None = None) -> float:
    """The deadline of a blocking call: the argument, else `VERL_RPC_TIMEOUT_S`, else 3600 s."""
    value = timeout_s if timeout_s is not None else os.environ.get("VERL_RPC_TIMEOUT_S", DEFAULT_RPC_TIMEOUT_S)
    try:
        value = float(value)
    except ValueError:
        raise ValueError(f"VERL_RPC_TIMEOUT_S={value!r} must be a number of seconds") from None
    if value <= 0:
        raise ValueError(f"the worker group RPC timeout must be positive, got {value} s")
    return value


class ResourcePool:
    """Processes per node: `process_on_nodes=[4, 4]` is two nodes with four workers each."""

    def __init__(self, process_on_nodes: Sequence[int] | None = None, max_colocate_count: int = 10):
        process_on_nodes = list(process_on_nodes) if process_on_nodes is not None else [1]
        if not process_on_nodes or any(not isinstance(n, int) or n <= 0 for n in process_on_nodes):
            raise ValueError(
                f"process_on_nodes={process_on_nodes!r} must be a non-empty list of positive worker counts, one "
                "per node (e.g. [8, 8] for two nodes of eight GPUs)"
            )
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count={max_colocate_count} must be at least 1")
        self._store = process_on_nodes
        self.max_colocate_count = max_colocate_count

    @property
    def store(self) -> list[int]:
        return self._store

    @property
    def world_size(self) -> int:
        return sum(self._store)

    def local_world_size_list(self) -> list[int]:
        """LOCAL_WORLD_SIZE of each rank, in rank order."""
        return [n for n in self._store for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        """LOCAL_RANK of each rank, in rank order."""
        return [i for n in self._store for i in range(n)]


class ClassWithInitArgs:
    """A class with the arguments to construct it later, in the worker process."""

    def __init__(self, cls, *args, **kwargs):
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self):
        return self.cls(*self.args, **self.kwargs)


class _BoundMethod:
    """A worker method as seen on the group: `wg.update_actor(batch)`."""

    def __init__(self, group: WorkerGroup, public_name: str, remote_name: str, info: RegisteredMethod, role: str):
        self._group = group
        self.__name__ = public_name
        self._remote_name = remote_name
        self._info = info
        self._role = role

    def __call__(self, *args, **kwargs):
        return self._group._call(self._role, self.__name__, self._remote_name, self._info, args, kwargs)

    def __repr__(self) -> str:
        return f"<worker group method {self._role}.{self.__name__} ({self._info.dispatch_mode!r})>"


class WorkerGroup:
    """A set of workers, one per rank, driven as one object (see the module docstring)."""

    def __init__(self, world_size: int, role: str, timeout_s: float | None = None):
        self._world_size = world_size
        self.role = role
        self.timeout_s = rpc_timeout_s(timeout_s)
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}

    @property
    def world_size(self) -> int:
        return self._world_size

    # --- binding --------------------------------------------------------------------------------

    def _bind_worker_methods(self, user_cls, prefix: str | None = None) -> list[str]:
        """Expose the registered methods of `user_cls` on this group.

        A colocated class maps each fused method name to `(role, method)` in `_verl_role_methods`;
        its methods keep the `<role>_` prefix on the group, except with `prefix=role`, which binds
        only that role's methods under their own names (the per-role view `spawn` returns).
        """
        role_methods = getattr(user_cls, "_verl_role_methods", None)
        bound = []
        for remote_name, info in get_registered_methods(user_cls).items():
            role = self.role
            public_name = remote_name
            if role_methods is not None:
                role, public_name = role_methods.get(remote_name, (self.role, remote_name))
                if prefix is None:
                    public_name = remote_name
                elif role != prefix:
                    continue
            existing = getattr(type(self), public_name, None)
            if existing is not None:
                raise AttributeError(
                    f"worker method {public_name!r} of {user_cls.__name__} clashes with the worker group attribute "
                    f"of the same name; rename the method"
                )
            setattr(self, public_name, _BoundMethod(self, public_name, remote_name, info, role))
            bound.append(public_name)
        return bound

    # --- the call path --------------------------------------------------------------------------

    def _call(self, role: str, public_name: str, remote_name: str, info: RegisteredMethod, args, kwargs):
        calls, state = info.dispatch_mode.dispatch(self, args, kwargs)
        ranks = [0] if info.execute_mode is Execute.RANK_ZERO else range(self._world_size)
        if not info.blocking:  # futures go to the caller: plain transport
            outputs = self._submit(remote_name, [calls[rank] for rank in ranks])
        else:
            lease: list = []
            concatenated = info.execute_mode is Execute.ALL and info.dispatch_mode.copies_outputs
            # the modes that concatenate DataProtos are the ones whose results are large
            refs = self._submit(remote_name, [calls[rank] for rank in ranks], lease=lease, large_results=concatenated)
            # collect concatenates (copies) the outputs, so they need not be copied out of Ray first
            from verl.protocol import _borrow_buffers

            with _borrow_buffers() if concatenated else contextlib.nullcontext():
                outputs = self._wait(refs, ranks=list(ranks), role=role, method=public_name, lease=lease)
        if info.execute_mode is Execute.RANK_ZERO:
            return outputs[0]
        return info.dispatch_mode.collect(self, outputs, state, futures=not info.blocking)

    def execute_all(self, method_name: str, *args, **kwargs) -> list:
        """Call `method_name` on every worker; wait; results in rank order. As upstream, when every
        argument is a list with one entry per worker, worker i gets entry i of each; otherwise every
        worker gets the same arguments."""
        lease: list = []
        refs = self._submit(method_name, _split_or_broadcast(self._world_size, args, kwargs), lease=lease)
        return self._wait(refs, ranks=list(range(self._world_size)), role=self.role, method=method_name, lease=lease)

    execute_all_sync = execute_all

    def execute_all_async(self, method_name: str, *args, **kwargs) -> list:
        """Like `execute_all`, returning one future per worker without waiting."""
        return self._submit(method_name, _split_or_broadcast(self._world_size, args, kwargs))

    def execute_rank_zero(self, method_name: str, *args, **kwargs) -> Any:
        """Call `method_name` on rank 0 only; wait; return its result."""
        lease: list = []
        refs = self._submit(method_name, [(args, kwargs)], lease=lease)
        return self._wait(refs, ranks=[0], role=self.role, method=method_name, lease=lease)[0]

    def execute_rank_zero_async(self, method_name: str, *args, **kwargs):
        return self._submit(method_name, [(args, kwargs)])[0]

    # --- mesh info for the mesh-aware dispatch mode ---------------------------------------------

    def _query_dispatch_info(self, mesh_name: str) -> list[int]:
        if mesh_name not in self._dispatch_info:
            dp_ranks = self._query_all("_query_dispatch_info", mesh_name)
            collect = self._query_all("_query_collect_info", mesh_name)
            missing = [rank for rank, dp in enumerate(dp_ranks) if dp is None]
            if missing:
                raise RuntimeError(
                    f"{self.role}: rank(s) {missing} have not registered device mesh {mesh_name!r}; call "
                    f"self._register_dispatch_collect_info({mesh_name!r}, dp_rank=..., is_collect=...) on every rank "
                    "(in __init__ or init_model) before calling a method dispatched over that mesh"
                )
            if sorted(set(dp_ranks)) != list(range(max(dp_ranks) + 1)):
                raise ValueError(
                    f"{self.role}: mesh {mesh_name!r} data-parallel ranks {dp_ranks} must cover 0..dp_size-1 without gaps"
                )
            self._dispatch_info[mesh_name] = dp_ranks
            self._collect_info[mesh_name] = collect
        return self._dispatch_info[mesh_name]

    def _query_collect_info(self, mesh_name: str) -> list[bool]:
        self._query_dispatch_info(mesh_name)
        return self._collect_info[mesh_name]

    # --- supplied by the backend ----------------------------------------------------------------

    def _submit(
        self, remote_name: str, calls: list[tuple[tuple, dict]], lease: list | None = None, large_results: bool = False
    ) -> list:
        """Start `remote_name` on ranks 0..len(calls)-1 with the given (args, kwargs); return futures.

        `lease` (blocking calls only: a list handed to `_wait` next) lets the backend take
        per-call resources, such as a shared-memory channel, that `_wait` gives back: for large
        arguments, and for the results when `large_results` says they are likely large."""
        raise NotImplementedError

    def _wait(self, refs: list, ranks: list[int], role: str, method: str, lease: list | None = None) -> list:
        """Wait for `refs` (of `ranks`) within the deadline; raise a WorkerGroupError on failure.
        With the `lease` filled by `_submit`: read the results from its channels and give them back."""
        raise NotImplementedError

    def _query_all(self, worker_method: str, *args) -> list:
        """Call a plain (unregistered) Worker method on every rank and wait."""
        raise NotImplementedError
