"""Same-host transport of large call arguments and results through shared memory (/dev/shm).

A blocking worker-group call whose arguments hold at least `VERL_SHM_MIN_BYTES` (default 256 KiB)
of out-of-band pickle buffers (a DataProto's tensors, numpy arrays) sends those bytes through a
file in /dev/shm that both processes keep mapped, and only the pickle stream and the buffers'
offsets through Ray. So does a result of that size, when the call's arguments went by channel or
its dispatch mode concatenates DataProtos (the modes with large results); other calls skip the
channel's entry, which costs about 0.1 ms. Ray's own paths copy the bytes into its task call (gRPC) or its
object store and back; here each side makes one memcpy into a mapping it already holds, and the
reader one memcpy out into memory it owns. Measured on 2 CPU workers: a 1 MB round trip fell from
about 6.6 ms to about 4.4 ms (docs/benchmarks.md).

Channels. The driver holds one `DriverLink` per worker and group; each has a channel id, and the
worker keeps one `_Channel` per id, so two groups (or two drivers) attached to the same worker never
share a segment. Each direction has one writer-owned segment (`_Outbox`), reused from call to call
and replaced by a larger one when a payload does not fit; the reader maps it read-only (`_Inbox`)
and copies out before the writer may write again:

- driver to worker: the driver writes only while it holds the link's lock, which it takes at
  submit and releases when the call's results are in, and the worker copies its arguments out
  before the method runs;
- worker to driver: the worker writes a reply only for the call being answered, and the driver
  copies it out before it releases the lock.

A call that fails abandons the driver's segment (a later call writes a fresh one), since a
timed-out call may still be waiting in the worker's queue to read it.

Lifetime. A segment's file exists only until the reader has mapped it: the reader unlinks it, and
the pages live as long as a mapping does, so a killed process leaves nothing behind once the
handshake is done. Files named `verl-shm-<pid>-*` whose creator is dead (a crash between create
and map) are removed the next time a driver opens links.

When it is off. The first blocking call of each worker starts a probe (a token written both ways)
and goes through Ray; later calls use the channel once the probe has succeeded. A worker on
another host, a missing or full /dev/shm (`posix_fallocate` fails cleanly instead of SIGBUS later),
a payload over `VERL_SHM_MAX_BYTES` (default 256 MiB), a payload that pickles in band (torch tensors
outside a DataProto), a non-blocking call (its futures are handed to the user), or a link already
in use by another thread: all go through Ray unchanged. `VERL_SHM_TRANSPORT=0` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import io
import logging
import mmap
import os
import pickle
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from verl.single_controller._env import env_int
from verl.utils.speed_paths import SpeedPath

logger = logging.getLogger(__name__)

SPEED_PATH = "shm_transport"

SHM_DIR = "/dev/shm"
_PREFIX = "verl-shm-"
_ALIGN = 64  # every buffer starts on a cache line (torch needs 16)
_GRANULE = 1 << 20  # segments are sized in MiB
_STALE_AFTER_S = 60.0


def _env_bytes(name: str, default: int) -> int:
    return env_int(name, default)


def _turned_off() -> bool:
    return os.environ.get("VERL_SHM_TRANSPORT", "1").strip().lower() in ("0", "false", "no", "off")


def disabled_reason() -> str:
    """Why this process may not use the transport, or "" when it may (`VERL_SHM_TRANSPORT`, /dev/shm writable)."""
    if _turned_off():
        return f"VERL_SHM_TRANSPORT={os.environ['VERL_SHM_TRANSPORT']} turns it off"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist (in a container: mount one, e.g. docker run --shm-size=16g)"
    if not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not writable by this user"
    return ""


def enabled() -> bool:
    """Whether this process may use the transport (see `disabled_reason`)."""
    return not disabled_reason()


def speed_path(links: DriverLinks | None) -> SpeedPath:
    """The transport's state for a worker group whose driver links are `links` (None: the transport
    was off when the group was made): off when it is disabled here, or when some worker failed
    the probe (another host, /dev/shm not shared); such workers' calls go through Ray."""
    if links is None:
        return SpeedPath(SPEED_PATH, requested=not _turned_off(), active=False, reason=disabled_reason())
    failed = sum(link.state is False for link in links.links)
    if failed:
        reason = (
            f"{failed} of {len(links.links)} workers failed its probe (on another host, or without a shared "
            f"{SHM_DIR}); their calls go through Ray"
        )
        return SpeedPath(SPEED_PATH, True, False, reason)
    return SpeedPath(SPEED_PATH, True, True)


