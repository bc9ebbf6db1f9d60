"""`@register`: how a worker method is called from the driver.

A worker class marks each remote procedure with `@register(dispatch_mode=..., execute_mode=...,
blocking=..., materialize_futures=...)`. The worker group reads those marks and exposes each
method on the group object: `wg.update_actor(batch)` splits `batch` across the workers (dispatch),
runs the method on each (execute), and merges what they return (collect).

A dispatch mode is one object with two halves:

- `dispatch(worker_group, args, kwargs) -> (per_worker, state)`: one `(args, kwargs)` pair per
  worker, plus whatever `collect` needs later (the padding added, say);
- `collect(worker_group, outputs, state, futures)`: merge the per-worker outputs; `futures` is True
  when the call is non-blocking and `outputs` are object references, not values.

Built-in modes (the dispatch table in docs/single_controller.md):

| mode                       | each worker receives                       | the driver gets back            |
|----------------------------|--------------------------------------------|---------------------------------|
| ONE_TO_ALL                 | the same arguments                         | list of results, rank order     |
| ALL_TO_ALL (the default)   | entry i of each argument when every one is | list of results, rank order     |
|                            | a list of world_size entries; else the same|                                 |
| DP_COMPUTE                 | entry i of each list argument              | list of results                 |
| DP_COMPUTE_PROTO           | chunk i of each DataProto (auto-padded)    | one DataProto, padding removed  |
| DP_COMPUTE_PROTO_WITH_FUNC | the first argument (a function) + chunk i  | one DataProto, padding removed  |
| DP_COMPUTE_METRIC          | chunk i of each DataProto (auto-padded)    | list of results (e.g. metrics)  |
| RANK_ZERO                  | rank 0 only, the arguments unchanged       | rank 0's result                 |
| make_nd_compute_dataproto_dispatch_fn(mesh) | chunk dp_rank of each DataProto | concat of the collecting ranks |

The mesh-aware mode serves tensor/pipeline parallelism: several ranks hold the same data-parallel
shard. Each worker registers `(dp_rank, is_collect)` per mesh name with
`Worker._register_dispatch_collect_info`; the group asks the workers once and caches the answer.

ALL_TO_ALL follows upstream's rule (its worker group's `execute_all` applies it, and so does
ours): when every positional and keyword argument is a `list` with one entry per worker, worker i
gets entry i of each, so the list one ONE_TO_ALL call returns can feed the next call rank by rank;
any other arguments go to every worker unchanged. DP_COMPUTE always splits and says so when an
argument is not such a list. The DataProto modes also take TensorDicts (chunked with
`verl.utils.tensordict_utils`, results concatenated back into one TensorDict), as upstream does.
Padding duplicates the first rows of the batch so every rank gets an equal chunk; the extra rows
are cut from the result.

`register_dispatch_mode(name, dispatch_fn, collect_fn)` adds a mode written in upstream's style:
`dispatch_fn(worker_group, *args, **kwargs)` returns `(args, kwargs)` whose every entry is a list
with one value per worker, and `collect_fn(worker_group, outputs)` merges the list of outputs.
`DISPATCH_MODE_FN_REGISTRY` (and `get_predefined_dispatch_fn(mode)`) show every mode in that
style, `{"dispatch_fn": ..., "collect_fn": ...}`, for code that drives a worker group by hand; the
built-in modes' functions there cannot pad, so their `dispatch_fn` refuses a batch that does not
split evenly (the worker group itself pads).

`@register` also takes `async def` methods: the group then calls them through the worker's async
entry point, so they run on the worker's event loop (Ray makes any actor with an async method an
asyncio actor). Awaiting inside is fine; blocking calls there stall the actor's other calls.

This module imports neither ray nor torch; `verl.protocol` is imported only when a DataProto is
actually handled.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "DISPATCH_MODE_FN_REGISTRY",
    "Dispatch",
    "DispatchMode",
    "Execute",
    "RegisteredMethod",
    "collect_all_to_all",
    "get_predefined_dispatch_fn",
    "get_predefined_execute_fn",
    "get_registered_methods",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
    "update_dispatch_mode",
]

_REGISTER_ATTR = "_verl_registered_method"

PerWorkerCall = tuple[tuple, dict]


class Execute(Enum):
    """Which workers run the method: all of them, or rank 0 only (its result is returned as is)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


