"""Worker groups on a real local Ray cluster: every dispatch mode, padding, futures, gloo, errors.

One 2-worker group (CPU bundles) serves most tests; tests that kill or reconfigure workers start
their own. Worker classes live in this module and travel to the workers by value.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import torch
from ray import cloudpickle
from tensordict import TensorDict

from verl.protocol import DataProto, DataProtoFuture
from verl.single_controller.base import Worker, WorkerMethodError, WorkerTimeoutError
from verl.single_controller.base.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _dispatch_reversed(worker_group, values):
    """Rank i gets values[world_size - 1 - i]."""
    return (list(reversed(values)),), {}


def _collect_by_rank(worker_group, outputs):
    return dict(outputs)


REVERSED = (
    Dispatch.TEST_REVERSED
    if "TEST_REVERSED" in Dispatch
    else register_dispatch_mode("TEST_REVERSED", _dispatch_reversed, _collect_by_rank)
)


def _rows_out(data: DataProto, rank: int, y: torch.Tensor) -> DataProto:
    return DataProto.from_dict(
        tensors={"y": y, "rank": torch.full((len(data),), rank)},
        non_tensors={"uid": data.non_tensor_batch["uid"]},
    )


class EchoWorker(Worker):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.calls = 0
        # "tp": all ranks hold the same shard (dp 0) and only the last rank's output is collected.
        self._register_dispatch_collect_info("tp", dp_rank=0, is_collect=self.rank == self.world_size - 1)
        self._register_dispatch_collect_info("dp", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self):
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "master": self.get_master_addr_port(),
            "pid": os.getpid(),
            "role": os.environ.get("VERL_ROLE"),
            "dist_timeout": os.environ.get("VERL_DIST_TIMEOUT_S"),
            "calls": self.calls,
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weighted_sum(self, tensor, weight=1.0):
        return float(tensor.double().sum()) * weight * self.scale

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def add_rank(self, value, offset=0):
        return value + self.rank + offset

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scale_rows(self, data):
        return _rows_out(data, self.rank, data.batch["x"] * self.scale)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def scale_rows_async(self, data):
        out = DataProto.from_dict(tensors={"x": data.batch["x"] * self.scale})
        out.non_tensor_batch["uid"] = data.non_tensor_batch["uid"]
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def widen(self, data):
        """Rows of 64K values (128-256 KiB): results this large travel through Ray's object store."""
        if data.meta_info.get("fail_rank") == self.rank:
            raise ValueError(f"rank {self.rank} asked to fail")
        x = data.batch["x"]
        return DataProto.from_dict(
            tensors={"wide": x[:, None].expand(-1, 65536).to(torch.bfloat16).contiguous(), "f32": x[:, None] * 65536.0}
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, func, data):
        return func(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def chunk_stats(self, data):
        return {"rank": self.rank, "rows": len(data), "sum": float(data.batch["x"].sum())}

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def bump(self, amount):
        self.calls += amount
        return self.rank, self.calls

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank_zero_echo(self, value):
        return self.rank, value

    @register(dispatch_mode=REVERSED)
    def tag(self, value):
        return self.rank, value

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("tp"))
    def tp_forward(self, data):
        return _rows_out(data, self.rank, data.batch["x"] + 1)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("dp"))
    def dp_forward(self, data):
        return _rows_out(data, self.rank, data.batch["x"] + 1)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("dp"), blocking=False)
    def dp_row_lengths(self, data: TensorDict) -> TensorDict:
        """TensorDict in, TensorDict out: each row's jagged length, x * scale and the rank."""
        lengths = torch.tensor([len(row) for row in data["ids"].unbind(0)], dtype=torch.float32)
        return TensorDict(
            {"y": data["x"] * self.scale + lengths, "rank": torch.full((len(data),), self.rank)},
            batch_size=[len(data)],
        )

    @register()  # the default mode, ALL_TO_ALL
    def received(self, value, offset=None):
        return self.rank, value, offset

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_ranks(self):
        import torch.distributed as dist

        self.init_process_group(timeout_s=60)
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return dist.get_backend(), value.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, bad_rank):
        if self.rank == bad_rank:
            raise ValueError(f"bad input seen on rank {self.rank}")
        return "ok"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds)
        return os.getpid()


def _batch(n: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
    )


@pytest.fixture(scope="module")
def group(ray_session):
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    saved = os.environ.get("VERL_DIST_TIMEOUT_S")
    os.environ["VERL_DIST_TIMEOUT_S"] = "45"  # the driver's VERL_* settings reach the workers
    try:
        wg = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker, scale=3.0), role="echo")
    finally:
        if saved is None:
            del os.environ["VERL_DIST_TIMEOUT_S"]
        else:
            os.environ["VERL_DIST_TIMEOUT_S"] = saved
    yield wg
    wg.shutdown()
    pool.remove_placement_groups()


