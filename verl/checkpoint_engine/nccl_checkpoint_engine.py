"""The `nccl` checkpoint engine: weights broadcast in buckets from the trainer's rank 0.

Upstream's engine of this name broadcasts over NCCL (cupy and Ray's collective library) and sends
each bucket's layout over ZeroMQ. This one forms a private torch.distributed group with the
machinery of `verl.workers.weight_sync` (the group, its deadline and its error messages): NCCL on
GPUs, gloo on a CPU machine, so the same code and tests run on both. A bucket's layout (names,
shapes, dtypes, offsets; JSON) travels through the group's TCP store, hosted by the master (the trainer's
rank 0) and written before the bucket's broadcast, so receivers need no prior knowledge of the model.

Two buffers of `bucket_size` bytes each side: the sender fills one while the other is on the wire,
and a receiver yields one bucket's tensors while the next arrives. The tensors a receiver yields are
views into its buffers, valid until the bucket after next arrives: a consumer copies them (an
engine's weight load does), as with upstream's.

`rebuild_group` forms a fresh group at every sync and releases it in `finalize`; otherwise the group
formed at the first sync is kept, and formed again only when the membership changes (a replica
added or removed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable

import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry, TensorMeta
from verl.utils import device as dev
from verl.workers.weight_sync import _Endpoint, connect_store, host_weight_sync_store

logger = logging.getLogger(__name__)

__all__ = ["NCCLCheckpointEngine"]

_PREFIX = "verl_checkpoint_engine"


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"rollout_dtype={value!r} is not a floating-point torch dtype (bfloat16, float16, float32)")
    return dtype


def _encode_layout(layout: dict[str, TensorMeta], is_last: bool, nbytes: int) -> str:
    """A bucket's layout as JSON for the store (plain data: nothing a receiver unpickles)."""
    tensors = [
        [m["name"], list(m["shape"]), str(m["dtype"]).removeprefix("torch."), m["offset"]] for m in layout.values()
    ]
    return json.dumps({"tensors": tensors, "is_last": is_last, "nbytes": nbytes})


def _decode_layout(raw: bytes) -> dict:
    """`_encode_layout`'s JSON back as {"bucket_meta": {name: TensorMeta}, "is_last", "nbytes"}."""
    data = json.loads(raw)
    meta = {}
    for name, shape, dtype, offset in data["tensors"]:
        dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"checkpoint engine: bucket layout names an unknown dtype for {name!r}")
        meta[name] = TensorMeta(name=name, shape=torch.Size(shape), dtype=dtype, offset=int(offset))
    return {"bucket_meta": meta, "is_last": bool(data["is_last"]), "nbytes": int(data["nbytes"])}