class DispatchMode:
    """Base class of dispatch modes; subclasses implement `dispatch` and `collect`."""

    name: str = "CUSTOM"
    # True when `collect` copies every tensor out of the per-worker outputs (it concatenates them):
    # the worker group may then let those outputs borrow Ray's buffers instead of copying them first.
    copies_outputs: bool = False

    def dispatch(self, worker_group, args: tuple, kwargs: dict) -> tuple[list[PerWorkerCall], Any]:
        raise NotImplementedError

    def collect(self, worker_group, outputs: list, state: Any, futures: bool) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"Dispatch.{self.name}"


# ---------------------------------------------------------------------------------------------
# Helpers shared by the modes
# ---------------------------------------------------------------------------------------------


def _protocol():
    import verl.protocol as protocol

    return protocol


def _broadcast(world_size: int, args: tuple, kwargs: dict) -> list[PerWorkerCall]:
    # The very same objects for every worker: the Ray layer spots the identity and ships a large
    # argument to the object store once, not once per worker.
    return [(args, kwargs)] * world_size


def _batch_types():
    """(DataProto, TensorDict, DataProtoFuture): the arguments the DataProto modes split."""
    from tensordict import TensorDict

    protocol = _protocol()
    return protocol.DataProto, TensorDict, protocol.DataProtoFuture


def _chunk(value, num_chunks: int) -> list:
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    if not isinstance(value, TensorDict):
        return value.chunk(num_chunks)
    # A chunk is a view: pickled for Ray it would carry the whole batch's storage to every rank.
    # Consolidating copies each chunk into one buffer of its own (upstream ships chunks the same way).
    return [tu.contiguous(part).consolidate() for part in tu.chunk_tensordict(value, num_chunks)]


def _pad(value, num_chunks: int):
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    if isinstance(value, TensorDict):
        return tu.pad_to_divisor(value, num_chunks)[0]
    return _protocol().pad_dataproto_to_divisor(value, num_chunks)[0]


def _split_or_broadcast(world_size: int, args: tuple, kwargs: dict) -> list[PerWorkerCall]:
    """Upstream's ALL_TO_ALL / `execute_all` rule: entry i of each argument to worker i when every
    argument is a list of `world_size` entries, else the same arguments to every worker."""
    values = list(args) + list(kwargs.values())
    if values and all(isinstance(v, list) and len(v) == world_size for v in values):
        return [(tuple(a[rank] for a in args), {k: v[rank] for k, v in kwargs.items()}) for rank in range(world_size)]
    return _broadcast(world_size, args, kwargs)


def _split_data_protos(
    method_desc: str, num_chunks: int, args: tuple, kwargs: dict
) -> tuple[list[list], dict[str, list], int]:
    """Pad every DataProto / TensorDict argument to a multiple of `num_chunks` and chunk it.

    Returns per-argument chunk lists and the number of padding rows added. DataProtoFutures
    cannot be padded (their length is unknown until they resolve): they must divide evenly.
    """
    data_proto, tensor_dict, future = _batch_types()
    values = list(args) + list(kwargs.values())
    for pos, value in enumerate(values):
        name = f"argument {pos}" if pos < len(args) else f"keyword argument {list(kwargs)[pos - len(args)]!r}"
        if not isinstance(value, data_proto | tensor_dict | future):
            raise TypeError(
                f"{method_desc} dispatches DataProto / TensorDict chunks to the data-parallel ranks, but its {name} "
                f"is a {type(value).__name__}; pass DataProto or TensorDict objects only (put scalars in "
                "data.meta_info) or register the method with another dispatch mode"
            )
        if isinstance(value, tensor_dict) and not value.batch_size:
            raise ValueError(
                f"{method_desc}: its {name} is a TensorDict without a batch dimension, so it has no rows to split "
                "across ranks; build it with batch_size=[number of rows]"
            )
    lengths = {len(v) for v in values if isinstance(v, data_proto | tensor_dict)}
    if len(lengths) > 1:
        raise ValueError(
            f"{method_desc} got DataProto / TensorDict arguments of different lengths {sorted(lengths)}; they are "
            "chunked together across ranks, so every one of them must have the same number of rows"
        )
    pad_size = 0
    if lengths:
        length = lengths.pop()
        if length == 0:
            raise ValueError(f"{method_desc} got an empty batch; there is nothing to split across ranks")
        pad_size = -length % num_chunks
    if pad_size and any(isinstance(v, future) for v in values):
        raise ValueError(
            f"{method_desc}: {length} rows need {pad_size} padding rows to split across {num_chunks} ranks, but a "
            "DataProtoFuture argument cannot be padded alongside them; materialize it with .get() first or use a "
            f"batch size divisible by {num_chunks}"
        )
    if pad_size:
        values = [_pad(v, num_chunks) if isinstance(v, data_proto | tensor_dict) else v for v in values]
    chunks = [_chunk(v, num_chunks) for v in values]
    return chunks[: len(args)], dict(zip(kwargs, chunks[len(args) :])), pad_size


