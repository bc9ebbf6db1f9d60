"""The shared-memory transport of large call payloads (verl/single_controller/shm.py).

Without Ray: segments round-trip DataProtos of every kind of column into memory of the reader's
own, grow, refuse what should go through Ray, and leave no files behind. With a real 2-worker Ray
group: calls switch to the channel once the probe is done, results equal what the driver computes
itself, a method that changes its input in place does not touch the driver's copy, failures and
non-blocking calls stay correct, and `VERL_SHM_TRANSPORT=0` turns it off.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from ray import cloudpickle

from verl.protocol import DataProto, DataProtoFuture
from verl.single_controller import shm
from verl.single_controller.base import Worker, WorkerDiedError, WorkerMethodError
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.speed_paths import SpeedPath

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _proto(rows: int, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    return DataProto.from_dict(
        tensors={
            "x": torch.randn(rows, 1024, generator=g),
            "h": torch.randn(rows, 16, generator=g).to(torch.bfloat16),
            "mask": torch.rand(rows, 16, generator=g) > 0.5,
            "ids": torch.randint(0, 1 << 40, (rows, 8), generator=g),
        },
        non_tensors={
            "uid": np.array([f"u{seed}-{i}" for i in range(rows)], dtype=object),
            "score": np.arange(rows, dtype=np.float64) * (seed + 1),
        },
        meta_info={"step": seed, "temperature": 0.7},
    )


def _assert_same(got: DataProto, want: DataProto) -> None:
    assert set(got.batch.keys()) == set(want.batch.keys())
    for key in list(want.batch.keys()):
        assert got.batch[key].dtype == want.batch[key].dtype, key
        assert torch.equal(got.batch[key], want.batch[key]), key
    assert set(got.non_tensor_batch) == set(want.non_tensor_batch)
    for key, value in want.non_tensor_batch.items():
        assert np.array_equal(got.non_tensor_batch[key], value), key
    assert got.meta_info == want.meta_info


def _own_files(pid: int) -> list[str]:
    return glob.glob(os.path.join(shm.SHM_DIR, f"verl-shm-{pid}-*"))


# --- segments, without Ray ---------------------------------------------------------------------------


def test_a_proto_round_trips_into_memory_the_reader_owns():
    out, inbox = shm._Outbox(), shm._Inbox()
    want = _proto(64, seed=1)
    envelope = out.pack("c", want, threshold=1)
    assert envelope is not None and envelope.path == out.path
    assert all(offset % 64 == 0 for offset, _ in envelope.spans)
    got = inbox.unpack(envelope)
    _assert_same(got, want)
    assert not os.path.exists(envelope.path), "the reader removes the name once it has mapped the segment"

    # The writer reuses its segment for the next payload: what was read before must not change.
    again = out.pack("c", _proto(64, seed=2), threshold=1)
    assert again.path == envelope.path
    _assert_same(got, _proto(64, seed=1))
    _assert_same(inbox.unpack(again), _proto(64, seed=2))
    got.batch["x"] += 1  # the reader's copy is writable
    out.discard()


def test_a_larger_payload_moves_to_a_larger_segment_and_the_reader_follows():
    out, inbox = shm._Outbox(), shm._Inbox()
    small = out.pack("c", _proto(32), threshold=1)
    inbox.unpack(small)
    big_proto = _proto(2048, seed=3)  # 8 MiB of x alone
    big = out.pack("c", big_proto, threshold=1)
    assert big.path != small.path and big.size >= big.end >= 8 << 20
    _assert_same(inbox.unpack(big), big_proto)
    assert _own_files(os.getpid()) == []
    out.discard()


def test_what_should_go_through_ray_is_refused(monkeypatch):
    out = shm._Outbox()
    assert out.pack("c", _proto(4), threshold=1 << 20) is None  # under the threshold
    assert out.pack("c", {"lock": threading.Lock()}, threshold=0) is None  # unpicklable: Ray reports it
    assert out.pack("c", torch.zeros(1 << 18), threshold=1) is None  # a bare tensor pickles in band
    monkeypatch.setenv("VERL_SHM_MAX_BYTES", str(1 << 20))
    assert out.pack("c", _proto(512), threshold=1) is None  # 2 MiB over the maximum
    assert out.path is None and _own_files(os.getpid()) == []


def test_ray_references_inside_a_payload_go_through_ray(ray_session):
    out = shm._Outbox()
    ref = ray_session.put(np.arange(10))
    assert out.pack("c", {"ref": ref, "x": np.zeros(1 << 18)}, threshold=1) is None
    assert out.pack("c", [_proto(64), DataProtoFuture(collect_fn=lambda x: x, futures=[ref])], threshold=1) is None
    assert out.pack("c", {"x": np.zeros(1 << 18)}, threshold=1) is not None  # the same without the reference
    out.discard()


def test_no_room_in_dev_shm_means_ray_and_no_file_left(monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    out = shm._Outbox()
    assert out.pack("c", _proto(64), threshold=1) is None
    assert _own_files(os.getpid()) == []


def test_the_speed_path_says_why_the_transport_is_off(monkeypatch):
    monkeypatch.setenv("VERL_SHM_TRANSPORT", "0")
    assert shm.speed_path(None) == SpeedPath("shm_transport", False, False, "VERL_SHM_TRANSPORT=0 turns it off")
    monkeypatch.delenv("VERL_SHM_TRANSPORT")
    monkeypatch.setattr(shm, "SHM_DIR", "/nonexistent-verl-shm")
    off = shm.speed_path(None)
    assert off.requested and not off.active and "/nonexistent-verl-shm does not exist" in off.reason
    monkeypatch.setattr(shm, "_swept", True)  # the sweep of stale files is not this test's
    links = shm.DriverLinks([object(), object()])
    assert shm.speed_path(links).active  # not probed yet: nothing has failed
    links.links[1].state = False  # its probe failed
    failed = shm.speed_path(links)
    assert failed.requested and not failed.active and failed.reason.startswith("1 of 2 workers failed its probe")


def test_files_of_dead_processes_are_swept_and_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(shm.SHM_DIR, f"verl-shm-{dead.pid}-test")
    live = os.path.join(shm.SHM_DIR, f"verl-shm-{os.getpid()}-test")
    fresh = os.path.join(shm.SHM_DIR, f"verl-shm-{dead.pid}-fresh")
    for path in (stale, live, fresh):
        open(path, "wb").close()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    os.utime(live, (old, old))
    try:
        shm.sweep_stale_segments()
        assert not os.path.exists(stale)
        assert os.path.exists(live), "its creator is alive"
        assert os.path.exists(fresh), "too recent: its creator's reader may be about to map it"
    finally:
        for path in (stale, live, fresh):
            shm._unlink(path)


# --- through a Ray worker group ----------------------------------------------------------------------


class ShmWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump(self, data: DataProto) -> DataProto:
        data.batch["x"] += 1  # in place: the driver's copy must not change
        data.batch["y"] = data.batch["x"] * 2
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def fail_on_rank_1(self, data: DataProto) -> DataProto:
        if self.rank == 1:
            raise ValueError("rank 1 refuses")
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def doubled(self, data: DataProto) -> DataProto:
        data.batch["x"] *= 2
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def die_on_rank_1(self, data: DataProto) -> DataProto:
        if self.rank == 1:
            os._exit(1)
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def bump_later(self, data: DataProto) -> DataProto:
        return self.bump(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shm_stats(self) -> dict:
        return shm.worker_stats()


def _bumped(data: DataProto) -> torch.Tensor:
    return data.batch["x"] + 1


def _channel_use(wg: RayWorkerGroup) -> list[dict]:
    """Per rank: {"received": n, "replied": n} on this group's channel."""
    stats = wg.shm_stats()
    return [s.get(link.channel, {"received": 0, "replied": 0}) for s, link in zip(stats, wg._shm_links.links)]