def test_workers_get_ranks_and_one_master_address(group):
    infos = group.whoami()
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert infos[0]["master"] == infos[1]["master"] and infos[0]["master"][1] is not None
    assert infos[0]["pid"] != infos[1]["pid"]
    assert {i["role"] for i in infos} == {"echo"}
    assert {i["dist_timeout"] for i in infos} == {"45"}


def test_one_to_all_sends_the_same_large_tensor_to_every_worker(group):
    tensor = torch.rand(256, 256)  # 256 KiB: shared through the object store once
    expected = float(tensor.double().sum()) * 2.0 * 3.0
    assert group.weighted_sum(tensor, weight=2.0) == pytest.approx([expected, expected])


def test_large_arguments_going_to_several_workers_are_put_in_the_object_store_once(ray_session):
    big = torch.rand(64 * 1024)  # 256 KiB, sent to both workers
    small = {"lr": 0.1}  # cheaper to inline into each call
    chunks = torch.rand(2, 100_000)  # one per worker
    shared = RayWorkerGroup._put_repeated_args([((big, small, chunks[0]), {}), ((big, small, chunks[1]), {})])
    assert set(shared) == {id(big)}
    assert torch.equal(ray_session.get(shared[id(big)]), big)


def test_dp_compute_gives_rank_i_entry_i(group):
    assert group.add_rank([10, 20], offset=[100, 200]) == [110, 221]
    with pytest.raises(ValueError, match="one entry per worker"):
        group.add_rank([1, 2, 3])