def _concat_outputs(outputs: list, pad_size: int):
    from verl.utils import tensordict_utils as tu

    data_proto, tensor_dict, _ = _batch_types()
    for dp_rank, out in enumerate(outputs):
        if not isinstance(out, data_proto | tensor_dict):
            raise TypeError(
                f"a DataProto-dispatched method must return a DataProto (or a TensorDict) from every rank so the "
                f"results can be concatenated, but data-parallel rank {dp_rank} returned {type(out).__name__}; "
                "return one of those or register the method with DP_COMPUTE_METRIC / DP_COMPUTE to get a list"
            )
    if all(isinstance(out, tensor_dict) for out in outputs):
        merged = tu.concat_tensordict(outputs)
        return tu.unpad(merged, pad_size)
    if not all(isinstance(out, data_proto) for out in outputs):
        raise TypeError(
            "a DataProto-dispatched method must return the same kind of batch from every rank; got "
            f"{[type(out).__name__ for out in outputs]} (all DataProtos or all TensorDicts)"
        )
    merged = data_proto.concat(outputs)
    return _protocol().unpad_dataproto(merged, pad_size) if pad_size else merged


def _future_of_concat(refs: list, pad_size: int):
    """A DataProtoFuture over the per-rank object references, concatenated (and unpadded) on get()."""
    protocol = _protocol()
    return protocol.DataProtoFuture(collect_fn=functools.partial(_concat_outputs, pad_size=pad_size), futures=refs)


# ---------------------------------------------------------------------------------------------
# Built-in modes
# ---------------------------------------------------------------------------------------------


class _OneToAll(DispatchMode):
    name = "ONE_TO_ALL"

    def dispatch(self, worker_group, args, kwargs):
        return _broadcast(worker_group.world_size, args, kwargs), None

    def collect(self, worker_group, outputs, state, futures):
        return list(outputs)


class _AllToAll(DispatchMode):
    name = "ALL_TO_ALL"

    def dispatch(self, worker_group, args, kwargs):
        return _split_or_broadcast(worker_group.world_size, args, kwargs), None

    def collect(self, worker_group, outputs, state, futures):
        return list(outputs)


class _RankZero(DispatchMode):
    name = "RANK_ZERO"

    def dispatch(self, worker_group, args, kwargs):
        return _broadcast(worker_group.world_size, args, kwargs), None

    def collect(self, worker_group, outputs, state, futures):
        return outputs[0]


def dummy_direct_rollout_call(worker_group, *args, **kwargs):
    raise NotImplementedError(
        "a Dispatch.DIRECT_ROLLOUT_METHOD method is not dispatched by a worker group: call it on a worker's "
        "actor handle (worker_group.workers[i].<method>.remote(...)); a colocated class binds it unprefixed"
    )


class _DirectRollout(DispatchMode):  # upstream's: servers call such methods on each worker's handle
    name = "DIRECT_ROLLOUT_METHOD"

    def dispatch(self, worker_group, args, kwargs):
        dummy_direct_rollout_call(worker_group)


class _DPCompute(DispatchMode):
    name = "DP_COMPUTE"

    def dispatch(self, worker_group, args, kwargs):
        world_size = worker_group.world_size
        for label, value in [(f"argument {i}", a) for i, a in enumerate(args)] + [
            (f"keyword argument {k!r}", v) for k, v in kwargs.items()
        ]:
            if not isinstance(value, list | tuple) or len(value) != world_size:
                got = (
                    f"a {type(value).__name__} of length {len(value)}"
                    if isinstance(value, list | tuple)
                    else (f"a {type(value).__name__}")
                )
                raise ValueError(
                    f"DP_COMPUTE sends entry i of each argument to rank i, so every argument must be a list with "
                    f"one entry per worker ({world_size}); {label} is {got}"
                )
        calls = [(tuple(a[rank] for a in args), {k: v[rank] for k, v in kwargs.items()}) for rank in range(world_size)]
        return calls, None

    def collect(self, worker_group, outputs, state, futures):
        return list(outputs)


