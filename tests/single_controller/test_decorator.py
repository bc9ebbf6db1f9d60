"""Dispatch modes as pure functions of a group's shape (the Ray path is in test_ray_worker_group.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import (
    Dispatch,
    Execute,
    get_registered_methods,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)


class _Shape:
    """The two things a dispatch mode asks a worker group: its size and its mesh layout."""

    def __init__(self, world_size, dp_ranks=None, collect=None):
        self.world_size = world_size
        self._dp, self._collect = dp_ranks, collect

    def _query_dispatch_info(self, mesh_name):
        return self._dp

    def _query_collect_info(self, mesh_name):
        return self._collect


def _proto(n):
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float64)},
        non_tensors={"uid": np.array([str(i) for i in range(n)], dtype=object)},
    )


def test_dp_compute_proto_pads_to_a_multiple_of_the_world_size_and_unpads_on_collect():
    data = _proto(7)
    calls, pad = Dispatch.DP_COMPUTE_PROTO.dispatch(_Shape(3), (data,), {})
    assert pad == 2
    chunks = [args[0] for args, _ in calls]
    assert [len(c) for c in chunks] == [3, 3, 3]
    # padding repeats the first rows: the last chunk is rows 6, 0, 1
    assert chunks[2].batch["x"].tolist() == [6.0, 0.0, 1.0]
    merged = Dispatch.DP_COMPUTE_PROTO.collect(_Shape(3), chunks, pad, futures=False)
    assert merged.batch["x"].tolist() == list(range(7))
    assert list(merged.non_tensor_batch["uid"]) == [str(i) for i in range(7)]


def test_dp_compute_proto_chunks_keyword_arguments_too():
    calls, pad = Dispatch.DP_COMPUTE_PROTO.dispatch(_Shape(2), (), {"data": _proto(4)})
    assert pad == 0
    assert [kwargs["data"].batch["x"].tolist() for _, kwargs in calls] == [[0.0, 1.0], [2.0, 3.0]]


def test_dp_compute_proto_rejects_non_dataproto_arguments_and_mismatched_lengths():
    with pytest.raises(TypeError, match="its argument 1 is a int; pass DataProto or TensorDict objects only"):
        Dispatch.DP_COMPUTE_PROTO.dispatch(_Shape(2), (_proto(2), 5), {})
    with pytest.raises(ValueError, match=r"different lengths \[2, 3\]"):
        Dispatch.DP_COMPUTE_PROTO.dispatch(_Shape(2), (_proto(2), _proto(3)), {})


def test_collect_explains_a_rank_that_did_not_return_a_dataproto():
    with pytest.raises(TypeError, match="data-parallel rank 1 returned dict"):
        Dispatch.DP_COMPUTE_PROTO.collect(_Shape(2), [_proto(1), {"loss": 1.0}], 0, futures=False)


def _jagged_td(lengths):
    """Row i: x = i and ids = [0, 1, ..., lengths[i] - 1] (a jagged tensor)."""
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)
    return TensorDict({"x": torch.arange(len(lengths), dtype=torch.float32), "ids": ids}, batch_size=[len(lengths)])


def test_dp_compute_proto_pads_and_chunks_tensordicts_jagged_tensors_included():
    calls, pad = Dispatch.DP_COMPUTE_PROTO.dispatch(_Shape(2), (_jagged_td([1, 2, 3]),), {})
    assert pad == 1
    chunks = [args[0] for args, _ in calls]
    assert [c["x"].tolist() for c in chunks] == [[0.0, 1.0], [2.0, 0.0]]  # the padding repeats row 0
    assert [[row.tolist() for row in c["ids"].unbind(0)] for c in chunks] == [[[0], [0, 1]], [[0, 1, 2], [0]]]
    # each chunk owns its memory, so pickling it for a worker does not carry the whole batch
    assert all(c.is_consolidated() for c in chunks)
    merged = Dispatch.DP_COMPUTE_PROTO.collect(_Shape(2), chunks, pad, futures=False)
    assert isinstance(merged, TensorDict) and merged["x"].tolist() == [0.0, 1.0, 2.0]
    assert [row.tolist() for row in merged["ids"].unbind(0)] == [[0], [0, 1], [0, 1, 2]]


def test_mesh_mode_chunks_a_dataproto_and_a_tensordict_of_the_same_length_together():
    shape = _Shape(2, dp_ranks=[0, 1], collect=[True, True])
    calls, pad = make_nd_compute_dataproto_dispatch_fn("actor").dispatch(
        shape, (_proto(4),), {"extra": _jagged_td([1, 2, 3, 4])}
    )
    assert pad == 0
    assert [(args[0].batch["x"].tolist(), kwargs["extra"]["x"].tolist()) for args, kwargs in calls] == [
        ([0.0, 1.0], [0.0, 1.0]),
        ([2.0, 3.0], [2.0, 3.0]),
    ]
    with pytest.raises(ValueError, match=r"different lengths \[3, 4\]"):
        Dispatch.DP_COMPUTE_PROTO.dispatch(_Shape(2), (_proto(4), _jagged_td([1, 2, 3])), {})


def test_a_tensordict_without_rows_or_a_mixed_result_is_refused():
    with pytest.raises(ValueError, match="TensorDict without a batch dimension"):
        Dispatch.DP_COMPUTE_PROTO.dispatch(_Shape(2), (TensorDict({"x": torch.zeros(2)}, batch_size=[]),), {})
    with pytest.raises(TypeError, match=r"all DataProtos or all TensorDicts"):
        Dispatch.DP_COMPUTE_PROTO.collect(_Shape(2), [_proto(1), _jagged_td([1])], 0, futures=False)


def test_all_to_all_splits_only_when_every_argument_is_a_list_of_one_entry_per_worker():
    calls, _ = Dispatch.ALL_TO_ALL.dispatch(_Shape(2), ([1, 2],), {"k": ["a", "b"]})
    assert calls == [((1,), {"k": "a"}), ((2,), {"k": "b"})]
    for args, kwargs in [(([1, 2],), {"k": 0}), (([1, 2, 3],), {}), (((1, 2),), {}), ((), {})]:
        calls, _ = Dispatch.ALL_TO_ALL.dispatch(_Shape(2), args, kwargs)
        assert calls == [(args, kwargs)] * 2
    # upstream's function pair: per-argument lists of one value per worker
    from verl.single_controller.base.decorator import get_predefined_dispatch_fn

    dispatch = get_predefined_dispatch_fn(Dispatch.ALL_TO_ALL)["dispatch_fn"]
    assert dispatch(_Shape(2), [1, 2], [3, 4]) == (([1, 2], [3, 4]), {})
    assert dispatch(_Shape(2), [1, 2], 7) == (([[1, 2], [1, 2]], [7, 7]), {})


def test_one_to_all_hands_every_worker_the_same_objects():
    payload = torch.zeros(3)
    calls, _ = Dispatch.ONE_TO_ALL.dispatch(_Shape(4), (payload,), {"k": 1})
    assert len(calls) == 4 and all(args[0] is payload and kwargs == {"k": 1} for args, kwargs in calls)


def test_mesh_mode_dispatches_by_dp_rank_and_collects_one_rank_per_shard():
    # 4 workers = dp 2 x tp 2; ranks 0 and 2 collect
    shape = _Shape(4, dp_ranks=[0, 0, 1, 1], collect=[True, False, True, False])
    mode = make_nd_compute_dataproto_dispatch_fn("actor")
    assert mode is make_nd_compute_dataproto_dispatch_fn("actor")
    calls, pad = mode.dispatch(shape, (_proto(3),), {})
    assert pad == 1
    assert [args[0].batch["x"].tolist() for args, _ in calls] == [[0.0, 1.0], [0.0, 1.0], [2.0, 0.0], [2.0, 0.0]]
    outputs = [args[0] for args, _ in calls]
    outputs[1] = outputs[3] = None  # non-collecting ranks' outputs are never looked at
    assert mode.collect(shape, outputs, pad, futures=False).batch["x"].tolist() == [0.0, 1.0, 2.0]


def test_mesh_mode_rejects_two_collectors_for_one_shard():
    shape = _Shape(2, dp_ranks=[0, 0], collect=[True, True])
    with pytest.raises(ValueError, match="ranks 0 and 1 are both marked as collecting"):
        make_nd_compute_dataproto_dispatch_fn("m").collect(shape, [_proto(1), _proto(1)], 0, futures=False)


def test_user_dispatch_mode_is_registered_by_name_and_can_be_updated():
    name = "TEST_EVERY_OTHER"
    if name not in Dispatch:
        register_dispatch_mode(name, lambda wg, xs: ((xs[::2],), {}), lambda wg, outs: outs)
    mode = Dispatch[name]
    assert getattr(Dispatch, name) is mode
    calls, _ = mode.dispatch(_Shape(2), ([1, 2, 3, 4],), {})
    assert [args for args, _ in calls] == [(1,), (3,)]
    update_dispatch_mode(mode, lambda wg, xs: ((xs[1::2],), {}), lambda wg, outs: sum(outs))
    calls, _ = mode.dispatch(_Shape(2), ([1, 2, 3, 4],), {})
    assert [args for args, _ in calls] == [(2,), (4,)]
    assert mode.collect(_Shape(2), [2, 4], None, futures=False) == 6
    with pytest.raises(ValueError, match="already exists"):
        register_dispatch_mode(name, None, None)
    with pytest.raises(TypeError, match="must be callable"):
        update_dispatch_mode(mode, None, None)


def test_builtin_mode_takes_other_functions_and_gets_its_own_back():
    """Upstream lets update_dispatch_mode replace a built-in mode's functions; a replacement may wrap
    the mode's own function (no recursion), and putting the own ones back restores the mode."""
    from verl.single_controller.base.decorator import get_predefined_dispatch_fn

    mode = Dispatch.ONE_TO_ALL
    own = get_predefined_dispatch_fn(mode)

    def times_ten(worker_group, x):
        (xs,), kwargs = own["dispatch_fn"](worker_group, x * 10)
        return (xs,), kwargs

    try:
        update_dispatch_mode(mode, times_ten, lambda wg, outs: outs[0])
        calls, _ = mode.dispatch(_Shape(2), (1,), {})
        assert [args for args, _ in calls] == [(10,), (10,)]
        assert mode.collect(_Shape(2), ["a", "b"], None, futures=False) == "a"
        assert get_predefined_dispatch_fn(mode)["dispatch_fn"] is times_ten
    finally:
        update_dispatch_mode(mode, own["dispatch_fn"], own["collect_fn"])
    calls, _ = mode.dispatch(_Shape(2), (1,), {})
    assert [args for args, _ in calls] == [(1,), (1,)] and "dispatch" not in vars(mode)
    assert get_predefined_dispatch_fn(mode) == own


