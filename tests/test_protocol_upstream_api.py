"""The DataProto API added for upstream parity: padding, auto-padding, per-row repeats, column
unfolding, TensorDict conversion, (de)serialisation helpers and batch folding."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoError,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
)


def _proto(n=3):
    return DataProto.from_dict(
        tensors={"obs": torch.arange(2 * n).reshape(n, 2)},
        non_tensors={"labels": [chr(ord("a") + i) for i in range(n)]},
        meta_info={"info": "x"},
    )


def test_none_parts_give_an_empty_proto():
    empty = DataProto(batch=None, non_tensor_batch=None, meta_info=None)
    assert len(empty) == 0 and empty.non_tensor_batch == {} and empty.meta_info == {}
    data = DataProto(batch=TensorDict({"a": torch.zeros(2)}, batch_size=[2]), non_tensor_batch=None)
    assert len(data) == 2 and data.non_tensor_batch == {}


def test_padding_repeats_the_last_row_or_the_first():
    data = _proto()
    data.padding(2)
    assert data.batch["obs"].tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
    assert data.non_tensor_batch["labels"].tolist() == ["a", "b", "c", "c", "c"]
    first = _proto()
    first.padding(1, padding_candidate="first")
    assert first.non_tensor_batch["labels"].tolist() == ["a", "b", "c", "a"]
    first.padding(0)
    assert len(first) == 4


def test_auto_padding_allows_uneven_chunks(monkeypatch):
    with pytest.raises(ValueError, match="do not split evenly"):
        _proto(10).chunk(4)
    flagged = DataProto.from_dict(tensors={"a": torch.arange(10)}, auto_padding=True)
    assert flagged.is_padding_enabled() and flagged.meta_info == {"_verl_auto_padding": True}
    assert [c.batch["a"].tolist() for c in flagged.chunk(4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [len(c) for c in DataProto.from_single_dict({"a": torch.arange(5)}, auto_padding=True).chunk(4)] == [
        2,
        2,
        1,
        0,
    ]
    try:
        DataProtoConfig.auto_padding = True
        assert _proto(10).is_padding_enabled() and len(_proto(10).chunk(4)) == 4
    finally:
        DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert DataProtoConfig.auto_padding and _proto(5).is_padding_enabled()
    monkeypatch.delenv("VERL_AUTO_PADDING")
    assert not _proto(5).is_padding_enabled()
    with pytest.raises(TypeError, match="must be a bool"):
        DataProtoConfig.auto_padding = "yes"


def test_num_batch_dims_other_than_one_is_refused():
    with pytest.raises(ValueError, match="exactly one batch dimension"):
        DataProto.from_dict(tensors={"obs": torch.zeros(4, 2)}, num_batch_dims=2)


def test_sample_level_repeat():
    data = _proto()
    out = data.sample_level_repeat([3, 0, 2])
    assert out.batch["obs"].tolist() == [[0, 1]] * 3 + [[4, 5]] * 2
    assert out.non_tensor_batch["labels"].tolist() == ["a", "a", "a", "c", "c"] and out.meta_info == {"info": "x"}
    assert data.sample_level_repeat(torch.tensor([1, 2, 1])).non_tensor_batch["labels"].tolist() == ["a", "b", "b", "c"]
    with pytest.raises(ValueError, match="one count per row"):
        data.sample_level_repeat([1, 2])


def test_unfold_column_chunks():
    data = DataProto.from_dict(
        tensors={"obs1": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "obs2": torch.tensor([[1, 2], [5, 6]])},
        non_tensors={"labels": [["a1", "a2"], ["b1", "b2"]], "uid": ["u0", "u1"]},
        meta_info={"name": "abc"},
    )
    out = data.unfold_column_chunks(2, split_keys=["obs1", "labels"])
    assert out.batch["obs1"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["obs2"].tolist() == [[1, 2], [1, 2], [5, 6], [5, 6]]
    assert out.non_tensor_batch["labels"].tolist() == [["a1"], ["a2"], ["b1"], ["b2"]]
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1"] and out.meta_info == {"name": "abc"}
    with pytest.raises(ValueError, match="must divide into 3 chunks"):
        data.unfold_column_chunks(3, split_keys=["obs1"])


def test_unfold_column_chunks_of_equal_length_lists_gives_upstreams_2d_column():
    # upstream's from_dict turns [[a1, a2], ...] into a [B, 2] object array, so its unfolded column is
    # [B * 2, 1]; ours keeps one list per row but unfolds to the same 2-D result.
    data = DataProto.from_dict(
        tensors={"obs": torch.arange(3)},
        non_tensors={"labels": [["a1", "a2", "a3", "a4"], ["b1", "b2", "b3", "b4"], ["c1", "c2", "c3", "c4"]]},
    )
    assert data.non_tensor_batch["labels"].shape == (3,)
    labels = data.unfold_column_chunks(2, split_keys=["labels"]).non_tensor_batch["labels"]
    assert labels.shape == (6, 2) and labels.dtype == object
    assert labels.tolist() == [["a1", "a2"], ["a3", "a4"], ["b1", "b2"], ["b3", "b4"], ["c1", "c2"], ["c3", "c4"]]
    assert bool((labels == [["a1", "a2"], ["a3", "a4"], ["b1", "b2"], ["b3", "b4"], ["c1", "c2"], ["c3", "c4"]]).all())


def test_unfold_column_chunks_keeps_list_elements_and_ragged_rows_as_lists():
    nested = DataProto.from_dict(non_tensors={"turns": [[[1], [2, 3]], [[4], []]]})
    turns = nested.unfold_column_chunks(2, split_keys=["turns"]).non_tensor_batch["turns"]
    assert turns.shape == (4, 1) and turns[:, 0].tolist() == [[1], [2, 3], [4], []]
    ragged = DataProto.from_dict(non_tensors={"turns": [["a", "b", "c", "d"], ["e", "f"]]})
    out = ragged.unfold_column_chunks(2, split_keys=["turns"]).non_tensor_batch["turns"]
    assert out.shape == (4,) and out.tolist() == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    with pytest.raises(ValueError, match=r"'abcd'\) is not a sequence that splits into 2"):
        DataProto.from_dict(non_tensors={"s": ["abcd", "efgh"]}).unfold_column_chunks(2, split_keys=["s"])
    with pytest.raises(ValueError, match="splits into 2 chunks"):
        DataProto.from_dict(non_tensors={"t": [[1, 2, 3], [4]]}).unfold_column_chunks(2, split_keys=["t"])


def test_refusals_are_value_errors_and_upstreams_assertion_errors():
    assert issubclass(DataProtoError, ValueError) and issubclass(DataProtoError, AssertionError)
    data = _proto(6)
    refusals = [
        lambda: data.chunk(5),
        lambda: DataProto.from_dict(tensors={"obs": torch.zeros(4, 2)}, num_batch_dims=2),
        lambda: _proto(3).union(DataProto.from_dict(tensors={"obs": torch.ones(3, 2, dtype=torch.long)})),
        lambda: _proto(3).union(DataProto.from_dict(non_tensors={"labels": ["x", "y", "z"]})),
        lambda: DataProto.concat([_proto(2), DataProto.from_dict(tensors={"obs": torch.zeros(1, 2)}, meta_info={})]),
        lambda: data.make_iterator(mini_batch_size=4, epochs=1),
        lambda: fold_batch_dim(data, 4),
    ]
    for refuse in refusals:
        with pytest.raises(AssertionError):
            refuse()
        with pytest.raises(DataProtoError):
            refuse()


def test_concat_with_conflicting_meta_info_names_upstreams_phrase():
    left = DataProto.from_dict(tensors={"obs": torch.tensor([1, 2])}, meta_info={"config": "A", "metrics": {"m": 1}})
    right = DataProto.from_dict(tensors={"obs": torch.tensor([3])}, meta_info={"config": "B", "metrics": {"m": 2}})
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config'"):
        DataProto.concat([left, right])
    right.meta_info["config"] = "A"
    assert DataProto.concat([left, right]).meta_info == {"config": "A", "metrics": {"m": [1, 2]}}


def test_union_numpy_dict_takes_upstreams_argument_names_and_compares_cycles():
    first = {"a": np.array([1.0, np.nan])}
    out = union_numpy_dict(tensor_dict1=first, tensor_dict2={"a": np.array([1.0, np.nan]), "b": np.array([2])})
    assert out is first and sorted(out) == ["a", "b"]
    with pytest.raises(AssertionError, match="`a` in tensor_dict1 and tensor_dict2 are not the same object"):
        union_numpy_dict({"a": np.array([1.0, 2.0])}, {"a": np.array([1.0, 3.0])})

    def cycle():
        arr = np.empty(1, dtype=object)
        arr[0] = arr
        return arr

    union_numpy_dict({"c": cycle()}, {"c": cycle()})  # two identical cycles are equal (no RecursionError)
    with pytest.raises(DataProtoError, match="'c'"):
        union_numpy_dict({"c": cycle()}, {"c": np.array([None], dtype=object)})
    looped = [1]
    looped.append(looped)  # [1, [1, [1, ...]]]
    unrolled = [1, [1, [2]]]  # equal to looped for two levels, then not
    left, right = np.empty(1, dtype=object), np.empty(1, dtype=object)
    left[0], right[0] = looped, unrolled
    with pytest.raises(DataProtoError, match="'d'"):
        union_numpy_dict({"d": left}, {"d": right})


def test_to_and_from_tensordict_round_trip():
    from verl.utils import tensordict_utils as tu

    data = DataProto.from_dict(
        tensors={"obs": torch.arange(6).reshape(3, 2)},
        non_tensors={"turns": [[], [0.5], {"k": 1}]},
        meta_info={"temperature": 0.7},
    )
    td = data.to_tensordict()
    assert torch.equal(td["obs"], data.batch["obs"])
    assert tu.get(td, "turns") == [[], [0.5], {"k": 1}] and tu.get(td, "temperature") == 0.7
    back = DataProto.from_tensordict(td)
    assert torch.equal(back.batch["obs"], data.batch["obs"])
    assert back.non_tensor_batch["turns"].tolist() == [[], [0.5], {"k": 1}] and back.meta_info == {"temperature": 0.7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_serialize_single_tensor_round_trip(dtype):
    tensor = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    view = tensor[:, 1:3]  # a non-contiguous view: exactly its own elements are written
    dtype_name, shape, data = serialize_single_tensor(view)
    assert dtype_name == str(dtype).removeprefix("torch.") and shape == (3, 2)
    assert data.dtype == np.uint8 and data.size == 6 * view.element_size()
    out = deserialize_single_tensor((dtype_name, shape, bytes(data)))
    assert out.dtype == dtype and torch.equal(out, view)
    out.add_(1) if dtype != torch.bool else out.logical_not_()  # the result owns writable memory
    assert torch.equal(view, (torch.arange(12).reshape(3, 4) % 3).to(dtype)[:, 1:3])


def test_serialize_tensordict_round_trip_with_nested_rows():
    nested = torch.nested.as_nested_tensor([torch.arange(2.0), torch.arange(3.0)], layout=torch.jagged)
    td = TensorDict({"x": torch.ones(2, 3), "seq": nested}, batch_size=[2])
    batch_size, device, items = serialize_tensordict(td)
    assert batch_size == (2,) and device is None and items["seq"][0] == "jagged"
    back = deserialize_tensordict((batch_size, device, items))
    assert torch.equal(back["x"], td["x"]) and [r.tolist() for r in back["seq"].unbind()] == [[0, 1], [0, 1, 2]]


def test_fold_and_unfold_batch_dim():
    data = _proto().repeat(2, interleave=True)
    folded = fold_batch_dim(data, new_batch_size=3)
    assert folded.batch["obs"].tolist() == [[[0, 1], [0, 1]], [[2, 3], [2, 3]], [[4, 5], [4, 5]]]
    assert folded.non_tensor_batch["labels"].tolist() == [["a", "a"], ["b", "b"], ["c", "c"]]
    folded.reorder(torch.tensor([1, 2, 0]))
    flat = unfold_batch_dim(folded, batch_dims=2)
    assert flat.batch["obs"].tolist() == [[2, 3], [2, 3], [4, 5], [4, 5], [0, 1], [0, 1]]
    assert flat.non_tensor_batch["labels"].tolist() == ["b", "b", "c", "c", "a", "a"] and flat.meta_info == {
        "info": "x"
    }
    with pytest.raises(ValueError, match="do not fold into 4 rows"):
        fold_batch_dim(data, new_batch_size=4)


def _gather_uneven_rows(rank: int, world_size: int) -> None:
    from verl.protocol import all_gather_data_proto

    rows = 3 if rank == 0 else 2
    data = DataProto.from_dict(
        tensors={
            "x": torch.tensor([[rank * 10.0 + i, -1.0] for i in range(rows)]),
            "ids": torch.arange(rows, dtype=torch.int64) + 100 * rank,
        },
        non_tensors={"uid": np.array([f"r{rank}-{i}" for i in range(rows)], dtype=object)},
        meta_info={"mine": rank},
    )
    assert all_gather_data_proto(data, None) is None  # in place, as upstream
    assert len(data) == 5 and data.meta_info == {"mine": rank}
    assert data.batch["x"].tolist() == [[0.0, -1.0], [1.0, -1.0], [2.0, -1.0], [10.0, -1.0], [11.0, -1.0]]
    assert data.batch["ids"].tolist() == [0, 1, 2, 100, 101] and data.batch["ids"].dtype == torch.int64
    assert list(data.non_tensor_batch["uid"]) == ["r0-0", "r0-1", "r0-2", "r1-0", "r1-1"]

    odd = DataProto.from_dict(tensors={"x": torch.zeros(1, 2)} if rank == 0 else {"y": torch.zeros(1, 2)})
    with pytest.raises(DataProtoError, match="every rank must hold the same columns"):
        all_gather_data_proto(odd, None)


def test_all_gather_data_proto_joins_every_ranks_rows_in_rank_order_in_place():
    from tests.distributed_helpers import run_distributed

    run_distributed(_gather_uneven_rows, 2)