class _DPComputeProto(DispatchMode):
    """Chunk DataProto arguments across ranks; concat (or list) the results."""

    def __init__(self, name: str, with_func: bool, concat: bool):
        self.name = name
        self.with_func = with_func
        self.concat = concat
        self.copies_outputs = concat

    def dispatch(self, worker_group, args, kwargs):
        world_size = worker_group.world_size
        head: tuple = ()
        if self.with_func:
            if not args or not callable(args[0]):
                raise TypeError(
                    f"{self.name} expects a function as the first argument (it is sent unchanged to every rank), "
                    f"followed by DataProto arguments; got {type(args[0]).__name__ if args else 'no arguments'}"
                )
            head, args = args[:1], args[1:]
        arg_chunks, kwarg_chunks, pad_size = _split_data_protos(self.name, world_size, args, kwargs)
        calls = [
            (head + tuple(c[rank] for c in arg_chunks), {k: c[rank] for k, c in kwarg_chunks.items()})
            for rank in range(world_size)
        ]
        return calls, pad_size

    def collect(self, worker_group, outputs, state, futures):
        if not self.concat:
            return list(outputs)
        if futures:
            return _future_of_concat(list(outputs), state)
        return _concat_outputs(list(outputs), state)


class _NDComputeProto(DispatchMode):
    """Dispatch by each worker's registered data-parallel rank on one device mesh; collect only from
    the ranks marked as collecting (one per data-parallel rank)."""

    copies_outputs = True

    def __init__(self, mesh_name: str):
        self.mesh_name = mesh_name
        self.name = f"ND_COMPUTE_PROTO[{mesh_name}]"

    def dispatch(self, worker_group, args, kwargs):
        dp_ranks = worker_group._query_dispatch_info(self.mesh_name)
        dp_size = max(dp_ranks) + 1
        arg_chunks, kwarg_chunks, pad_size = _split_data_protos(self.name, dp_size, args, kwargs)
        calls = [(tuple(c[dp] for c in arg_chunks), {k: c[dp] for k, c in kwarg_chunks.items()}) for dp in dp_ranks]
        return calls, pad_size

    def collect(self, worker_group, outputs, state, futures):
        dp_ranks = worker_group._query_dispatch_info(self.mesh_name)
        is_collect = worker_group._query_collect_info(self.mesh_name)
        by_dp = {}
        for rank, (dp, collect) in enumerate(zip(dp_ranks, is_collect)):
            if collect:
                if dp in by_dp:
                    raise ValueError(
                        f"mesh {self.mesh_name!r}: ranks {by_dp[dp][0]} and {rank} are both marked as collecting for "
                        f"data-parallel rank {dp}; mark exactly one rank per data-parallel shard with is_collect=True"
                    )
                by_dp[dp] = (rank, outputs[rank])
        missing = sorted(set(dp_ranks) - set(by_dp))
        if missing:
            raise ValueError(
                f"mesh {self.mesh_name!r}: no rank is marked as collecting for data-parallel rank(s) {missing}; "
                "mark exactly one rank per data-parallel shard with is_collect=True"
            )
        selected = [by_dp[dp][1] for dp in sorted(by_dp)]
        if futures:
            return _future_of_concat(selected, state)
        return _concat_outputs(selected, state)


