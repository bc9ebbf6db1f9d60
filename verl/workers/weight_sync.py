"""Weight transfer from the trainer pool to a separate rollout pool over torch.distributed.

When the actor and the rollout engine live in different worker groups (asynchronous training,
`async_training.staleness_threshold >= 1`), they are members of two different default process
groups. This module builds a third, private group spanning the actor's rank 0 (group rank 0, the
sender) and every rollout worker (group ranks 1..N, the receivers), and broadcasts the weights
over it.

Design decisions:
- The group is a plain `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) built from a
  `TCPStore` that actor rank 0 hosts on a fresh port; it never touches either side's default
  group, so the two pools keep their own `init_process_group`.
- Buckets: the sender packs the HF-named tensors into flat buffers of one dtype each, about
  `bucket_bytes` large, and broadcasts one buffer per collective (few large messages instead of
  one per parameter). A bucket's layout (names, shapes, dtype) travels through the store under
  `v<version>/b<i>` just before its broadcast, so the receiver needs no prior knowledge of the
  model; an end marker closes each version. Receivers unpack lazily, so the engine loads a bucket
  while the next one is still in flight.
- Receivers first, then the wire. A receiver that starts taking version v writes
  `v<version>/ready/<rank>`; the sender's background thread waits (on the store, host side, up to
  the deadline) until every receiver has written it, and only then issues any collective. Rollout
  workers are often busy with queued generations when the trainer sends; with NCCL an issued
  broadcast whose peers have not arrived occupies GPU streams, so nothing is issued before they
  are there.
- Streams (CUDA): the broadcasts run on a stream of the sender's own, which first waits for the
  packing queued on the trainer's stream; the background thread then waits for that stream on the
  host. The trainer's stream never waits for a broadcast: NCCL's `work.wait()` makes the *calling
  thread's current stream* wait for the collective, which on a fresh thread is the default stream
  the trainer computes on, so calling it there would stall the next training step until the
  rollout workers had received.
- Deadline: the group's timeout bounds every wait (rendezvous, store reads, the receivers'
  readiness, each broadcast). Broadcasts are polled on the host against that deadline rather than
  left to NCCL's watchdog, whose own timeout is set later (`_NCCL_WATCHDOG_GRACE_S` more) so that
  an expired wait raises `WeightSyncTimeoutError` and aborts the communicator instead of the
  watchdog killing the process. The error names the side that did not arrive (the trainer, or the
  rollout workers), the version and the bucket, and says what to check.
- Connecting: an NCCL group connects on its first collective, and connecting waits for work
  already queued on the device. Sender and receivers are built together (`init_weight_sync` on both
  worker groups at once), so the constructor broadcasts one element to connect while nothing is
  queued; a later broadcast then only enqueues, and its deadline holds.
- Memory: the packed copy is what the background send broadcasts after `send_weights` returns. It
  holds the tensors in the dtype they are given in: the worker hands over the rollout dtype (bf16
  on GPU), cast shard by shard before gathering, so rank 0 never holds an fp32 copy of the model
  on its device (a bf16 copy stays there until the receivers have it).
- Announcement: a send first writes its version under `latest`, so a receiver busy generating
  can ask, without blocking, whether newer weights are on their way (`WeightReceiver.latest_version`)
  and take them mid-generation (partial rollouts); every receiver must still take every version
  sent, since each bucket is a collective.
- Options (`checkpoint_engine.engine_kwargs.nccl`, upstream's nccl backend): `wire_dtype` casts
  the floating-point tensors as they are packed (the receiver's engine copies them into its own
  dtype); `group_name` names the group (its rendezvous keys in the store, and the errors);
  `rebuild_group` forms a fresh group for each version, right after every receiver has asked for
  it, and releases it once the version is through, so no communicator outlives a sync. Both ends
  must be built with the same `group_name` and `rebuild_group`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from verl.utils import device as dev
from verl.utils.ray_utils import node_ip

__all__ = [
    "WeightSender",
    "WeightReceiver",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "host_weight_sync_store",
    "group_options",
    "wire_dtype",
]

_PREFIX = "verl_weight_sync"
_END = b"end"
_LATEST = "latest"
# NCCL's watchdog fires this much after our own deadline, so the deadline is what a user sees.
_NCCL_WATCHDOG_GRACE_S = 120.0
_POLL_S = 0.002


class WeightSyncError(RuntimeError):
    """The trainer -> rollout weight transfer failed."""


class WeightSyncTimeoutError(WeightSyncError):
    """One side of the weight transfer did not arrive within the deadline."""


def host_weight_sync_store(timeout_s: float) -> tuple[dist.TCPStore, str, int]:
    """Start the rendezvous store on this process (the sender): (store, host IP, port)."""
    from verl.single_controller.base.worker import get_free_port

    host = node_ip(without_ray="127.0.0.1")  # a store in one process tree without Ray stays local
    port = get_free_port()
    store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, host, port


_WIRE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def group_options(checkpoint_engine) -> dict:
    """The group's keyword arguments (both ends) from `rollout.checkpoint_engine` (a
    `CheckpointEngineConfig`): naive broadcasts over the device's backend with upstream's defaults;
    nccl over NCCL with `engine_kwargs.nccl`'s group_name and rebuild_group."""
    return {
        "backend": "nccl" if checkpoint_engine.backend == "nccl" else None,
        "group_name": checkpoint_engine.nccl_option("group_name"),
        "rebuild_group": checkpoint_engine.nccl_option("rebuild_group"),
    }