@CheckpointEngineRegistry.register("nccl")
class NCCLCheckpointEngine(CheckpointEngine):
    """Bucketed broadcasts over a private group (NCCL on GPUs, gloo on CPU).

    Args:
        bucket_size: bytes per bucket; a single tensor larger than this is refused (raise the bucket
            size, `checkpoint_engine.update_weights_bucket_megabytes`).
        group_name: names the group (its store keys and errors); both sides must use the same.
        rebuild_group: form the group anew at every sync and release it after.
        is_master: this process sends (the trainer's rank 0) and hosts the group's store.
        rollout_dtype: the dtype floating-point weights travel in (a torch dtype or its name).
        timeout_s: the deadline of the rendezvous and of every broadcast.
    """

    def __init__(
        self,
        bucket_size: int,
        group_name: str = "default",
        rebuild_group: bool = False,
        is_master: bool = False,
        rollout_dtype: torch.dtype | str = torch.bfloat16,
        timeout_s: float = 600.0,
    ) -> None:
        if int(bucket_size) <= 0:
            raise ValueError(f"bucket_size={bucket_size} must be a positive number of bytes")
        self.bucket_size = int(bucket_size)
        self.group_name = group_name
        self.rebuild_group = bool(rebuild_group)
        self.is_master = bool(is_master)
        self.rollout_dtype = _dtype(rollout_dtype)
        self.timeout_s = float(timeout_s)
        self.rank: int | None = None
        self.world_size: int | None = None
        self._endpoint: _Endpoint | None = None
        self._store = None
        self._buffers: list[torch.Tensor] | None = None
        self._sync = 0  # syncs sent or received; names each sync's bucket layouts in the store
        self._sent_buckets = 0  # the master's bucket count of its last sync (their store keys are dropped next time)
        if self.is_master:
            self._store, self.host, self.port = host_weight_sync_store(self.timeout_s)

    # ------------------------------------------------------------ the group
    def prepare(self) -> dict | None:
        """Allocate the two buffers; the master returns where its store listens."""
        if self._buffers is None:
            device = torch.device("cpu") if dev.get_dist_backend() == "gloo" else dev.get_device()
            self._buffers = [torch.empty(self.bucket_size, dtype=torch.uint8, device=device) for _ in range(2)]
        return {"host": self.host, "port": self.port} if self.is_master else None

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
        """Trainer rank 0 is the group's rank 0 and the rollout workers ranks 1..N; the other trainer
        ranks stay out (-1). The master's metadata (the first entry) goes to everyone."""
        world_size = rollout_world_size + 1
        master = metadata[0]
        if not (isinstance(master, dict) and "host" in master):
            raise ValueError(
                "NCCLCheckpointEngine.build_topology: the first worker's prepare() gave no store address; the trainer's "
                "rank 0 must be built with is_master=True"
            )
        trainer = {
            "rank": [0] + [-1] * (trainer_world_size - 1),
            "world_size": [world_size] * trainer_world_size,
            "master_metadata": [master] * trainer_world_size,
        }
        rollout = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size,
        }
        return trainer, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict) -> None:
        """Join (or keep) the group as `rank` of `world_size`; rank -1 only records that it stays out."""
        if rank < 0:
            self.rank, self.world_size = rank, world_size
            return
        if self._endpoint is not None and not self.rebuild_group and (rank, world_size) == (self.rank, self.world_size):
            return  # the group of an earlier sync, same members
        if self._store is None:
            self._store = connect_store(master_metadata["host"], master_metadata["port"], self.timeout_s)
        # every member of one formation draws a ticket; formations never overlap (each rendezvous
        # completes before the next begins), so tickets // world_size numbers them alike everywhere
        ticket = self._store.add(f"{_PREFIX}/{self.group_name}/joins", 1) - 1
        endpoint = _Endpoint(
            self._store, rank, world_size, self.timeout_s, None, group_name=self.group_name, rebuild_group=True
        )
        endpoint._form_group(f"{_PREFIX}/{self.group_name}/g{ticket // world_size}")  # blocks until all have joined
        self._endpoint, self.rank, self.world_size = endpoint, rank, world_size

    def finalize(self) -> None:
        """Free the buffers; with `rebuild_group`, also the group."""
        self._buffers = None
        if self.rebuild_group:
            self._endpoint = None
            self.rank = self.world_size = None

    def _require_group(self, what: str) -> None:
        if self.rank is None:
            raise RuntimeError(f"NCCLCheckpointEngine.{what}: call prepare() and init_process_group() first")
        if self._buffers is None and self.rank >= 0:
            self.prepare()

    def _key(self, sync: int, bucket: int) -> str:
        return f"{_PREFIX}/{self.group_name}/s{sync}/b{bucket}"

    def _broadcast(self, flat: torch.Tensor, what: str) -> None:
        if flat.is_cuda:
            dev.synchronize()  # the bucket was filled on the compute stream
        self._endpoint._broadcast(flat, what)

    # ------------------------------------------------------------ sending
    @torch.no_grad()
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rank 0 broadcasts every tensor; the other trainer ranks iterate `weights` (its gathers are
        collectives) and send nothing."""
        self._require_group("send_weights")
        if self.rank != 0:
            if self.rank > 0:
                raise RuntimeError(
                    f"NCCLCheckpointEngine.send_weights on group rank {self.rank}: rollout ranks receive"
                )
            for _ in weights:
                pass
            return
        loop = asyncio.get_running_loop()
        sync, self._sync = self._sync, self._sync + 1
        for bucket in range(self._sent_buckets):  # the previous sync's layouts: every receiver has read them
            self._store.delete_key(self._key(sync - 1, bucket))
        start = time.perf_counter()
        pending, bucket, offset, layout, total = None, 0, 0, {}, 0

        async def flush(is_last: bool):
            nonlocal pending, bucket, offset, layout
            if pending is not None:
                await pending  # the other buffer is free again once its broadcast is through
            self._store.set(self._key(sync, bucket), _encode_layout(layout, is_last, offset))
            flat = self._buffers[bucket % 2][:offset]
            pending = loop.run_in_executor(None, self._broadcast, flat, f"broadcasting bucket {bucket} of sync {sync}")
            bucket, offset, layout = bucket + 1, 0, {}

        for name, tensor in weights:
            tensor = tensor.detach()
            if tensor.is_floating_point():
                tensor = tensor.to(self.rollout_dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes > self.bucket_size:
                raise ValueError(
                    f"weight {name} ({tuple(tensor.shape)}, {tensor.dtype}) is {nbytes} bytes, more than the bucket "
                    f"({self.bucket_size} bytes); raise checkpoint_engine.update_weights_bucket_megabytes above "
                    f"{nbytes / 2**20:.0f}"
                )
            if offset + nbytes > self.bucket_size:
                await flush(is_last=False)
            target = self._buffers[bucket % 2][offset : offset + nbytes]
            target.copy_(tensor.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
            layout[name] = TensorMeta(name=name, shape=tensor.shape, dtype=tensor.dtype, offset=offset)
            offset += nbytes
            total += nbytes
        await flush(is_last=True)
        await pending
        self._sent_buckets = bucket
        logger.info(
            "checkpoint engine %s: sent %d bytes in %d buckets in %.2f s",
            self.group_name,
            total,
            bucket,
            time.perf_counter() - start,
        )

    # ------------------------------------------------------------ receiving
    def _receive_bucket(self, sync: int, bucket: int) -> tuple[dict, torch.Tensor]:
        try:
            layout = _decode_layout(self._store.get(self._key(sync, bucket)))
        except Exception as exc:  # the store's own timeout: the trainer never wrote the bucket
            raise self._endpoint._timeout_error(f"waiting for bucket {bucket} of sync {sync}", exc) from None
        flat = self._buffers[bucket % 2][: layout["nbytes"]]
        self._broadcast(flat, f"receiving bucket {bucket} of sync {sync}")
        return layout, flat

    @torch.no_grad()
    async def receive_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield each bucket's tensors while the next bucket arrives (views: copy to keep them)."""
        self._require_group("receive_weights")
        if self.rank <= 0:
            raise RuntimeError(f"NCCLCheckpointEngine.receive_weights on group rank {self.rank}: rank 0 sends")
        loop = asyncio.get_running_loop()
        sync, self._sync = self._sync, self._sync + 1
        bucket = 0
        pending = loop.run_in_executor(None, self._receive_bucket, sync, bucket)
        while True:
            layout, flat = await pending
            if not layout["is_last"]:
                pending = loop.run_in_executor(None, self._receive_bucket, sync, bucket + 1)
            for name, meta in layout["bucket_meta"].items():
                nbytes = meta["dtype"].itemsize * meta["shape"].numel()
                raw = flat[meta["offset"] : meta["offset"] + nbytes]
                yield name, raw.view(meta["dtype"]).view(meta["shape"])
            if layout["is_last"]:
                return
            bucket += 1