class _FunctionMode(DispatchMode):
    """A mode given as upstream-style `dispatch_fn` / `collect_fn` functions."""

    def __init__(self, name: str, dispatch_fn: Callable, collect_fn: Callable):
        self.name = name
        self.dispatch_fn = dispatch_fn
        self.collect_fn = collect_fn

    def dispatch(self, worker_group, args, kwargs):
        world_size = worker_group.world_size
        new_args, new_kwargs = self.dispatch_fn(worker_group, *args, **kwargs)
        for label, value in [(f"argument {i}", a) for i, a in enumerate(new_args)] + [
            (f"keyword argument {k!r}", v) for k, v in new_kwargs.items()
        ]:
            if not isinstance(value, list | tuple) or len(value) != world_size:
                raise ValueError(
                    f"dispatch mode {self.name}: dispatch_fn must return (args, kwargs) whose every entry is a list "
                    f"with one value per worker ({world_size}); {label} is {type(value).__name__}"
                    + (f" of length {len(value)}" if isinstance(value, list | tuple) else "")
                )
        calls = [
            (tuple(a[rank] for a in new_args), {k: v[rank] for k, v in new_kwargs.items()})
            for rank in range(world_size)
        ]
        return calls, None

    def collect(self, worker_group, outputs, state, futures):
        return self.collect_fn(worker_group, list(outputs))


class _DispatchRegistry(type):
    """Lets `Dispatch` be used like an enum that users can extend (`Dispatch.MY_MODE`)."""

    def __getitem__(cls, name: str) -> DispatchMode:
        mode = cls._modes.get(name)
        if mode is None:
            raise KeyError(f"unknown dispatch mode {name!r}; known modes: {sorted(cls._modes)}")
        return mode

    def __iter__(cls):
        return iter(cls._modes.values())

    def __contains__(cls, name: str) -> bool:
        return name in cls._modes

    def remove(cls, name: str) -> None:
        """Drop a mode added with `register_dispatch_mode` (built-in modes stay: workers rely on them)."""
        mode = cls._modes.get(name)
        if not isinstance(mode, _FunctionMode):
            raise ValueError(
                f"only modes added with register_dispatch_mode can be removed; {name!r} is "
                + ("built in" if mode is not None else "unknown")
            )
        del cls._modes[name]
        delattr(cls, name)


class Dispatch(metaclass=_DispatchRegistry):
    """The dispatch modes; `register_dispatch_mode` adds attributes to this class."""

    _modes: dict[str, DispatchMode] = {}

    ONE_TO_ALL = _OneToAll()
    ALL_TO_ALL = _AllToAll()
    RANK_ZERO = _RankZero()
    DP_COMPUTE = _DPCompute()
    DP_COMPUTE_PROTO = _DPComputeProto("DP_COMPUTE_PROTO", with_func=False, concat=True)
    DP_COMPUTE_PROTO_WITH_FUNC = _DPComputeProto("DP_COMPUTE_PROTO_WITH_FUNC", with_func=True, concat=True)
    DP_COMPUTE_METRIC = _DPComputeProto("DP_COMPUTE_METRIC", with_func=False, concat=False)
    DIRECT_ROLLOUT_METHOD = _DirectRollout()


Dispatch._modes.update({m.name: m for m in vars(Dispatch).values() if isinstance(m, DispatchMode)})


def register_dispatch_mode(name: str, dispatch_fn: Callable, collect_fn: Callable) -> DispatchMode:
    """Add a user-defined mode, reachable afterwards as `Dispatch.<name>`.

    `dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)` with one value per worker in
    every entry; `collect_fn(worker_group, outputs) -> result`.
    """
    if not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"dispatch mode name {name!r} must be a public Python identifier, e.g. 'MY_MODE'")
    if name in Dispatch._modes:
        raise ValueError(
            f"dispatch mode {name!r} already exists; use update_dispatch_mode(Dispatch.{name}, ...) to replace its "
            "functions"
        )
    mode = _FunctionMode(name, dispatch_fn, collect_fn)
    Dispatch._modes[name] = mode
    setattr(Dispatch, name, mode)
    return mode


