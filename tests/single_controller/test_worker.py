"""The Worker base class outside Ray: environment, mesh info, the RPC entry point, dist init."""

from __future__ import annotations

import random
import socket
import time

import pytest
import torch.distributed as dist

from verl.single_controller.base import Worker
from verl.single_controller.base.errors import _WorkerSideError
from verl.single_controller.base.worker import get_free_port


def test_worker_reads_the_torch_distributed_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "1234")
    worker = Worker()
    assert (worker.rank, worker.world_size, worker.local_rank, worker.local_world_size) == (3, 4, 1, 2)
    assert worker.get_master_addr_port() == ("10.0.0.7", "1234")


def test_worker_without_environment_is_rank_zero_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    worker = Worker()
    assert (worker.rank, worker.world_size, worker.local_rank) == (0, 1, 0)


def test_worker_rejects_a_rank_outside_the_world(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"RANK=2 is outside \[0, WORLD_SIZE=2\)"):
        Worker()


def test_mesh_info_is_recorded_per_mesh(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    worker = Worker()
    worker._register_dispatch_collect_info("actor", dp_rank=1, is_collect=False)
    assert (worker._query_dispatch_info("actor"), worker._query_collect_info("actor")) == (1, False)
    assert worker._query_dispatch_info("critic") is None
    with pytest.raises(ValueError, match="already registered"):
        worker._register_dispatch_collect_info("actor", dp_rank=0, is_collect=True)


class _Raiser(Worker):
    def explode(self, value):
        raise KeyError(value)

    def echo(self, value):
        return value


def test_rpc_entry_point_names_rank_method_and_keeps_the_traceback(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    worker = _Raiser()
    assert worker._verl_rpc("echo", 5) == 5
    with pytest.raises(_WorkerSideError) as info:
        worker._verl_rpc("explode", "missing-key")
    err = info.value
    assert (err.rank, err.method, err.exc_type) == (0, "explode", "KeyError")
    assert "raise KeyError(value)" in err.traceback_text
    assert isinstance(err.original, KeyError)


def test_dist_init_with_a_missing_peer_fails_within_the_timeout(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 1 never comes
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(get_free_port()))
    worker = Worker()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 of 2 could not form the torch.distributed group"):
        worker.init_process_group(backend="gloo", timeout_s=1.5)
    # the failure mode is waiting out the 600 s default; 120 s stays far from it on a loaded machine
    assert time.monotonic() - start < 120
    assert not dist.is_initialized()


def _group_timeout_s(group=None) -> float:
    """The collective timeout torch holds for `group`'s CPU (gloo) backend."""
    import torch

    pg = group or dist.distributed_c10d._get_default_group()
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_cpu_group_is_gloo_with_the_given_timeout_which_later_groups_reuse(monkeypatch):
    from verl.single_controller.base.worker import dist_timeout_s

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    monkeypatch.setenv("VERL_DIST_TIMEOUT_S", "45")  # the argument (a config's nccl_timeout) wins
    Worker().init_process_group(timeout_s=123)
    try:
        assert dist.get_backend() == "gloo"
        assert _group_timeout_s() == 123
        # megatron's model-parallel groups ask for the same deadline (torch would give them 30 min)
        assert dist_timeout_s() == 123
    finally:
        dist.destroy_process_group()
    assert dist_timeout_s() == 45  # no group any more: back to the environment


@pytest.mark.gpu
def test_cuda_group_is_bound_mixed_and_runs_host_and_device_collectives(monkeypatch):
    """On CUDA the workers' group is `cpu:gloo,cuda:nccl` bound to the rank's device with the given
    timeout: CPU tensors (the trainer's host-side counts) and CUDA tensors reduce on it and on a
    subgroup created from it; an NCCL-only group still takes the host-side split's count (it goes
    to the device)."""
    import torch

    from verl.utils.device import collective_device, get_device
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cuda")
    Worker().init_process_group(timeout_s=321)
    try:
        backend = str(dist.get_backend())
        assert backend == "cpu:gloo,cuda:nccl", backend
        bound = dist.distributed_c10d._get_default_group().bound_device_id
        assert bound == get_device(), f"device_id not passed: bound_device_id={bound}"
        nccl = dist.distributed_c10d._get_default_group()._get_backend(get_device())
        if hasattr(nccl, "options"):  # the same init call sets both backends' timeout (gloo's checked below)
            assert nccl.options._timeout.total_seconds() == 321, nccl.options._timeout
        assert _group_timeout_s() == 321
        host, on_device = torch.ones(3), torch.ones(3, device=get_device())
        dist.all_reduce(host)
        dist.all_reduce(on_device)
        subgroup = dist.new_group([0])
        dist.all_reduce(host, group=subgroup)
        assert collective_device(subgroup) == torch.device("cpu")

        nccl_only = dist.new_group([0], backend="nccl")
        assert collective_device(nccl_only) == get_device()
        from tensordict import TensorDict

        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
        batch = TensorDict({"attention_mask": mask}, batch_size=[3])  # on the host, like the actor's
        micro_batches, partitions = rearrange_micro_batches(batch, max_token_len=4, dp_group=nccl_only)
        assert sorted(i for p in partitions for i in p) == [0, 1, 2] and len(micro_batches) == 3
    finally:
        dist.destroy_process_group()


def test_set_dispatch_collect_adopts_a_sub_workers_mesh(monkeypatch):
    from verl.single_controller.base import Worker

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ref, actor, host = Worker(), Worker(), Worker()
    ref._register_dispatch_collect_info("ref", dp_rank=0, is_collect=True)
    actor._register_dispatch_collect_info("actor", dp_rank=1, is_collect=False)
    assert actor.get_dispatch_collect() == {"dispatch_dp_rank": {"actor": 1}, "collect_dp_rank": {"actor": False}}
    host.set_dispatch_collect(mesh_name="ref", **ref.get_dispatch_collect())
    host.set_dispatch_collect(mesh_name="policy", **actor.get_dispatch_collect())
    assert (host._query_dispatch_info("ref"), host._query_collect_info("ref")) == (0, True)
    assert (host._query_dispatch_info("policy"), host._query_collect_info("policy")) == (1, False)
    with pytest.raises(ValueError, match="'policy' is already registered"):
        host.set_dispatch_collect(mesh_name="policy", **actor.get_dispatch_collect())
    with pytest.raises(ValueError, match="exactly one mesh"):
        host.set_dispatch_collect(mesh_name="both", **host.get_dispatch_collect())


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_get_free_port_picks_outside_the_kernels_ephemeral_range():
    """Ports of the ephemeral range are what the kernel hands to every outgoing connection; a
    MASTER_PORT from there can be taken between the pick and rank 0's bind (EADDRINUSE)."""
    low = _ephemeral_low()
    ports = {get_free_port() for _ in range(50)}
    assert all(20000 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # random picks, so concurrent runs rarely pick the same one


def test_get_free_port_skips_a_port_in_use():
    seed = 1234
    taken = random.Random(seed).randrange(20000, _ephemeral_low())  # the first port this seed picks
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("", taken))
        holder.listen()
        port = get_free_port(random.Random(seed))
        assert port != taken
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", port))  # and the port it returned is bindable