def _spawn(worker_cls=None):
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    return RayWorkerGroup(pool, RayClassWithInitArgs(worker_cls or ShmWorker)), pool


@pytest.fixture(scope="module")
def shm_group(ray_session):
    """One group for the tests that leave it as they found it (each reads the channel counters as
    differences, before and after its own calls); a test that kills a worker or needs another worker
    class or environment spawns its own."""
    wg, pool = _spawn()
    yield wg
    wg.shutdown()
    pool.remove_placement_groups()


def _until_probed(wg: RayWorkerGroup, expected: bool = True) -> None:
    """Make large calls until the probes are done: the first one that could use a channel starts them."""
    data = _proto(512, seed=99)
    deadline = time.monotonic() + 60
    while True:
        assert torch.equal(wg.bump(data).batch["x"], _bumped(data))
        if all(link.state in (True, False) for link in wg._shm_links.links):
            break
        assert time.monotonic() < deadline, "probes did not finish"
        time.sleep(0.05)
    assert all(link.state is expected for link in wg._shm_links.links)


def test_large_calls_go_through_the_channel_and_equal_the_driver_s_own_result(shm_group):
    wg = shm_group
    data = _proto(512, seed=4)  # 2 MiB of x: over the threshold both ways
    original = data.batch["x"].clone()
    first = wg.bump(data)  # may still travel through Ray while the probes run
    assert torch.equal(first.batch["x"], _bumped(data))
    _until_probed(wg)
    assert wg.shm_speed_path() == SpeedPath("shm_transport", True, True)
    before = _channel_use(wg)
    out = wg.bump(data)
    assert torch.equal(out.batch["x"], _bumped(data))
    assert torch.equal(out.batch["y"], _bumped(data) * 2)
    assert torch.equal(data.batch["x"], original), "the worker's in-place change reached the driver's data"
    assert list(out.non_tensor_batch["uid"]) == list(data.non_tensor_batch["uid"])
    after = _channel_use(wg)
    for rank in range(2):
        assert after[rank]["received"] == before[rank]["received"] + 1
        assert after[rank]["replied"] == before[rank]["replied"] + 1
    # Nothing named is left once both sides have mapped their segments.
    pids = wg.pid()
    assert [f for pid in (os.getpid(), *pids) for f in _own_files(pid)] == []

    # A payload bigger than the segments so far: both sides move to larger ones.
    big = _proto(4096, seed=5)  # 16 MiB of x
    assert torch.equal(wg.bump(big).batch["y"], _bumped(big) * 2)
    assert [c["received"] for c in _channel_use(wg)] == [a["received"] + 1 for a in after]

    # Small arguments go through Ray; so does the small result of a call that does not concatenate.
    small = _proto(8, seed=6)
    assert torch.equal(wg.bump(small).batch["x"], _bumped(small))
    assert [c["received"] for c in _channel_use(wg)] == [a["received"] + 1 for a in after]
    replied = [c["replied"] for c in _channel_use(wg)]
    assert wg.pid() == pids
    assert [c["replied"] for c in _channel_use(wg)] == replied


