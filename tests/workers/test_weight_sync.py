"""Trainer -> rollout weight transfer over a private torch.distributed group (gloo, threads as ranks)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from verl.workers.weight_sync import (
    WeightReceiver,
    WeightSender,
    WeightSyncTimeoutError,
    connect_store,
    host_weight_sync_store,
)


def _named_tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(7, 5, generator=g)),
        ("layer.0.weight", torch.randn(4, 4, generator=g)),
        ("layer.0.bias", torch.randn(4, generator=g).to(torch.float64)),
        ("layer.1.weight", torch.randn(3, 2, generator=g).to(torch.bfloat16)),
        ("step", torch.tensor([3, 1, 4], dtype=torch.int64)),
        ("head.weight", torch.randn(2, 7, generator=g)),
    ]


def _group(num_receivers: int, timeout_s: float, bucket_bytes: int):
    """(sender, [receivers]) built concurrently (the rendezvous blocks until all have joined)."""
    store, host, port = host_weight_sync_store(timeout_s)
    world = 1 + num_receivers
    out: dict = {}

    def make_receiver(rank):
        out[rank] = WeightReceiver(connect_store(host, port, timeout_s), rank, world, timeout_s, backend="gloo")

    threads = [threading.Thread(target=make_receiver, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    sender = WeightSender(store, world, timeout_s, bucket_bytes=bucket_bytes, backend="gloo")
    for t in threads:
        t.join()
    return sender, [out[r] for r in range(1, world)]


def test_buckets_hold_one_dtype_each_and_respect_the_size_limit():
    sender, receivers = _group(1, 10, bucket_bytes=100)
    buckets = sender.pack(_named_tensors())
    for layout, flat in buckets:
        assert flat.dtype == getattr(torch, layout["dtype"])
        assert flat.numel() * flat.element_size() <= 100 or len(layout["names"]) == 1
    names = [n for layout, _ in buckets for n in layout["names"]]
    assert names == [n for n, _ in _named_tensors()]  # order kept, nothing lost


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_every_receiver_gets_every_tensor_bit_exact_in_order(bucket_bytes):
    sender, receivers = _group(2, 10, bucket_bytes=bucket_bytes)
    got: dict[int, list] = {}

    def receive(i, rx):
        got[i] = [(n, t.clone()) for n, t in rx.receive(version=5)]

    threads = [threading.Thread(target=receive, args=(i, rx)) for i, rx in enumerate(receivers)]
    for t in threads:
        t.start()
    sender.send_async(5, sender.pack(_named_tensors()))
    sender.wait()
    for t in threads:
        t.join()
    for i in range(2):
        assert [n for n, _ in got[i]] == [n for n, _ in _named_tensors()]
        for (_, expected), (_, actual) in zip(_named_tensors(), got[i]):
            assert actual.dtype == expected.dtype and actual.shape == expected.shape
            assert torch.equal(actual, expected)


def test_versions_arrive_in_order_with_the_sender_running_ahead():
    sender, (rx,) = _group(1, 10, bucket_bytes=1 << 20)
    versions = []

    def receive():
        for v in (1, 2):
            time.sleep(0.2)  # the receiver is busy (generating) when the sender starts
            versions.append((v, [t.clone() for _, t in rx.receive(v)]))

    t = threading.Thread(target=receive)
    t.start()
    sender.send_async(1, sender.pack([("w", torch.full((3,), 1.0))]))
    sender.send_async(2, sender.pack([("w", torch.full((3,), 2.0))]))  # joins version 1 first
    sender.wait()
    t.join()
    assert [(v, ts[0].tolist()) for v, ts in versions] == [(1, [1.0] * 3), (2, [2.0] * 3)]


def test_a_receiver_whose_trainer_never_sends_gets_a_clear_error_naming_the_trainer():
    sender, (rx,) = _group(1, 1.5, bucket_bytes=1 << 20)
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match=r"the trainer \(actor rank 0.*did not arrive within 1.5 s"):
        list(rx.receive(version=1))
    assert time.monotonic() - start < 10
    del sender


def test_a_sender_whose_rollout_workers_never_receive_gets_a_clear_error_naming_them():
    sender, (rx,) = _group(1, 1.5, bucket_bytes=1 << 20)
    with pytest.raises(WeightSyncTimeoutError, match=r"the rollout workers \(weight-sync ranks 1..1\) did not arrive"):
        sender.send(1, sender.pack([("w", torch.ones(4))]))
    del rx