def test_registry_copy_clear_update_round_trip_restores_every_mode():
    from verl.single_controller.base.decorator import (
        DISPATCH_MODE_FN_REGISTRY,
        _check_dispatch_mode,
        get_predefined_dispatch_fn,
    )

    saved = DISPATCH_MODE_FN_REGISTRY.copy()
    assert isinstance(saved, dict) and saved[Dispatch.RANK_ZERO] == get_predefined_dispatch_fn(Dispatch.RANK_ZERO)
    register_dispatch_mode("TEST_ROUND_TRIP", lambda wg, x: (([x] * wg.world_size,), {}), lambda wg, outs: outs)
    _check_dispatch_mode(Dispatch.TEST_ROUND_TRIP)
    update_dispatch_mode(Dispatch.DP_COMPUTE, lambda wg, x: (([x] * wg.world_size,), {}), lambda wg, outs: outs)
    DISPATCH_MODE_FN_REGISTRY.clear()
    DISPATCH_MODE_FN_REGISTRY.update(saved)
    assert "TEST_ROUND_TRIP" not in Dispatch and DISPATCH_MODE_FN_REGISTRY.copy() == saved
    assert all("dispatch" not in vars(mode) for mode in Dispatch)  # built-ins run their own code again
    with pytest.raises(ValueError, match="built in"):
        Dispatch.remove("ONE_TO_ALL")
    with pytest.raises(TypeError, match="not a dispatch mode"):
        _check_dispatch_mode(42)


