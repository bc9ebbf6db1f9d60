"""The nccl checkpoint engine's options on the weight-sync group (`checkpoint_engine.engine_kwargs.nccl`),
checked over gloo with threads as ranks: the dtype on the wire and a fresh group per sync."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from verl.workers import weight_sync
from verl.workers.weight_sync import WeightReceiver, WeightSender, connect_store, host_weight_sync_store


def _weights():
    g = torch.Generator().manual_seed(1)
    return [
        ("embed.weight", torch.randn(6, 5, generator=g)),  # fp32
        ("norm.weight", torch.randn(5, generator=g).to(torch.float64)),
        ("position_ids", torch.arange(4, dtype=torch.int64)),  # not floating point: travels as it is
    ]


def _group(num_receivers: int, **options):
    timeout_s = 10.0
    store, host, port = host_weight_sync_store(timeout_s)
    world = 1 + num_receivers
    out: dict = {}
    receiver_options = {k: v for k, v in options.items() if k != "wire_dtype"}

    def make(rank):
        store_client = connect_store(host, port, timeout_s)
        out[rank] = WeightReceiver(store_client, rank, world, timeout_s, backend="gloo", **receiver_options)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    sender = WeightSender(store, world, timeout_s, bucket_bytes=1 << 20, backend="gloo", **options)
    for t in threads:
        t.join()
    return sender, [out[r] for r in range(1, world)]


def _sync(sender, receivers, version, weights):
    got: dict[int, list] = {}

    def receive(i, rx):
        got[i] = [(n, t.clone()) for n, t in rx.receive(version)]

    threads = [threading.Thread(target=receive, args=(i, rx)) for i, rx in enumerate(receivers)]
    for t in threads:
        t.start()
    sender.send(version, sender.pack(weights))
    for t in threads:
        t.join(timeout=20)
    return [got[i] for i in range(len(receivers))]


def test_rollout_dtype_sets_the_dtype_of_floating_point_weights_on_the_wire():
    sender, receivers = _group(2, wire_dtype=torch.bfloat16)
    layouts = [layout for layout, _ in sender.pack(_weights())]
    assert [layout["dtype"] for layout in layouts] == ["bfloat16", "int64"]
    for got in _sync(sender, receivers, 1, _weights()):
        for (name, sent), (got_name, received) in zip(_weights(), got, strict=True):
            assert got_name == name
            if sent.is_floating_point():
                assert received.dtype == torch.bfloat16
                # the bf16 rounding of the sent value, taken independently through float64
                expected = sent.to(torch.float64).to(torch.bfloat16)
                assert torch.equal(received, expected)
                assert not torch.equal(received.to(sent.dtype), sent)  # the cast really happened
            else:
                assert received.dtype == sent.dtype and torch.equal(received, sent)


def test_without_rollout_dtype_weights_keep_their_dtype_bit_exact():
    sender, receivers = _group(1)
    (got,) = _sync(sender, receivers, 1, _weights())
    for (_, sent), (_, received) in zip(_weights(), got, strict=True):
        assert received.dtype == sent.dtype and torch.equal(received, sent)


def test_rollout_dtype_must_be_floating_point():
    store, _, _ = host_weight_sync_store(5.0)
    try:
        WeightSender(store, 1, 5.0, bucket_bytes=1024, backend="gloo", wire_dtype=torch.int32)
    except ValueError as exc:
        assert "floating-point" in str(exc)
    else:
        raise AssertionError("an integer wire dtype was accepted")


def _spy_on_groups(monkeypatch) -> list[tuple[str, int]]:
    formed: list[tuple[str, int]] = []
    real = weight_sync._new_group

    def spy(store, prefix, rank, world_size, timeout_s, backend):
        formed.append((prefix, rank))
        return real(store, prefix, rank, world_size, timeout_s, backend)

    monkeypatch.setattr(weight_sync, "_new_group", spy)
    return formed


def _prefixes_of(formed, rank):
    return [prefix for prefix, r in formed if r == rank]


def test_rebuild_group_forms_a_fresh_group_for_every_sync_and_releases_it(monkeypatch):
    formed = _spy_on_groups(monkeypatch)
    sender, receivers = _group(2, rebuild_group=True, group_name="trainer_to_rollout")
    assert formed == [] and sender.group is None  # nothing formed before the first sync
    for version in (1, 2, 3):
        weights = [(n, t + version) for n, t in _weights()]
        for got in _sync(sender, receivers, version, weights):
            assert all(torch.equal(r, s) for (_, s), (_, r) in zip(weights, got, strict=True))
        assert sender.group is None and all(rx.group is None for rx in receivers)  # released after each
    for rank in range(3):  # one group per version on every member, all under the group's name
        assert _prefixes_of(formed, rank) == [f"verl_weight_sync/trainer_to_rollout/v{v}" for v in (1, 2, 3)], (
            _prefixes_of(formed, rank)
        )


def test_without_rebuild_group_one_group_serves_every_sync(monkeypatch):
    formed = _spy_on_groups(monkeypatch)
    sender, receivers = _group(1)
    group = sender.group
    for version in (1, 2):
        _sync(sender, receivers, version, _weights())
    assert sender.group is group
    assert _prefixes_of(formed, 0) == _prefixes_of(formed, 1) == ["verl_weight_sync/default"]


def test_bucket_layout_names_the_wire_dtype_for_the_receiver():
    sender, _ = _group(1, wire_dtype=torch.float16)
    (layout, flat), _ = sender.pack(_weights())
    assert flat.dtype == torch.float16 and layout["dtype"] == "float16"
    assert json.loads(json.dumps(layout))["names"] == ["embed.weight", "norm.weight"]


def _case_nccl_rebuilt_groups_in_the_wire_dtype() -> dict:
    """One-rank NCCL group (the trainer alone: two ranks on one GPU are not allowed), rebuilt per version."""
    formed: list[str] = []
    real = weight_sync._new_group

    def spy(store, prefix, *args):
        formed.append(prefix)
        return real(store, prefix, *args)

    weight_sync._new_group = spy
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store, _, _ = host_weight_sync_store(60.0)
    sender = WeightSender(
        store, 1, 60.0, bucket_bytes=1 << 20, backend="nccl", rebuild_group=True, wire_dtype=torch.bfloat16
    )
    weights = [(n, t.to(device)) for n, t in _weights()]
    dtypes, intact = [], True
    for version in (1, 2):
        buckets = sender.pack(weights)
        sender.send(version, buckets)
        dtypes.append([layout["dtype"] for layout, _ in buckets])
        intact &= torch.equal(buckets[0][1][:30].float().cpu(), weights[0][1].reshape(-1).bfloat16().float().cpu())
    return {"formed": formed, "dtypes": dtypes, "released": sender.group is None, "intact": bool(intact)}


@pytest.mark.gpu
def test_nccl_groups_are_rebuilt_per_sync_and_carry_the_wire_dtype():
    from tests.distributed_helpers import run_in_fresh_interpreter

    r = run_in_fresh_interpreter(
        "tests.workers.test_weight_sync_options", "_case_nccl_rebuilt_groups_in_the_wire_dtype", timeout_s=120
    )
    assert r["formed"] == ["verl_weight_sync/default/v1", "verl_weight_sync/default/v2"], r
    assert r["dtypes"] == [["bfloat16", "int64"]] * 2 and r["released"] and r["intact"], r


def test_the_checkpoint_engine_config_chooses_the_groups_backend_and_options():
    from verl.workers.config import CheckpointEngineConfig
    from verl.workers.weight_sync import group_options, wire_dtype

    naive = CheckpointEngineConfig()
    assert group_options(naive) == {"backend": None, "group_name": "default", "rebuild_group": False}
    assert wire_dtype(naive) is None
    nccl = CheckpointEngineConfig(
        backend="nccl", engine_kwargs={"nccl": {"group_name": "g", "rebuild_group": True, "rollout_dtype": "fp16"}}
    )
    assert group_options(nccl) == {"backend": "nccl", "group_name": "g", "rebuild_group": True}
    assert wire_dtype(nccl) is torch.float16