def update_dispatch_mode(dispatch_mode: DispatchMode | str, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Replace the functions of a mode, as upstream allows: a mode added with `register_dispatch_mode`,
    or a built-in one, which then dispatches through the function pair (it can no longer pad an
    uneven batch) until its own functions (`get_predefined_dispatch_fn` before the update) are put back."""
    _check_dispatch_mode(dispatch_mode)
    if not (callable(dispatch_fn) and callable(collect_fn)):
        raise TypeError(f"dispatch_fn and collect_fn must be callable, got {dispatch_fn!r} and {collect_fn!r}")
    name = dispatch_mode if isinstance(dispatch_mode, str) else dispatch_mode.name
    mode = Dispatch._modes.get(name)
    if mode is None:
        raise ValueError(f"dispatch mode {name!r} is not registered; add it with register_dispatch_mode")
    if isinstance(mode, _FunctionMode):
        mode.dispatch_fn = dispatch_fn
        mode.collect_fn = collect_fn
        return
    _restore_builtin(mode)
    if _own_functions(mode) == (dispatch_fn, collect_fn):
        return
    pair = _FunctionMode(name, dispatch_fn, collect_fn)
    mode.dispatch, mode.collect, mode.copies_outputs = pair.dispatch, pair.collect, False
    mode._function_pair = (dispatch_fn, collect_fn)


def _restore_builtin(mode: DispatchMode) -> None:
    for attribute in ("dispatch", "collect", "copies_outputs", "_function_pair"):
        mode.__dict__.pop(attribute, None)  # back to the class's own behaviour


_OWN_PAIRS: dict[str, tuple[Callable, Callable]] = {}


def _own_functions(mode: DispatchMode) -> tuple[Callable, Callable]:
    """A built-in mode's own (dispatch_fn, collect_fn), the same objects every time."""
    if mode.name in _BUILTIN_FUNCTIONS:
        return _BUILTIN_FUNCTIONS[mode.name]
    if mode.name not in _OWN_PAIRS:

        def dispatch_fn(worker_group, *args, **kwargs):
            return _transpose(mode, worker_group, args, kwargs)

        def collect_fn(worker_group, output):
            return type(mode).collect(mode, worker_group, output, 0, False)

        _OWN_PAIRS[mode.name] = (dispatch_fn, collect_fn)
    return _OWN_PAIRS[mode.name]


def _check_dispatch_mode(dispatch_mode) -> None:
    """Raise unless `dispatch_mode` is a dispatch mode (a `Dispatch` member, a registered mode's name,
    or a dict with `dispatch_fn` and `collect_fn`)."""
    _resolve_mode(dispatch_mode)


@functools.cache
def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> DispatchMode:
    """The mesh-aware DataProto mode for `mesh_name` (one object per mesh name)."""
    return _NDComputeProto(mesh_name)


# ---------------------------------------------------------------------------------------------
# Upstream's function-pair view of the modes
# ---------------------------------------------------------------------------------------------


def _transpose(mode: DispatchMode, worker_group, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # the mode's own dispatch, even while update_dispatch_mode has given it other functions (which may
    # wrap these very ones)
    calls, state = type(mode).dispatch(mode, worker_group, args, kwargs)
    if state:  # a DataProto mode padded the batch; a function pair has no way to tell collect_fn
        raise ValueError(
            f"{mode!r}.dispatch_fn: the batch needs {state} padding rows to split across {worker_group.world_size} "
            "workers, which this function pair cannot remove again; call the method through the worker group "
            "(it pads and unpads) or pass a batch whose length divides evenly"
        )
    num_args = len(calls[0][0]) if calls else 0
    split_args = tuple([call[0][i] for call in calls] for i in range(num_args))
    split_kwargs = {key: [call[1][key] for call in calls] for key in (calls[0][1] if calls else {})}
    return split_args, split_kwargs


def dispatch_one_to_all(worker_group, *args, **kwargs):
    """Every worker gets the same arguments (as lists of `world_size` copies)."""
    return _transpose(Dispatch.ONE_TO_ALL, worker_group, args, kwargs)


def dispatch_all_to_all(worker_group, *args, **kwargs):
    """Entry i of each argument to worker i when every argument is a list with one entry per
    worker; otherwise the same arguments to every worker (see the module docstring)."""
    return _transpose(Dispatch.ALL_TO_ALL, worker_group, args, kwargs)


def collect_all_to_all(worker_group, output):
    """The per-worker outputs, unchanged."""
    return output


def dispatch_dp_compute(worker_group, *args, **kwargs):
    """Entry i of each list argument to worker i (each argument must have one entry per worker)."""
    return _transpose(Dispatch.DP_COMPUTE, worker_group, args, kwargs)


def collect_dp_compute(worker_group, output):
    """The per-worker outputs as a list."""
    return list(output)


def dispatch_dp_compute_data_proto(worker_group, *args, **kwargs):
    """Chunk i of every DataProto argument to worker i (the length must divide evenly)."""
    return _transpose(Dispatch.DP_COMPUTE_PROTO, worker_group, args, kwargs)


def dispatch_dp_compute_data_proto_with_func(worker_group, *args, **kwargs):
    """The first argument (a function) to every worker, then chunk i of every DataProto argument."""
    return _transpose(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, worker_group, args, kwargs)


def collect_dp_compute_data_proto(worker_group, output):
    """The per-worker DataProtos concatenated (a DataProtoFuture when they are object references)."""
    protocol = _protocol()
    import ray

    if output and all(isinstance(o, ray.ObjectRef) for o in output):
        return protocol.DataProtoFuture.concat(list(output))
    return _concat_outputs(list(output), 0)


_BUILTIN_FUNCTIONS = {
    "ONE_TO_ALL": (dispatch_one_to_all, collect_all_to_all),
    "ALL_TO_ALL": (dispatch_all_to_all, collect_all_to_all),
    "DP_COMPUTE": (dispatch_dp_compute, collect_dp_compute),
    "DP_COMPUTE_PROTO": (dispatch_dp_compute_data_proto, collect_dp_compute_data_proto),
    "DP_COMPUTE_PROTO_WITH_FUNC": (dispatch_dp_compute_data_proto_with_func, collect_dp_compute_data_proto),
    "DP_COMPUTE_METRIC": (dispatch_dp_compute_data_proto, collect_dp_compute),
    "DIRECT_ROLLOUT_METHOD": (dummy_direct_rollout_call, dummy_direct_rollout_call),
}


class _FunctionRegistry(MutableMapping):
    """`{mode: {"dispatch_fn": f, "collect_fn": g}}` for every registered mode, read live from `Dispatch`
    (so `register_dispatch_mode` / `update_dispatch_mode` show up); keys are the `Dispatch` members
    (their names work too). Writable as upstream's dict is: setting an entry updates (or registers)
    the mode, deleting one removes a registered mode or restores a built-in one's own functions, so
    `saved = registry.copy(); ...; registry.clear(); registry.update(saved)` restores the modes."""

    def __getitem__(self, mode) -> dict[str, Callable]:
        name = mode if isinstance(mode, str) else getattr(mode, "name", None)
        found = Dispatch._modes.get(name)
        if found is None or (not isinstance(mode, str) and found is not mode):
            raise KeyError(f"{mode!r} is not a registered dispatch mode; known modes: {sorted(Dispatch._modes)}")
        if isinstance(found, _FunctionMode):
            return {"dispatch_fn": found.dispatch_fn, "collect_fn": found.collect_fn}
        if "_function_pair" in found.__dict__:  # a built-in mode given other functions
            dispatch_fn, collect_fn = found._function_pair
            return {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}
        dispatch_fn, collect_fn = _own_functions(found)
        return {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}

    def __iter__(self) -> Iterator[DispatchMode]:
        return iter(list(Dispatch._modes.values()))

    def __len__(self) -> int:
        return len(Dispatch._modes)

    def __setitem__(self, mode, functions: dict) -> None:
        if not isinstance(functions, dict) or not {"dispatch_fn", "collect_fn"} <= set(functions):
            raise TypeError(f"a registry entry is a dict with 'dispatch_fn' and 'collect_fn', got {functions!r}")
        name = mode if isinstance(mode, str) else getattr(mode, "name", None)
        if name in Dispatch._modes:
            update_dispatch_mode(name, functions["dispatch_fn"], functions["collect_fn"])
        elif isinstance(mode, _FunctionMode):  # a removed user mode put back: the same object again
            mode.dispatch_fn, mode.collect_fn = functions["dispatch_fn"], functions["collect_fn"]
            Dispatch._modes[name] = mode
            setattr(Dispatch, name, mode)
        else:
            register_dispatch_mode(name, functions["dispatch_fn"], functions["collect_fn"])

    def __delitem__(self, mode) -> None:
        name = mode if isinstance(mode, str) else getattr(mode, "name", None)
        found = Dispatch._modes.get(name)
        if found is None:
            raise KeyError(mode)
        if isinstance(found, _FunctionMode):
            Dispatch.remove(name)
        else:
            _restore_builtin(found)

    def clear(self) -> None:
        for mode in list(self):
            del self[mode]

    def copy(self) -> dict:
        """A plain dict snapshot `{mode: {"dispatch_fn": ..., "collect_fn": ...}}`."""
        return {mode: dict(self[mode]) for mode in self}


DISPATCH_MODE_FN_REGISTRY = _FunctionRegistry()


def get_predefined_dispatch_fn(dispatch_mode) -> dict[str, Callable]:
    """`{"dispatch_fn": ..., "collect_fn": ...}` of a mode (see `DISPATCH_MODE_FN_REGISTRY`)."""
    return DISPATCH_MODE_FN_REGISTRY[dispatch_mode]


def get_predefined_execute_fn(execute_mode: Execute) -> dict[str, str]:
    """The worker-group method that runs a mode: `execute_all` or `execute_rank_zero`."""
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode={execute_mode!r} is not an Execute member")
    return {"execute_fn_name": "execute_all" if execute_mode is Execute.ALL else "execute_rank_zero"}


def _resolve_mode(dispatch_mode) -> DispatchMode:
    if isinstance(dispatch_mode, DispatchMode):
        return dispatch_mode
    if isinstance(dispatch_mode, str):
        return Dispatch[dispatch_mode]
    if isinstance(dispatch_mode, dict) and {"dispatch_fn", "collect_fn"} <= set(dispatch_mode):
        fn = dispatch_mode["dispatch_fn"]
        return _FunctionMode(getattr(fn, "__name__", "CUSTOM"), fn, dispatch_mode["collect_fn"])
    raise TypeError(
        f"dispatch_mode={dispatch_mode!r} is not a dispatch mode; use a Dispatch member (e.g. Dispatch.ONE_TO_ALL), "
        "a mode name, or a dict {'dispatch_fn': ..., 'collect_fn': ...}"
    )


# ---------------------------------------------------------------------------------------------
# @register
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegisteredMethod:
    """What `@register` recorded about a worker method."""

    dispatch_mode: DispatchMode
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    is_async: bool = False


def _materialize_futures(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    protocol = sys.modules.get("verl.protocol")
    if protocol is None:  # no DataProtoFuture can exist in a process that never imported it
        return args, kwargs
    future_cls = protocol.DataProtoFuture
    args = tuple(a.get() if isinstance(a, future_cls) else a for a in args)
    kwargs = {k: v.get() if isinstance(v, future_cls) else v for k, v in kwargs.items()}
    return args, kwargs


def register(
    dispatch_mode=Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
):
    """Mark a worker method as callable on the worker group.

    Args:
        dispatch_mode: how arguments are split and results merged (a `Dispatch` member, the result
            of `make_nd_compute_dataproto_dispatch_fn`, or `{"dispatch_fn": f, "collect_fn": g}`).
        execute_mode: `Execute.ALL` runs on every worker; `Execute.RANK_ZERO` on rank 0 only.
        blocking: False makes the group call return at once with futures (a `DataProtoFuture` for
            DataProto modes, else a list of object references).
        materialize_futures: resolve `DataProtoFuture` arguments on the worker before the call.
    """
    mode = _resolve_mode(dispatch_mode)
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode={execute_mode!r} is not an Execute member; use Execute.ALL or Execute.RANK_ZERO")
    if mode is Dispatch.RANK_ZERO:
        execute_mode = Execute.RANK_ZERO

    def decorator(func):
        is_async = inspect.iscoroutinefunction(func)
        info = RegisteredMethod(mode, execute_mode, bool(blocking), bool(materialize_futures), is_async)

        if is_async:

            @functools.wraps(func)
            async def inner(*args, **kwargs):
                if materialize_futures:
                    args, kwargs = _materialize_futures(args, kwargs)
                return await func(*args, **kwargs)

        else:

            @functools.wraps(func)
            def inner(*args, **kwargs):
                if materialize_futures:
                    args, kwargs = _materialize_futures(args, kwargs)
                return func(*args, **kwargs)

        setattr(inner, _REGISTER_ATTR, info)
        return inner

    return decorator


def get_registered_methods(cls) -> dict[str, RegisteredMethod]:
    """{method name: RegisteredMethod} for every `@register`-ed method of `cls` (inherited included)."""
    found = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        try:
            attr = inspect.getattr_static(cls, name)
        except AttributeError:
            continue
        info = getattr(attr, _REGISTER_ATTR, None)
        if isinstance(info, RegisteredMethod):
            found[name] = info
    return found
