"""The DataProto API added for upstream parity: padding, auto-padding, per-row repeats, column
unfolding, TensorDict conversion, (de)serialisation helpers and batch folding."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import (
    DataProto,
    DataProtoConfig,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
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