def test_user_dispatch_fn_must_return_one_value_per_worker():
    mode = Dispatch[
        "TEST_BROKEN"
        if "TEST_BROKEN" in Dispatch
        else register_dispatch_mode("TEST_BROKEN", lambda wg, x: ((x,), {}), lambda wg, o: o).name
    ]
    with pytest.raises(ValueError, match=r"one value per worker \(2\); argument 0 is int"):
        mode.dispatch(_Shape(2), (7,), {})


def test_register_records_modes_and_rank_zero_implies_rank_zero_execution():
    class Roles(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def update(self, data):
            return data

        @register(dispatch_mode=Dispatch.RANK_ZERO)
        def save(self, path):
            return path

        def helper(self):
            return None

    methods = get_registered_methods(Roles)
    assert {"update", "save", "execute_with_func_generator", "execute_func_rank_zero"} <= set(methods)
    assert "helper" not in methods
    assert methods["update"].dispatch_mode is Dispatch.DP_COMPUTE_PROTO and not methods["update"].blocking
    assert methods["save"].execute_mode is Execute.RANK_ZERO


def test_register_keeps_async_methods_async_and_rejects_unknown_modes():
    import asyncio
    import inspect

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def generate(self, x):
        await asyncio.sleep(0)
        return x + 1

    assert inspect.iscoroutinefunction(generate)
    assert asyncio.run(generate(None, 1)) == 2
    info = generate._verl_registered_method
    assert info.is_async and info.dispatch_mode is Dispatch.ONE_TO_ALL

    with pytest.raises(KeyError, match="unknown dispatch mode 'NOPE'"):
        register(dispatch_mode="NOPE")


def test_importing_the_base_package_pulls_in_neither_ray_nor_torch():
    import subprocess
    import sys

    code = (
        "import sys, verl.single_controller.base.decorator, verl.single_controller.base;"
        "print(','.join(m for m in ('ray', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_dispatch_mode_fn_registry_shows_every_mode_as_upstream_function_pairs():
    from types import SimpleNamespace

    import torch

    from verl.protocol import DataProto
    from verl.single_controller.base.decorator import (
        DISPATCH_MODE_FN_REGISTRY,
        collect_all_to_all,
        get_predefined_dispatch_fn,
        get_predefined_execute_fn,
    )

    group = SimpleNamespace(world_size=2)
    assert set(DISPATCH_MODE_FN_REGISTRY) >= {Dispatch.ONE_TO_ALL, Dispatch.DP_COMPUTE_PROTO, Dispatch.RANK_ZERO}
    one = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)
    assert one["collect_fn"] is collect_all_to_all and DISPATCH_MODE_FN_REGISTRY["ONE_TO_ALL"] == one
    assert one["dispatch_fn"](group, 5, key="v") == (([5, 5],), {"key": ["v", "v"]})
    assert collect_all_to_all(group, [1, 2]) == [1, 2]

    dp = get_predefined_dispatch_fn(Dispatch.DP_COMPUTE)
    assert dp["dispatch_fn"](group, [1, 2]) == (([1, 2],), {})

    proto = get_predefined_dispatch_fn(Dispatch.DP_COMPUTE_PROTO)
    data = DataProto.from_dict(tensors={"x": torch.arange(4)})
    (chunks,), _ = proto["dispatch_fn"](group, data)
    assert [c.batch["x"].tolist() for c in chunks] == [[0, 1], [2, 3]]
    assert proto["collect_fn"](group, chunks).batch["x"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="needs 1 padding rows"):
        proto["dispatch_fn"](group, DataProto.from_dict(tensors={"x": torch.arange(3)}))

    with_func = get_predefined_dispatch_fn(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    (funcs, parts), _ = with_func["dispatch_fn"](group, len, data)
    assert funcs == [len, len] and [len(p) for p in parts] == [2, 2]

    assert get_predefined_execute_fn(Execute.ALL) == {"execute_fn_name": "execute_all"}
    assert get_predefined_execute_fn(Execute.RANK_ZERO) == {"execute_fn_name": "execute_rank_zero"}
    with pytest.raises(KeyError, match="not a registered dispatch mode"):
        DISPATCH_MODE_FN_REGISTRY["NOPE"]


def test_registry_follows_registered_and_updated_modes():
    from verl.single_controller.base.decorator import (
        get_predefined_dispatch_fn,
        register_dispatch_mode,
        update_dispatch_mode,
    )

    def dispatch(worker_group, x):
        return ([x] * worker_group.world_size,), {}

    def collect(worker_group, outputs):
        return sum(outputs)

    name = "TEST_REGISTRY_VIEW"
    mode = Dispatch[name] if name in Dispatch else register_dispatch_mode(name, dispatch, collect)
    assert get_predefined_dispatch_fn(mode) == {"dispatch_fn": dispatch, "collect_fn": collect}

    def collect_max(worker_group, outputs):
        return max(outputs)

    update_dispatch_mode(mode, dispatch, collect_max)
    assert get_predefined_dispatch_fn(name)["collect_fn"] is collect_max