@pytest.mark.parametrize("n", [2, 5, 7])
def test_dp_compute_proto_pads_uneven_batches_and_returns_rows_in_order(group, n):
    out = group.scale_rows(_batch(n))
    assert len(out) == n
    torch.testing.assert_close(out.batch["y"], torch.arange(n, dtype=torch.float32) * 3.0)
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
    # chunk size is ceil(n / 2): the first chunk went to rank 0, the rest to rank 1
    per_rank = -(-n // 2)
    assert out.batch["rank"].tolist() == [0] * per_rank + [1] * (n - per_rank)


def test_dp_compute_proto_results_from_the_object_store_come_back_exact_in_fresh_memory(group):
    from verl.protocol import _borrowing

    out = group.widen(_batch(5))  # padded to 6 rows, 3 per rank: 384 KiB of bfloat16 per result
    expected = torch.arange(5, dtype=torch.bfloat16)[:, None].expand(-1, 65536)
    assert out.batch["wide"].dtype == torch.bfloat16 and torch.equal(out.batch["wide"], expected)
    assert out.batch["f32"].view(-1).tolist() == [i * 65536.0 for i in range(5)]
    out.batch["wide"].add_(1)  # the concatenated result owns its memory
    assert torch.equal(group.widen(_batch(5)).batch["wide"], expected)
    failing = _batch(4)
    failing.meta_info["fail_rank"] = 1
    with pytest.raises(WorkerMethodError, match="rank 1 asked to fail"):
        group.widen(failing)
    assert not getattr(_borrowing, "active", False)  # later unpickling copies again


def test_dp_compute_proto_with_func_sends_the_function_to_every_rank(group):
    out = group.apply(lambda d: DataProto.from_dict(tensors={"sq": d.batch["x"] ** 2}), _batch(4))
    torch.testing.assert_close(out.batch["sq"], torch.arange(4, dtype=torch.float32) ** 2)


def test_dp_compute_metric_returns_one_result_per_rank(group):
    stats = group.chunk_stats(_batch(6))
    assert stats == [{"rank": 0, "rows": 3, "sum": 0 + 1 + 2}, {"rank": 1, "rows": 3, "sum": 3 + 4 + 5}]


def test_rank_zero_dispatch_runs_only_on_rank_zero(group):
    before = [i["calls"] for i in group.whoami()]
    assert group.bump(5) == (0, before[0] + 5)
    after = [i["calls"] for i in group.whoami()]
    assert after == [before[0] + 5, before[1]]


def test_execute_rank_zero_returns_rank_zeros_result(group):
    assert group.rank_zero_echo("hi") == (0, "hi")
    assert group.execute_rank_zero("whoami")["rank"] == 0
    assert [i["rank"] for i in group.execute_all("whoami")] == [0, 1]


def test_all_to_all_splits_lists_of_one_entry_per_worker_and_broadcasts_anything_else(group):
    assert group.received([1, 2], offset=["a", "b"]) == [(0, 1, "a"), (1, 2, "b")]  # rank i gets entry i
    assert group.received(7) == [(0, 7, None), (1, 7, None)]
    # unless every argument is a list of world_size entries, everyone gets the same arguments
    assert group.received([1, 2], offset=3) == [(0, [1, 2], 3), (1, [1, 2], 3)]
    assert group.received([1, 2, 3]) == [(0, [1, 2, 3], None), (1, [1, 2, 3], None)]
    assert group.received((1, 2)) == [(0, (1, 2), None), (1, (1, 2), None)]  # a tuple is not split
    assert group.execute_all("received", [1, 2]) == [(0, 1, None), (1, 2, None)]  # execute_all: same rule
    assert group.execute_all("received", 5) == [(0, 5, None), (1, 5, None)]


def test_worker_base_helpers_run_functions_on_the_workers(group):
    ranks = group.execute_with_func_generator(
        lambda worker, data: DataProto.from_dict(tensors={"r": torch.full((len(data),), worker.rank)}), _batch(4)
    )
    assert ranks.batch["r"].tolist() == [0, 0, 1, 1]
    assert group.execute_func_rank_zero(lambda worker, k: (worker.rank, k), "k") == (0, "k")


def test_user_registered_dispatch_mode(group):
    assert group.tag(["first", "second"]) == {0: "second", 1: "first"}


def test_mesh_dispatch_collects_only_from_collecting_ranks(group):
    data = _batch(3)
    tp = group.tp_forward(data)  # both ranks see all 3 rows; only rank 1 is collected
    assert tp.batch["rank"].tolist() == [1, 1, 1]
    torch.testing.assert_close(tp.batch["y"], torch.arange(3, dtype=torch.float32) + 1)
    dp = group.dp_forward(data)  # 3 rows padded to 4, two per rank, padding dropped
    assert dp.batch["rank"].tolist() == [0, 0, 1]
    torch.testing.assert_close(dp.batch["y"], torch.arange(3, dtype=torch.float32) + 1)


def test_non_blocking_call_returns_a_future_that_chains_into_the_next_call(group):
    future = group.scale_rows_async(_batch(4))
    assert isinstance(future, DataProtoFuture)
    # The future goes straight to the workers (each materializes its own chunk), not via the driver.
    chained = group.scale_rows(future)
    torch.testing.assert_close(chained.batch["y"], torch.arange(4, dtype=torch.float32) * 9.0)
    torch.testing.assert_close(future.get().batch["x"], torch.arange(4, dtype=torch.float32) * 3.0)
    # padding also applies to non-blocking calls: 3 rows on 2 ranks come back as 3
    assert len(group.scale_rows_async(_batch(3)).get()) == 3


def test_mesh_dispatch_splits_tensordicts_and_concatenates_the_tensordicts_returned(group):
    # 3 rows (jagged ids of lengths 1, 2, 3) padded to 4 for the 2 dp ranks; the padding is dropped again
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in (1, 2, 3)], layout=torch.jagged)
    data = TensorDict({"x": torch.tensor([10.0, 20.0, 30.0]), "ids": ids}, batch_size=[3])
    future = group.dp_row_lengths(data)
    assert isinstance(future, DataProtoFuture)
    out = future.get()
    assert isinstance(out, TensorDict)
    assert out["y"].tolist() == [31.0, 62.0, 93.0]  # x * 3 + length
    assert out["rank"].tolist() == [0, 0, 1]


def test_two_rank_group_does_a_real_gloo_all_reduce(group):
    assert group.all_reduce_ranks() == [("gloo", 3.0), ("gloo", 3.0)]


def test_a_raising_method_reports_role_rank_method_and_remote_traceback(group):
    with pytest.raises(WorkerMethodError) as info:
        group.fail_on_rank(1)
    err = info.value
    assert (err.role, err.rank, err.method, err.exc_type) == ("echo", 1, "fail_on_rank", "ValueError")
    assert "bad input seen on rank 1" in str(err)
    assert "in fail_on_rank" in err.remote_traceback  # the worker-side frame
    assert isinstance(err.remote_exception, ValueError)
    assert group.fail_on_rank(-1) == ["ok", "ok"]  # the group is still usable


def test_a_call_past_its_deadline_raises_naming_the_pending_ranks(group):
    group.timeout_s = 0.3
    try:
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=r"rank\(s\) \[0, 1\]") as info:
            group.nap(6.0)
        # proves the call gave up at its deadline instead of waiting for the 6 s nap; the 5 s bound is
        # ~16x the 0.3 s deadline, room for a heavily loaded machine, and still short of the nap
        elapsed = time.monotonic() - start
        assert elapsed < 5.0, f"the call took {elapsed:.2f} s: it waited for the nap, not its 0.3 s deadline"
        assert info.value.method == "nap"
    finally:
        group.timeout_s = 60.0
    group.nap(0)  # drains the queue behind the slow call
