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
- Deadline: the group's timeout bounds every wait (rendezvous, store reads, broadcasts). When it
  expires, the error names the side that did not arrive (the trainer, or the rollout workers),
  the version and the bucket, and says what to check, instead of hanging.
- Sending runs in a background thread (`WeightSender.send_async`): the trainer's next update can
  start while the rollout workers are still busy generating and have not reached the receive.
  Versions are sent strictly in order (a send first joins the previous one).
- Announcement: a send first writes its version under `latest`, so a receiver busy generating
  can ask, without blocking, whether newer weights are on their way (`WeightReceiver.latest_version`)
  and take them mid-generation (partial rollouts); every receiver must still take every version
  sent, since each bucket is a collective.
"""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from verl.utils import device as dev

__all__ = ["WeightSender", "WeightReceiver", "WeightSyncError", "WeightSyncTimeoutError", "host_weight_sync_store"]

_PREFIX = "verl_weight_sync"
_END = b"end"
_LATEST = "latest"


class WeightSyncError(RuntimeError):
    """The trainer -> rollout weight transfer failed."""


class WeightSyncTimeoutError(WeightSyncError):
    """One side of the weight transfer did not arrive within the deadline."""


def host_weight_sync_store(timeout_s: float) -> tuple[dist.TCPStore, str, int]:
    """Start the rendezvous store on this process (the sender): (store, host IP, port)."""
    from verl.single_controller.base.worker import get_free_port

    host = _node_ip()
    port = get_free_port()
    store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, host, port


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def _new_group(store, rank: int, world_size: int, timeout_s: float, backend: str):
    prefixed = dist.PrefixStore(_PREFIX, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight sync backend {backend!r} is not one of gloo, nccl")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Endpoint:
    """What sender and receiver share: the store, the group and the timeout wording."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, backend: str | None):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend or dev.get_dist_backend()
        # CPU buffers for gloo; NCCL needs them on this rank's device.
        self.device = torch.device("cpu") if self.backend == "gloo" else dev.get_device()
        try:
            self.group = _new_group(store, rank, world_size, timeout_s, self.backend)
        except Exception as exc:  # the rendezvous blocks until every member has connected
            raise self._timeout_error("forming the weight-sync group", exc) from None

    def _missing_side(self) -> str:
        if self.rank == 0:
            return f"the rollout workers (weight-sync ranks 1..{self.world_size - 1})"
        return "the trainer (actor rank 0, weight-sync rank 0)"

    def _timeout_error(self, what: str, exc: BaseException) -> WeightSyncError:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        side = "trainer (sender)" if self.rank == 0 else f"rollout worker (receiver, weight-sync rank {self.rank})"
        return WeightSyncTimeoutError(
            f"weight sync failed on the {side} while {what}: {self._missing_side()} did not arrive within "
            f"{self.timeout_s:g} s or dropped out ({type(exc).__name__}: {text}). Check that side's log for a "
            "crash; if it is only slow (long generations queued ahead of the sync), raise "
            "async_training.weight_sync_timeout_s"
        )

    def _broadcast(self, flat: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.group.broadcast([flat], opts).wait()
        except Exception as exc:
            raise self._timeout_error(what, exc) from None


class WeightSender(_Endpoint):
    """Rank 0 of the weight-sync group: packs HF-named tensors into buckets and broadcasts them."""

    def __init__(self, store, world_size: int, timeout_s: float, bucket_bytes: int, backend: str | None = None):
        super().__init__(store, 0, world_size, timeout_s, backend)
        if bucket_bytes <= 0:
            raise ValueError(f"weight sync bucket size must be positive, got {bucket_bytes} bytes")
        self.bucket_bytes = int(bucket_bytes)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[dict, torch.Tensor]]:
        """[(layout, flat buffer)]: consecutive tensors of one dtype, at most ~bucket_bytes per buffer
        (a single larger tensor gets a bucket of its own)."""
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
                flat = torch.cat([p.reshape(-1) for p in parts]).to(self.device)
                buckets.append((layout, flat))
            names, parts, size = [], [], 0

        for name, tensor in named_tensors:
            tensor = tensor.detach()
            nbytes = tensor.numel() * tensor.element_size()
            if parts and (tensor.dtype != parts[0].dtype or size + nbytes > self.bucket_bytes):
                flush()
            # copy off the (possibly gathered, soon freed) device tensor while packing
            names.append(name)
            parts.append(tensor.to(self.device if self.backend == "nccl" else "cpu", copy=True))
            size += nbytes
        flush()
        return buckets

    def send(self, version: int, buckets: list[tuple[dict, torch.Tensor]]) -> None:
        """Broadcast one version's buckets (blocks until every receiver has them)."""
        self.announce(version)
        for i, (layout, flat) in enumerate(buckets):
            # JSON, not pickle: the store is a network port, and what it hands a receiver must not run code
            self.store.set(f"v{version}/b{i}", json.dumps({**layout, "numel": flat.numel()}).encode())
            self._broadcast(flat, f"broadcasting bucket {i} of weight version {version}")
        self.store.set(f"v{version}/b{len(buckets)}", _END)

    def announce(self, version: int) -> None:
        """Tell receivers (`latest_version`) that `version` is on its way."""
        self.store.set(_LATEST, str(int(version)).encode())

    def send_async(self, version: int, buckets: list[tuple[dict, torch.Tensor]]) -> None:
        """`send` in a background thread, after the previous send has finished (raising its error).
        The version is announced before this returns, so a receiver asking next sees it."""
        self.wait()
        self.announce(version)
        self._thread = threading.Thread(target=self._run, args=(version, buckets), daemon=True, name="weight-sync")
        self._thread.start()

    def _run(self, version, buckets) -> None:
        try:
            self.send(version, buckets)
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

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, backend: str | None = None):
        if rank < 1:
            raise ValueError(f"a receiver's weight-sync rank must be >= 1 (rank 0 sends), got {rank}")
        super().__init__(store, rank, world_size, timeout_s, backend)

    def latest_version(self) -> int | None:
        """The newest version the sender has started to send (None before the first); does not block."""
        try:
            if not self.store.check([_LATEST]):
                return None
            return int(self.store.get(_LATEST))
        except Exception as exc:
            raise self._timeout_error("asking for the newest weight version", exc) from None

    def receive(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Named tensors of weight `version` (consume the iterator to the end: every bucket is a collective)."""
        i = 0
        while True:
            key = f"v{version}/b{i}"
            try:
                raw = self.store.get(key)
            except Exception as exc:
                raise self._timeout_error(f"waiting for bucket {i} of weight version {version}", exc) from None
            if raw == _END:
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