def test_an_argument_shared_by_every_worker_travels_once_through_the_object_store(shm_group):
    wg = shm_group
    _until_probed(wg)
    data = _proto(512, seed=10)
    before = _channel_use(wg)
    outs = wg.doubled(data)  # ONE_TO_ALL: one object-store copy read by both workers
    assert len(outs) == 2
    for out in outs:
        assert torch.equal(out.batch["x"], data.batch["x"] * 2)
    assert torch.equal(data.batch["x"], _proto(512, seed=10).batch["x"])
    assert _channel_use(wg) == before  # and its results, not concatenated, through Ray too


def test_a_group_shut_down_while_probing_leaves_no_file(ray_session):
    wg, pool = _spawn()
    pids = wg.pid()
    wg.bump(_proto(512))  # starts the probes, whose replies are never read
    wg.shutdown()
    pool.remove_placement_groups()
    assert all(link.state is False for link in wg._shm_links.links)
    assert [f for pid in (os.getpid(), *pids) for f in _own_files(pid)] == []


def test_a_failed_call_names_the_rank_and_the_next_call_is_right(shm_group):
    wg = shm_group
    _until_probed(wg)
    data = _proto(512, seed=7)
    with pytest.raises(WorkerMethodError, match="rank 1") as info:
        wg.fail_on_rank_1(data)
    assert "rank 1 refuses" in str(info.value)
    received = [c["received"] for c in _channel_use(wg)]
    out = wg.bump(data)
    assert torch.equal(out.batch["x"], _bumped(data))
    assert [c["received"] for c in _channel_use(wg)] == [r + 1 for r in received]


def test_a_worker_dying_in_a_channel_call_is_reported_within_seconds(ray_session):
    wg, pool = _spawn()  # its own: the test kills one of its workers
    try:
        _until_probed(wg)
        pids = wg.pid()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            wg.die_on_rank_1(_proto(512, seed=11))
        # unnoticed, the death would surface only at the call deadline (3600 s by default)
        assert time.monotonic() - start < 60
        assert (info.value.rank, info.value.method) == (1, "die_on_rank_1")
        assert [f for pid in (os.getpid(), *pids) for f in _own_files(pid)] == []
    finally:
        wg.shutdown()
        pool.remove_placement_groups()


class NoChannel(ShmWorker):
    """A worker that cannot open the driver's segment, as on another host."""

    def _verl_shm_probe(self, envelope):
        raise FileNotFoundError(envelope.path)


def test_a_worker_that_cannot_see_the_segment_is_served_through_ray(ray_session):
    wg, pool = _spawn(NoChannel)
    try:
        _until_probed(wg, expected=False)
        data = _proto(512, seed=12)
        assert torch.equal(wg.bump(data).batch["y"], _bumped(data) * 2)
        assert wg.shm_stats() == [{}, {}]
        assert _own_files(os.getpid()) == []
    finally:
        wg.shutdown()
        pool.remove_placement_groups()


def test_non_blocking_calls_travel_through_ray(shm_group):
    wg = shm_group
    _until_probed(wg)
    data = _proto(512, seed=8)
    before = _channel_use(wg)
    out = wg.bump_later(data).get()
    assert torch.equal(out.batch["x"], _bumped(data))
    assert _channel_use(wg) == before


def test_the_transport_can_be_turned_off(ray_session, monkeypatch):
    monkeypatch.setenv("VERL_SHM_TRANSPORT", "0")
    wg, pool = _spawn()
    try:
        assert wg._shm_links is None
        data = _proto(512, seed=9)
        assert torch.equal(wg.bump(data).batch["x"], _bumped(data))
        assert wg.shm_stats() == [{}, {}]
    finally:
        wg.shutdown()
        pool.remove_placement_groups()