def wire_dtype(checkpoint_engine) -> torch.dtype | None:
    """`engine_kwargs.nccl.rollout_dtype` as a torch dtype (the sender's `wire_dtype`); None: unset."""
    name = checkpoint_engine.nccl_option("rollout_dtype")
    return None if name is None else _WIRE_DTYPES[name]


def _new_group(store, prefix: str, rank: int, world_size: int, timeout_s: float, backend: str):
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s + _NCCL_WATCHDOG_GRACE_S)
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight sync backend {backend!r} is not one of gloo, nccl")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ready_key(version: int, rank: int) -> str:
    return f"v{version}/ready/{rank}"


class _Endpoint:
    """What sender and receiver share: the store, the group, the deadline and its wording."""

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str | None,
        group_name: str = "default",
        rebuild_group: bool = False,
    ):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend or dev.get_dist_backend()
        self.group_name = group_name
        self.rebuild_group = rebuild_group
        # CPU buffers for gloo; NCCL needs them on this rank's device.
        self.device = torch.device("cpu") if self.backend == "gloo" else dev.get_device()
        self.group = None
        if not rebuild_group:
            self._form_group(f"{_PREFIX}/{group_name}")

    def _form_group(self, prefix: str) -> None:
        try:
            self.group = _new_group(self.store, prefix, self.rank, self.world_size, self.timeout_s, self.backend)
        except Exception as exc:  # the rendezvous blocks until every member has connected
            raise self._timeout_error(f"forming the weight-sync group {self.group_name!r}", exc) from None
        if self.backend == "nccl":
            # NCCL connects on a group's first collective, and connecting waits for the device (seen
            # on the H100: a first broadcast queued behind 4 s of held stream work blocked the host
            # for those 4 s, past the 1 s deadline). Connect now, while nothing is queued, so every
            # later broadcast only enqueues and is polled against its deadline.
            self._broadcast(torch.zeros(1, device=self.device), "connecting the weight-sync group")

    def _open_version(self, version: int) -> None:
        """With `rebuild_group`, form this version's own group (every member calls it for every version)."""
        if self.rebuild_group:
            self._form_group(f"{_PREFIX}/{self.group_name}/v{version}")

    def _close_version(self) -> None:
        """With `rebuild_group`, release this version's group: nothing of it outlives the sync."""
        if self.rebuild_group:
            self.group = None

    def _missing_side(self) -> str:
        if self.rank == 0:
            return f"the rollout workers (weight-sync ranks 1..{self.world_size - 1})"
        return "the trainer (actor rank 0, weight-sync rank 0)"

    def _timeout_error(self, what: str, exc: BaseException | None = None) -> WeightSyncError:
        if exc is None:
            cause = ""
        else:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            cause = f" ({type(exc).__name__}: {text})"
        side = "trainer (sender)" if self.rank == 0 else f"rollout worker (receiver, weight-sync rank {self.rank})"
        return WeightSyncTimeoutError(
            f"weight sync failed on the {side} while {what}: {self._missing_side()} did not arrive within "
            f"{self.timeout_s:g} s or dropped out{cause}. Check that side's log for a "
            "crash; if it is only slow (long generations queued ahead of the sync), raise "
            "async_training.weight_sync_timeout_s"
        )

    def _broadcast(self, flat: torch.Tensor, what: str) -> None:
        """Broadcast `flat` from rank 0 on this thread's current stream and wait for it on the host,
        at most until the deadline (then the communicator is aborted: a collective left pending on
        NCCL would otherwise end in its watchdog killing the process)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        deadline = time.monotonic() + self.timeout_s
        try:
            work = self.group.broadcast([flat], opts)
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self._abort()
                    raise self._timeout_error(what)
                time.sleep(_POLL_S)
            work.wait()  # re-raises a failed collective's error (gloo); orders the current stream after it (NCCL)
            # NCCL can report the work complete while the broadcast still waits behind work queued
            # earlier on this stream (seen on the H100 with a one-rank group): the stream itself says
            # when the bytes are there, and is polled against the same deadline.
            while not dev.queued_work_done(flat.device):
                if time.monotonic() > deadline:
                    self._abort()
                    raise self._timeout_error(what)
                time.sleep(_POLL_S)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise self._timeout_error(what, exc) from None

    def _abort(self) -> None:
        abort = getattr(self.group, "abort", None)
        # best effort: the timeout error is what the caller needs
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()


class WeightSender(_Endpoint):
    """Rank 0 of the weight-sync group: packs HF-named tensors into buckets and broadcasts them."""

    def __init__(
        self,
        store,
        world_size: int,
        timeout_s: float,
        bucket_bytes: int,
        backend: str | None = None,
        group_name: str = "default",
        rebuild_group: bool = False,
        wire_dtype: torch.dtype | None = None,
    ):
        if bucket_bytes <= 0:
            raise ValueError(f"weight sync bucket size must be positive, got {bucket_bytes} bytes")
        if wire_dtype is not None and not wire_dtype.is_floating_point:
            raise ValueError(f"weight sync wire dtype must be a floating-point dtype, got {wire_dtype}")
        super().__init__(store, 0, world_size, timeout_s, backend, group_name, rebuild_group)
        self.bucket_bytes = int(bucket_bytes)
        self.wire_dtype = wire_dtype
        # The broadcasts' own stream (None on CPU): the trainer's stream never waits for it.
        self.stream = dev.new_stream(self.device)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[dict, torch.Tensor]]:
        """[(layout, flat buffer)]: consecutive tensors of one dtype, at most ~bucket_bytes per buffer
        (a single larger tensor gets a bucket of its own). Floating-point tensors are cast to
        `wire_dtype` when one is set; otherwise tensors keep their dtype: pass them in the dtype the
        receivers load (see the module docstring)."""
        buckets: list[tuple[dict, torch.Tensor]] = []
        names: list[str] = []
        parts: list[torch.Tensor] = []
        size = 0

        def flush():
            nonlocal names, parts, size
            if parts:
                layout = {
                    "names": names,
                    "shapes": [tuple(p.shape) for p in parts],
                    "dtype": _dtype_name(parts[0].dtype),
                }
                # `cat` copies: the bucket never shares storage with a (replicated) parameter
                flat = torch.cat([p.reshape(-1) for p in parts]).to(self.device)
                buckets.append((layout, flat))
            names, parts, size = [], [], 0

        for name, tensor in named_tensors:
            tensor = tensor.detach()
            if self.wire_dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.wire_dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if parts and (tensor.dtype != parts[0].dtype or size + nbytes > self.bucket_bytes):
                flush()
            names.append(name)
            parts.append(tensor)
            size += nbytes
        flush()
        return buckets

    def send(self, version: int, buckets: list[tuple[dict, torch.Tensor]]) -> None:
        """Broadcast one version's buckets once every receiver has asked for it; blocks until every
        receiver has them. On CUDA the broadcasts run on the sender's own stream."""
        dev.stream_wait_current(self.stream)
        self._send(version, buckets)

    def _send(self, version: int, buckets: list[tuple[dict, torch.Tensor]]) -> None:
        """`send` once the sender's stream is ordered after the packing (runs on any thread)."""
        self.announce(version)
        self._wait_for_receivers(version)
        with dev.on_stream(self.stream):
            self._open_version(version)  # a rebuilt NCCL group connects on the broadcasts' stream
            for i, (layout, flat) in enumerate(buckets):
                # JSON, not pickle: the store is a network port, and what it hands a receiver must not run code
                self.store.set(f"v{version}/b{i}", json.dumps({**layout, "numel": flat.numel()}).encode())
                self._broadcast(flat, f"broadcasting bucket {i} of weight version {version}")
        if self.stream is not None:
            self.stream.synchronize()
        self.store.set(f"v{version}/b{len(buckets)}", _END)
        self._close_version()

    def _wait_for_receivers(self, version: int) -> None:
        keys = [_ready_key(version, r) for r in range(1, self.world_size)]
        if not keys:
            return
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise self._timeout_error(f"waiting for the receivers to ask for weight version {version}", exc) from None

    def announce(self, version: int) -> None:
        """Tell receivers (`latest_version`) that `version` is on its way."""
        self.store.set(_LATEST, str(int(version)).encode())

    def send_async(self, version: int, buckets: list[tuple[dict, torch.Tensor]]) -> None:
        """`send` in a background thread, after the previous send has finished (raising its error).
        The version is announced before this returns, so a receiver asking next sees it. Returns
        without waiting for the receivers, and never makes the caller's stream wait. Until the send
        is joined (`wait`), the thread owns `self.store`: a store client serves one thread at a time."""
        self.wait()
        # the buffers were packed on the caller's stream: the broadcasts' stream starts after that
        dev.stream_wait_current(self.stream)
        self.announce(version)
        self._thread = threading.Thread(target=self._run, args=(version, buckets), daemon=True, name="weight-sync")
        self._thread.start()

    def _run(self, version, buckets) -> None:
        try:
            self._send(version, buckets)
        except BaseException as exc:  # re-raised by wait() on the caller's thread
            self._error = exc

    def wait(self) -> None:
        """Join the pending background send; re-raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class WeightReceiver(_Endpoint):
    """A rollout worker's end of the group: yields the HF-named tensors of one version as they arrive."""

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str | None = None,
        group_name: str = "default",
        rebuild_group: bool = False,
    ):
        if rank < 1:
            raise ValueError(f"a receiver's weight-sync rank must be >= 1 (rank 0 sends), got {rank}")
        super().__init__(store, rank, world_size, timeout_s, backend, group_name, rebuild_group)

    def latest_version(self) -> int | None:
        """The newest version the sender has started to send (None before the first); does not block."""
        try:
            if not self.store.check([_LATEST]):
                return None
            return int(self.store.get(_LATEST))
        except Exception as exc:
            raise self._timeout_error("asking for the newest weight version", exc) from None

    def receive(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Named tensors of weight `version` (consume the iterator to the end: every bucket is a
        collective). The sender starts broadcasting once every receiver has started this."""
        try:
            self.store.set(_ready_key(version, self.rank), b"1")
        except Exception as exc:
            raise self._timeout_error(f"asking for weight version {version}", exc) from None
        self._open_version(version)
        i = 0
        while True:
            key = f"v{version}/b{i}"
            try:
                raw = self.store.get(key)
            except Exception as exc:
                raise self._timeout_error(f"waiting for bucket {i} of weight version {version}", exc) from None
            if raw == _END:
                self._close_version()
                return
            layout = json.loads(raw)
            flat = torch.empty(layout["numel"], dtype=getattr(torch, layout["dtype"]), device=self.device)
            self._broadcast(flat, f"receiving bucket {i} of weight version {version}")
            offset = 0
            for name, shape in zip(layout["names"], layout["shapes"]):
                numel = 1
                for d in shape:
                    numel *= d
                yield name, flat[offset : offset + numel].view(shape)
                offset += numel
            i += 1


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A receiver's client connection to the sender's store."""
    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise WeightSyncTimeoutError(
            f"a rollout worker could not reach the trainer's weight-sync store at {host}:{port} within "
            f"{timeout_s:g} s ({type(exc).__name__}: {exc}); is actor rank 0 alive and the port reachable "
            "from the rollout nodes?"
        ) from None