def min_bytes() -> int:
    return _env_bytes("VERL_SHM_MIN_BYTES", 256 * 1024)


def max_bytes() -> int:
    return _env_bytes("VERL_SHM_MAX_BYTES", 256 << 20)


def out_of_band_nbytes(value) -> int:
    """A cheap estimate of the bytes `value` pickles out of band: a DataProto's tensors and numeric
    arrays, numpy arrays (a bare torch tensor pickles in band, so it does not count)."""
    if isinstance(value, np.ndarray):
        return 0 if value.dtype.hasobject else value.nbytes
    if isinstance(value, Mapping):
        return sum(out_of_band_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(out_of_band_nbytes(v) for v in value)
    batch = getattr(value, "batch", None)  # DataProto
    if batch is not None and hasattr(batch, "values"):
        tensors = sum(t.nbytes for t in batch.values() if hasattr(t, "nbytes"))
        return tensors + out_of_band_nbytes(getattr(value, "non_tensor_batch", None) or {})
    return 0


@dataclass(frozen=True)
class Envelope:
    """What travels through Ray: the pickle stream and where its buffers lie in a segment.

    `path` is None when the payload itself travels through Ray (the call's own arguments), so an
    envelope can also just open a channel and ask for a reply through it.
    """

    channel: str
    path: str | None = None
    size: int = 0
    header: bytes = b""
    spans: tuple = ()  # (offset, nbytes) per out-of-band buffer
    end: int = 0  # bytes used in the segment

    def wire(self) -> tuple:
        """The fields as a plain tuple: Ray sends builtins without pickling them, which saves about
        0.1 ms per call against sending the object (`Envelope(*wire)` rebuilds it)."""
        return (self.channel, self.path, self.size, self.header, self.spans, self.end)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _RayHandleInside(Exception):
    pass


@functools.cache
def _pickler_class() -> type:
    import ray
    from ray import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, value):
            if isinstance(value, ray.ObjectRef | ray.actor.ActorHandle):
                raise _RayHandleInside
            return super().reducer_override(value)

    return Pickler


def _dumps(obj) -> tuple[bytes, list[memoryview]]:
    """Pickle `obj` (cloudpickle, as Ray does) with its buffers out of band. Object references and
    actor handles refuse: only Ray's own serialization keeps them alive while in flight."""
    buffers: list = []
    stream = io.BytesIO()
    _pickler_class()(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    return stream.getvalue(), [b.raw() for b in buffers]


def _create_segment(nbytes: int) -> tuple[str, mmap.mmap] | None:
    """A new /dev/shm file of at least `nbytes` (whole MiB), mapped read-write; None if no room."""
    size = -(-max(nbytes, 1) // _GRANULE) * _GRANULE
    path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        logger.debug("shared-memory transport: cannot create %s (%s)", path, exc)
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
        mapping = mmap.mmap(fd, size)
    except OSError as exc:
        logger.info("shared-memory transport: no room for %d bytes in %s (%s); using Ray", size, SHM_DIR, exc)
        _unlink(path)
        return None
    finally:
        os.close(fd)
    _created.add(path)
    return path, mapping


def _map(path: str, size: int, writable: bool) -> mmap.mmap:
    """Map the other side's segment and remove its name: both sides hold a mapping now."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)
        _unlink(path)


class _Outbox:
    """The segment one side writes: mapped read-write, replaced by a larger one when needed."""

    def __init__(self):
        self.path: str | None = None
        self._bytes: np.ndarray | None = None

    def pack(self, channel: str, obj, threshold: int) -> Envelope | None:
        """Write `obj`'s buffers into the segment; None when it should go through Ray instead
        (under `threshold` bytes out of band, over the maximum, unpicklable, no room in /dev/shm)."""
        try:
            header, buffers = _dumps(obj)
        except Exception:  # Ray pickles it (or reports why it cannot)
            return None
        spans, end = [], 0
        for buf in buffers:
            spans.append((end, buf.nbytes))
            end += _aligned(buf.nbytes)
        if end < threshold or end > max_bytes():
            return None
        if self._bytes is None or self._bytes.size < end:
            created = _create_segment(max(end, 2 * (self._bytes.size if self._bytes is not None else 0)))
            if created is None:
                return None
            self.discard()
            self.path, self._bytes = created[0], np.frombuffer(created[1], dtype=np.uint8)
        for (offset, nbytes), buf in zip(spans, buffers):
            self._bytes[offset : offset + nbytes] = np.frombuffer(buf, dtype=np.uint8)
        return Envelope(channel, self.path, self._bytes.size, header, tuple(spans), end)

    def adopt(self, path: str, size: int) -> None:
        """Write into a segment the other side created (the driver's reply segment, at the probe)."""
        self.discard()
        self.path, self._bytes = path, np.frombuffer(_map(path, size, writable=True), dtype=np.uint8)

    def discard(self) -> None:
        """Stop using the current segment (its file goes if the reader never mapped it)."""
        if self.path is not None:
            _unlink(self.path)
        self.path, self._bytes = None, None

    def __del__(self):
        try:  # noqa: SIM105 (contextlib may already be gone at interpreter shutdown)
            self.discard()
        except Exception:
            pass


class _Inbox:
    """The other side's segment, mapped read-only; every read is copied into memory of its own."""

    def __init__(self):
        self.path: str | None = None
        self._bytes: np.ndarray | None = None

    def hold(self, path: str, mapping: mmap.mmap) -> None:
        """Read from a segment this side created for the other to write (see `_Outbox.adopt`)."""
        self.path, self._bytes = path, np.frombuffer(mapping, dtype=np.uint8)

    def unpack(self, envelope: Envelope):
        if envelope.path != self.path or self._bytes is None or self._bytes.size < envelope.size:
            mapping = _map(envelope.path, envelope.size, writable=False)
            self.path, self._bytes = envelope.path, np.frombuffer(mapping, dtype=np.uint8)
        own = np.empty(envelope.end, dtype=np.uint8)
        own[:] = self._bytes[: envelope.end]
        return pickle.loads(envelope.header, buffers=[own[o : o + n] for o, n in envelope.spans])


# Files this process created and has not seen removed; what is left goes at exit.
_created: set[str] = set()


def _unlink(path: str) -> None:
    _created.discard(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@atexit.register
def _remove_created() -> None:
    for path in list(_created):
        _unlink(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_swept = False


def sweep_stale_segments() -> int:
    """Remove segment files whose creating process is dead (left by a crash mid-handshake)."""
    removed = 0
    now = time.time()
    for path in glob.glob(os.path.join(SHM_DIR, _PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(_PREFIX) :].split("-", 1)[0])
            if not _pid_alive(pid) and now - os.stat(path).st_mtime > _STALE_AFTER_S:
                os.unlink(path)
                removed += 1
        except (ValueError, OSError):
            continue
    return removed


# --- worker side ----------------------------------------------------------------------------------


class _Channel:
    def __init__(self, channel: str):
        self.channel = channel
        self.inbox = _Inbox()
        self.outbox = _Outbox()
        self.received = 0  # calls whose arguments came through the channel
        self.replied = 0  # results sent back through it


_channels: dict[str, _Channel] = {}
_channels_lock = threading.Lock()


def worker_channel(channel: str) -> _Channel:
    with _channels_lock:
        if channel not in _channels:
            _channels[channel] = _Channel(channel)
        return _channels[channel]


def worker_receive(envelope: Envelope, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's (args, kwargs): from the channel when the envelope carries them."""
    if envelope.path is None:
        return args, kwargs
    channel = worker_channel(envelope.channel)
    args, kwargs = channel.inbox.unpack(envelope)
    channel.received += 1
    return args, kwargs


def worker_reply(envelope: Envelope, result):
    """An envelope holding `result` when it is large enough for the channel, else `result`."""
    if out_of_band_nbytes(result) < min_bytes():
        return result
    channel = worker_channel(envelope.channel)
    packed = channel.outbox.pack(envelope.channel, result, min_bytes())
    if packed is None:
        return result
    channel.replied += 1
    return packed


def worker_probe(envelope: Envelope) -> Envelope | None:
    """Read the driver's token and reply-segment name; send the token back through that segment."""
    channel = worker_channel(envelope.channel)
    token, reply_path, reply_size = channel.inbox.unpack(envelope)
    channel.outbox.adopt(reply_path, reply_size)
    return channel.outbox.pack(envelope.channel, token, threshold=0)


def worker_stats() -> dict[str, dict[str, int]]:
    """{channel: {"received": n, "replied": n}} for this process (tests and debugging)."""
    with _channels_lock:
        return {c.channel: {"received": c.received, "replied": c.replied} for c in _channels.values()}


# --- driver side ----------------------------------------------------------------------------------

_PROBING = "probing"


class DriverLink:
    """The driver's end of one worker's channel (see the module docstring)."""

    def __init__(self, worker):
        self.worker = worker
        self.channel = uuid.uuid4().hex
        self.state: bool | str | None = None  # None: not probed, True / False: usable or not
        self._probe = None
        self._token: np.ndarray | None = None
        self._lock = threading.Lock()  # held by the one call using the channel
        self._state_lock = threading.Lock()  # the probe's start and finish
        self._outbox = _Outbox()
        self._inbox = _Inbox()

    def acquire(self) -> bool:
        """Take the link for one call when it is usable and free; a first call starts the probe."""
        if self.state is not True:
            with self._state_lock:
                if self.state is None:
                    self._start_probe()
                    return False
                if self.state == _PROBING and not self._finish_probe():
                    return False
            if self.state is not True:
                return False
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()

    def envelope(self, args: tuple, kwargs: dict, pack: bool) -> tuple[Envelope, tuple, dict]:
        """(envelope, args, kwargs) for the call: with `pack` (the arguments are large), the payload
        goes in the segment; without, it travels through Ray and the channel carries the result."""
        if pack:
            packed = self._outbox.pack(self.channel, (args, kwargs), min_bytes())
            if packed is not None:
                return packed, (), {}
        return Envelope(self.channel), args, kwargs

    def receive(self, output):
        return self._inbox.unpack(output) if isinstance(output, Envelope) else output

    def abandon(self) -> None:
        """After a failed call: never write the segment it may still read."""
        self._outbox.discard()

    def _start_probe(self) -> None:
        # The driver creates both segments, so that a worker that never answers leaves no file
        # that only it could remove; the worker maps them and removes their names.
        self._token = np.frombuffer(os.urandom(64), dtype=np.uint8).copy()  # pickles out of band
        reply = _create_segment(_GRANULE)
        envelope = None
        if reply is not None:
            self._inbox.hold(*reply)
            envelope = self._outbox.pack(self.channel, (self._token, reply[0], _GRANULE), threshold=0)
        if envelope is None:
            self._give_up()
            return
        self._probe = self.worker._verl_shm_probe.remote(envelope)
        self.state = _PROBING

    def _finish_probe(self) -> bool:
        import ray

        ready, _ = ray.wait([self._probe], timeout=0)
        if not ready:
            return False
        try:
            reply = ray.get(self._probe, timeout=0)
            self.state = isinstance(reply, Envelope) and np.array_equal(self._inbox.unpack(reply), self._token)
            if not self.state:
                logger.warning(
                    "shared-memory transport off for %s (its calls go through Ray): the probe's token did not come "
                    "back through %s (the worker sees another one, e.g. on another host)",
                    self.worker,
                    SHM_DIR,
                )
        except Exception as exc:  # the worker died, or cannot see the segment (another host)
            logger.warning("shared-memory transport off for %s (its calls go through Ray): %s", self.worker, exc)
            self.state = False
        self._probe = None
        if not self.state:
            self._give_up()
        return True

    def _give_up(self) -> None:
        self.state = False
        self._outbox.discard()
        if self._inbox.path is not None:
            _unlink(self._inbox.path)  # the reply segment, if the worker never mapped it


class DriverLinks:
    """One `DriverLink` per worker of a group (shared by the group's per-role views)."""

    def __init__(self, workers: list):
        global _swept
        if not _swept:
            _swept = True
            sweep_stale_segments()
        self.links = [DriverLink(w) for w in workers]

    def close(self) -> None:
        """Before the workers go: no more calls through the channels, no files left."""
        for link in self.links:
            link._give_up()
