"""Specification of verl.protocol: DataProto row operations, key operations, merging, padding,
persistence (pickle, disk, Ray object store) and DataProtoFuture over real Ray object refs.

Expected values are built by hand (explicit lists) or by an independent route (torch's own
DataLoader for the shuffled order, Python list arithmetic for repeat and padding).
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import (
    DataProto,
    DataProtoFuture,
    DataProtoItem,
    collate_fn,
    list_of_dict_to_dict_of_list,
    pad_dataproto_to_divisor,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_proto(n: int = 6, meta_info: dict | None = None) -> DataProto:
    """Row i holds obs=[i, 10i], mask=i%2, label=f"s{i}", info={"row": i}."""
    return DataProto.from_dict(
        tensors={
            "obs": torch.tensor([[i, 10 * i] for i in range(n)], dtype=torch.float32),
            "mask": torch.tensor([i % 2 for i in range(n)], dtype=torch.bool),
        },
        non_tensors={"label": [f"s{i}" for i in range(n)], "info": [{"row": i} for i in range(n)]},
        meta_info=meta_info if meta_info is not None else {"temperature": 1.0},
    )


def rows(proto: DataProto) -> list[int]:
    """The original row ids of a proto built by make_proto, read from all three places at once."""
    ids = [int(x) for x in proto.batch["obs"][:, 0].tolist()]
    assert [int(x) * 10 for x in ids] == [int(x) for x in proto.batch["obs"][:, 1].tolist()]
    assert proto.batch["mask"].tolist() == [i % 2 == 1 for i in ids]
    assert list(proto.non_tensor_batch["label"]) == [f"s{i}" for i in ids]
    assert [d["row"] for d in proto.non_tensor_batch["info"]] == ids
    return ids


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-CPU local Ray cluster for this module; reuses (and leaves running) one started elsewhere."""
    import ray

    # Remote functions below call this module's helpers; ship them by value, since Ray workers
    # cannot import a test module by name.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT}},
        )
    yield ray
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    if started_here:
        ray.shutdown()


# ---------------------------------------------------------------------------- construction


def test_from_dict_builds_tensordict_batch_and_one_dimensional_object_arrays():
    proto = DataProto.from_dict(
        tensors={"x": torch.zeros(3, 4)},
        non_tensors={"pairs": [[1, 2], [3, 4], [5, 6]], "name": ("a", "b", "c")},
        meta_info={"k": 1},
    )
    assert isinstance(proto.batch, TensorDict) and proto.batch.batch_size == torch.Size([3])
    # equal-length inner lists must not turn into a 2-D array: one entry per row
    assert proto.non_tensor_batch["pairs"].shape == (3,) and proto.non_tensor_batch["pairs"][1] == [3, 4]
    assert proto.non_tensor_batch["name"].dtype == object
    assert proto.meta_info == {"k": 1} and len(proto) == 3


def test_from_single_dict_splits_tensors_from_numpy_arrays():
    data = {"ids": torch.arange(4), "uid": np.array(["a", "b", "c", "d"], dtype=object), "score": np.arange(4.0)}
    proto = DataProto.from_single_dict(data, meta_info={"m": 2})
    assert list(proto.batch.keys()) == ["ids"]
    assert set(proto.non_tensor_batch) == {"uid", "score"}
    assert proto.non_tensor_batch["score"] is data["score"]
    assert proto.meta_info == {"m": 2}


def test_from_single_dict_rejects_scalars_and_points_to_meta_info():
    with pytest.raises(TypeError, match=r"'temperature' is a float.*meta_info"):
        DataProto.from_single_dict({"ids": torch.arange(2), "temperature": 0.7})


def test_from_dict_rejects_tensors_with_different_batch_sizes():
    with pytest.raises(ValueError, match=r"batch size.*'a': 2.*'b': 3"):
        DataProto.from_dict(tensors={"a": torch.zeros(2), "b": torch.zeros(3)})


def test_batch_none_is_allowed_for_non_tensor_only_protos():
    proto = DataProto.from_dict(non_tensors={"uid": ["a", "b", "c", "d"]}, meta_info={"x": 1})
    assert proto.batch is None and len(proto) == 4
    assert [list(c.non_tensor_batch["uid"]) for c in proto.chunk(2)] == [["a", "b"], ["c", "d"]]
    assert list(DataProto.concat(proto.chunk(2)).non_tensor_batch["uid"]) == ["a", "b", "c", "d"]
    assert list(proto.repeat(2).non_tensor_batch["uid"]) == ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert list(pickle.loads(pickle.dumps(proto)).non_tensor_batch["uid"]) == ["a", "b", "c", "d"]
    assert len(DataProto()) == 0


def test_check_consistency_names_the_keys_with_wrong_lengths():
    batch = TensorDict({"x": torch.zeros(4)}, batch_size=[4])
    with pytest.raises(ValueError, match=r"non_tensor_batch lengths \{'uid': 3\} differ from the batch size 4"):
        DataProto(batch=batch, non_tensor_batch={"uid": np.array(["a", "b", "c"], dtype=object)})
    with pytest.raises(ValueError, match=r"different lengths"):
        DataProto(non_tensor_batch={"a": np.zeros(2), "b": np.zeros(3)})


def test_check_consistency_rejects_lists_and_multi_dim_batches():
    with pytest.raises(TypeError, match=r"non_tensor_batch\['uid'\] is a list.*np.array"):
        DataProto(non_tensor_batch={"uid": ["a"]})
    with pytest.raises(ValueError, match=r"exactly one batch dimension"):
        DataProto(batch=TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3]))


def test_repr_lists_keys_shapes_dtypes_and_meta_keys():
    text = repr(make_proto(4, meta_info={"temperature": 1.0, "eos_token_id": 2}))
    assert "len=4" in text
    assert "obs: (4, 2) torch.float32" in text and "mask: (4,) torch.bool" in text
    assert "label: (4,) object" in text
    assert "['temperature', 'eos_token_id']" in text


# ---------------------------------------------------------------------------- indexing


def test_int_index_returns_a_data_proto_item_with_that_row():
    proto = make_proto(5)
    item = proto[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["obs"].tolist() == [2.0, 20.0] and item.batch.batch_size == torch.Size([])
    assert item.non_tensor_batch == {"label": "s2", "info": {"row": 2}}
    assert item.meta_info == {"temperature": 1.0}
    assert proto[-1].non_tensor_batch["label"] == "s4"
    assert proto[np.int64(1)].non_tensor_batch["label"] == "s1"
    with pytest.raises(IndexError, match="index 5 is out of range for a DataProto of length 5"):
        proto[5]
    assert [it.non_tensor_batch["label"] for it in proto] == ["s0", "s1", "s2", "s3", "s4"]


def test_slice_returns_views_with_step():
    proto = make_proto(6)
    assert rows(proto[1:5:2]) == [1, 3]
    assert rows(proto.slice(4)) == [4, 5]
    view = proto[0:2]
    view.batch["obs"][0, 0] = 100.0
    assert proto.batch["obs"][0, 0] == 100.0  # a slice shares storage with its parent


@pytest.mark.parametrize(
    "index",
    [[4, 0, 2], np.array([4, 0, 2]), torch.tensor([4, 0, 2]), torch.tensor([4, 0, 2], dtype=torch.int32)],
    ids=["list", "numpy", "tensor", "int32-tensor"],
)
def test_index_with_sequences_gathers_rows_in_order(index):
    proto = make_proto(6)
    assert rows(proto[index]) == [4, 0, 2]
    assert rows(proto.select_idxs(index)) == [4, 0, 2]


def test_boolean_mask_keeps_rows_where_true():
    proto = make_proto(6)
    mask = torch.tensor([True, False, False, True, True, False])
    assert rows(proto[mask]) == [0, 3, 4]
    assert rows(proto.select_idxs(mask.numpy())) == [0, 3, 4]
    assert rows(proto.select_idxs([False, True, False, False, False, True])) == [1, 5]
    with pytest.raises(IndexError, match="boolean mask of shape \\(3,\\) does not match the DataProto length 6"):
        proto[torch.tensor([True, False, True])]


def test_bad_index_type_is_a_type_error():
    with pytest.raises(TypeError, match="got str"):
        make_proto()["obs"]


def test_derived_protos_get_their_own_meta_info_dict():
    proto = make_proto(4)
    part = proto[:2]
    part.meta_info["extra"] = 1
    assert "extra" not in proto.meta_info


# ---------------------------------------------------------------------------- keys


def test_select_keeps_only_named_keys_and_shares_tensors():
    proto = make_proto(4, meta_info={"a": 1, "b": 2})
    sub = proto.select(batch_keys=["obs"], non_tensor_batch_keys=["label"], meta_info_keys=["b"])
    assert list(sub.batch.keys()) == ["obs"] and list(sub.non_tensor_batch) == ["label"] and sub.meta_info == {"b": 2}
    assert sub.batch["obs"].data_ptr() == proto.batch["obs"].data_ptr()
    everything = proto.select()
    assert set(everything.batch.keys()) == {"obs", "mask"} and set(everything.non_tensor_batch) == {"label", "info"}
    deep = proto.select(batch_keys=["obs"], deepcopy=True)
    deep.batch["obs"][0, 0] = -1.0
    assert proto.batch["obs"][0, 0] == 0.0


def test_missing_key_error_names_the_key_and_lists_available_keys():
    proto = make_proto(2)
    with pytest.raises(KeyError) as err:
        proto.select(batch_keys=["obs", "old_log_probs"])
    assert str(err.value) == "key 'old_log_probs' not found in DataProto.batch; available keys: ['mask', 'obs']"
    with pytest.raises(
        KeyError, match=r"'uid' not found in DataProto.non_tensor_batch; available keys: \['info', 'label'\]"
    ):
        proto.select(non_tensor_batch_keys=["uid"])
    with pytest.raises(KeyError, match=r"'eos' not found in DataProto.meta_info; available keys: \['temperature'\]"):
        proto.pop(meta_info_keys=["eos"])


def test_pop_removes_keys_and_returns_them():
    proto = make_proto(3, meta_info={"a": 1, "b": 2})
    popped = proto.pop(batch_keys=["obs"], non_tensor_batch_keys=["label"], meta_info_keys=["a"])
    assert list(popped.batch.keys()) == ["obs"] and popped.batch["obs"][:, 0].tolist() == [0.0, 1.0, 2.0]
    assert list(popped.non_tensor_batch["label"]) == ["s0", "s1", "s2"] and popped.meta_info == {"a": 1}
    assert list(proto.batch.keys()) == ["mask"] and list(proto.non_tensor_batch) == ["info"]
    assert proto.meta_info == {"b": 2}
    # a missing key fails before anything is removed
    with pytest.raises(KeyError):
        proto.pop(batch_keys=["mask", "nope"])
    assert list(proto.batch.keys()) == ["mask"]


def test_rename_renames_batch_and_non_tensor_keys():
    proto = make_proto(2)
    obs = proto.batch["obs"]
    assert proto.rename(old_keys=["obs", "label"], new_keys=["observation", "name"]) is proto
    assert set(proto.batch.keys()) == {"observation", "mask"} and proto.batch["observation"] is obs
    assert set(proto.non_tensor_batch) == {"name", "info"}
    proto.rename("mask", "valid")
    assert set(proto.batch.keys()) == {"observation", "valid"}
    with pytest.raises(KeyError, match="'missing' not found"):
        proto.rename("missing", "x")
    with pytest.raises(ValueError, match="1 old keys"):
        proto.rename(["valid"], ["a", "b"])


def test_union_adds_keys_from_the_other_proto():
    left = make_proto(3).select(batch_keys=["obs"], non_tensor_batch_keys=["label"])
    right = make_proto(3, meta_info={"temperature": 1.0, "eos": 2}).select(batch_keys=["obs", "mask"])
    out = left.union(right)
    assert out is left
    assert set(out.batch.keys()) == {"obs", "mask"} and set(out.non_tensor_batch) == {"label", "info"}
    assert out.meta_info == {"temperature": 1.0, "eos": 2}
    assert out.batch["mask"].tolist() == [False, True, False]


def test_union_with_conflicting_values_is_an_error_naming_the_key():
    base = make_proto(3)
    other = make_proto(3)
    other.batch["obs"] = other.batch["obs"] + 1
    with pytest.raises(ValueError, match=r"batch key 'obs' exists on both sides with different values"):
        make_proto(3).union(other)
    other = make_proto(3)
    other.non_tensor_batch["label"] = np.array(["x", "y", "z"], dtype=object)
    with pytest.raises(ValueError, match=r"non_tensor_batch key 'label'"):
        base.union(other)
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs"):
        make_proto(3).union(make_proto(3, meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="same length"):
        make_proto(3).union(make_proto(4))


def test_a_failed_union_leaves_the_proto_unchanged():
    proto = make_proto(3)
    other = make_proto(3, meta_info={"temperature": 0.5}).select(batch_keys=["obs"])
    other.batch["new"] = torch.ones(3)
    other.non_tensor_batch["extra"] = np.array([1, 2, 3], dtype=object)
    with pytest.raises(ValueError, match="temperature"):
        proto.union(other)
    assert set(proto.batch.keys()) == {"obs", "mask"} and set(proto.non_tensor_batch) == {"label", "info"}


def test_union_into_a_non_tensor_only_proto_takes_the_other_batch():
    proto = DataProto.from_dict(non_tensors={"uid": ["a", "b"]})
    proto.union(DataProto.from_dict(tensors={"x": torch.tensor([1, 2])}))
    assert proto.batch["x"].tolist() == [1, 2] and list(proto.non_tensor_batch["uid"]) == ["a", "b"]


def test_union_helpers_treat_nan_and_nested_values_as_equal_when_identical():
    a = {"v": np.array([float("nan"), {"k": [1, 2]}], dtype=object)}
    b = {"v": np.array([float("nan"), {"k": [1, 2]}], dtype=object), "w": np.arange(2)}
    assert set(union_numpy_dict(a, b)) == {"v", "w"}
    td1 = TensorDict({"x": torch.tensor([1.0, float("nan")])}, batch_size=[2])
    td2 = TensorDict({"x": torch.tensor([1.0, 2.0]), "y": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(ValueError, match="'x'"):
        union_tensor_dict(td1, td2)
    td3 = TensorDict({"x": torch.tensor([1.0, float("nan")]), "y": torch.zeros(2)}, batch_size=[2])
    assert set(union_tensor_dict(td1, td3).keys()) == {"x", "y"}


# ---------------------------------------------------------------------------- chunk / split / concat


def test_chunk_splits_exactly_into_views():
    proto = make_proto(6)
    chunks = proto.chunk(3)
    assert [rows(c) for c in chunks] == [[0, 1], [2, 3], [4, 5]]
    assert chunks[1].batch["obs"].data_ptr() == proto.batch["obs"][2:].data_ptr()
    assert all(c.meta_info == {"temperature": 1.0} for c in chunks)


def test_chunk_that_does_not_divide_names_the_fix():
    with pytest.raises(ValueError) as err:
        make_proto(5).chunk(2)
    message = str(err.value)
    assert "5 rows do not split evenly into 2 chunks" in message
    assert "pad_dataproto_to_divisor(data, 2)" in message and "unpad_dataproto" in message


def test_split_gives_fixed_size_parts_with_a_shorter_tail():
    assert [rows(p) for p in make_proto(7).split(3)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_concat_inverts_chunk():
    proto = make_proto(8)
    again = DataProto.concat(proto.chunk(4))
    assert rows(again) == list(range(8))
    assert again.meta_info == {"temperature": 1.0}
    assert again.non_tensor_batch["label"].dtype == object


def test_concat_merges_metrics_into_flat_lists_and_keeps_the_slowest_timing():
    parts = make_proto(4).chunk(2)
    parts[0].meta_info.update(metrics={"loss": [1.0, 2.0], "lr": 0.1}, timing={"gen": 3.0, "upd": 1.0})
    parts[1].meta_info.update(
        metrics=[{"loss": [3.0]}, {"loss": 4.0, "grad_norm": 9.0}], timing={"gen": 2.0, "upd": 5.0}
    )
    merged = DataProto.concat(parts).meta_info
    assert merged["metrics"] == {"loss": [1.0, 2.0, 3.0, 4.0], "lr": [0.1], "grad_norm": [9.0]}
    assert merged["timing"] == {"gen": 3.0, "upd": 5.0}
    assert merged["temperature"] == 1.0


def test_concat_unions_meta_info_and_rejects_conflicting_values():
    a, b = make_proto(4).chunk(2)
    b.meta_info["only_b"] = "x"
    assert DataProto.concat([a, b]).meta_info == {"temperature": 1.0, "only_b": "x"}
    b.meta_info["temperature"] = 0.5
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs between the parts \(1.0 vs 0.5\)"):
        DataProto.concat([a, b])


def test_concat_rejects_parts_with_different_keys():
    a, b = make_proto(4).chunk(2)
    b.pop(batch_keys=["mask"])
    with pytest.raises(ValueError, match=r"part 1 has batch keys \['obs'\].*missing in part 1: \['mask'\]"):
        DataProto.concat([a, b])
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])


# ---------------------------------------------------------------------------- repeat / reorder


def test_repeat_interleave_keeps_copies_of_a_row_adjacent():
    out = make_proto(3).repeat(repeat_times=2, interleave=True)
    assert rows(out) == [0, 0, 1, 1, 2, 2]
    assert out.batch["obs"].tolist() == [[0, 0], [0, 0], [1, 10], [1, 10], [2, 20], [2, 20]]
    assert list(out.non_tensor_batch["label"]) == ["s0", "s0", "s1", "s1", "s2", "s2"]


def test_repeat_without_interleave_tiles_the_whole_batch():
    out = make_proto(3).repeat(repeat_times=3, interleave=False)
    assert rows(out) == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert list(out.non_tensor_batch["label"]) == ["s0", "s1", "s2"] * 3
    assert out.meta_info == {"temperature": 1.0}


def test_reorder_permutes_in_place():
    proto = make_proto(4)
    assert proto.reorder(torch.tensor([3, 1, 0, 2])) is None
    assert rows(proto) == [3, 1, 0, 2]


# ---------------------------------------------------------------------------- make_iterator


def test_make_iterator_without_shuffle_walks_rows_in_order_each_epoch():
    proto = make_proto(6, meta_info={"temperature": 0.3})
    batches = list(proto.make_iterator(mini_batch_size=2, epochs=2))
    assert [rows(b) for b in batches] == [[0, 1], [2, 3], [4, 5]] * 2
    assert all(b.meta_info == {"temperature": 0.3} for b in batches)


def test_make_iterator_with_seed_is_deterministic_and_matches_torch_dataloader():
    proto = make_proto(8)
    kwargs = {"shuffle": True}
    first = [rows(b) for b in proto.make_iterator(mini_batch_size=4, epochs=3, seed=7, dataloader_kwargs=kwargs)]
    second = [rows(b) for b in proto.make_iterator(mini_batch_size=4, epochs=3, seed=7, dataloader_kwargs=kwargs)]
    other_seed = [rows(b) for b in proto.make_iterator(mini_batch_size=4, epochs=3, seed=8, dataloader_kwargs=kwargs)]
    assert first == second and first != other_seed
    epochs = [sorted(first[2 * e] + first[2 * e + 1]) for e in range(3)]
    assert epochs == [list(range(8))] * 3  # every epoch is a permutation of all rows
    assert first[0:2] != first[2:4]  # and epochs differ from each other

    reference = torch.utils.data.DataLoader(
        proto, batch_size=4, shuffle=True, collate_fn=collate_fn, generator=torch.Generator().manual_seed(7)
    )
    expected = [rows(b) for _ in range(3) for b in reference]
    assert first == expected


def test_make_iterator_drop_last_with_shuffle_matches_torch_dataloader():
    proto = make_proto(10)
    kwargs = {"shuffle": True, "drop_last": True}
    ours = [rows(b) for b in proto.make_iterator(mini_batch_size=4, epochs=2, seed=3, dataloader_kwargs=kwargs)]
    reference = torch.utils.data.DataLoader(
        proto, batch_size=4, collate_fn=collate_fn, generator=torch.Generator().manual_seed(3), **kwargs
    )
    assert ours == [rows(b) for _ in range(2) for b in reference]
    assert [len(b) for b in ours] == [4, 4, 4, 4]


def test_make_iterator_checks_divisibility_and_supported_kwargs():
    proto = make_proto(5)
    with pytest.raises(ValueError, match=r"5 rows are not divisible by mini_batch_size=2.*drop_last"):
        proto.make_iterator(mini_batch_size=2, epochs=1)
    kept = list(proto.make_iterator(mini_batch_size=2, epochs=1, dataloader_kwargs={"drop_last": True}))
    assert [rows(b) for b in kept] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"unsupported dataloader_kwargs \['num_workers'\]"):
        proto.make_iterator(mini_batch_size=1, epochs=1, dataloader_kwargs={"num_workers": 2})


def test_dataloader_over_a_proto_with_collate_fn_restores_mini_batches():
    proto = make_proto(4)
    loader = torch.utils.data.DataLoader(proto, batch_size=2, collate_fn=collate_fn)
    assert [rows(b) for b in loader] == [[0, 1], [2, 3]]


# ---------------------------------------------------------------------------- padding


@pytest.mark.parametrize("length,divisor", [(5, 2), (5, 4), (3, 8), (7, 3), (6, 3), (1, 5)])
def test_pad_then_unpad_restores_exactly(length, divisor):
    proto = make_proto(length)
    padded, pad_size = pad_dataproto_to_divisor(proto, divisor)
    expected_pad = (divisor - length % divisor) % divisor
    assert pad_size == expected_pad and len(padded) % divisor == 0
    # padding cycles through the rows from the start
    assert rows(padded) == [i % length for i in range(length + expected_pad)]
    restored = unpad_dataproto(padded, pad_size)
    assert rows(restored) == list(range(length))
    assert torch.equal(restored.batch["obs"], proto.batch["obs"])
    assert torch.equal(restored.batch["mask"], proto.batch["mask"])
    assert restored.meta_info == proto.meta_info


def test_padding_an_already_divisible_proto_is_a_no_op():
    proto = make_proto(4)
    padded, pad_size = pad_dataproto_to_divisor(proto, 2)
    assert padded is proto and pad_size == 0 and unpad_dataproto(padded, 0) is padded


def test_padded_proto_goes_through_chunk_and_concat():
    proto = make_proto(7)
    padded, pad_size = pad_dataproto_to_divisor(proto, 4)
    output = unpad_dataproto(DataProto.concat(padded.chunk(4)), pad_size)
    assert rows(output) == list(range(7))


# ---------------------------------------------------------------------------- persistence


def rich_proto() -> DataProto:
    gen = torch.Generator().manual_seed(0)
    batch = TensorDict(
        {
            "f32": torch.randn(6, 3, generator=gen),
            "bf16": torch.randn(6, 5, generator=gen).to(torch.bfloat16),
            "i64": torch.arange(12).reshape(6, 2),
            "flag": torch.tensor([True, False] * 3),
            "nested": TensorDict({"a": torch.randn(6, 2, 2, generator=gen)}, batch_size=[6]),
        },
        batch_size=[6],
    )
    non_tensor = {"uid": np.array([f"u{i}" for i in range(6)], dtype=object), "score": np.arange(6.0)}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info={"eos_token_id": 2, "metrics": {"x": [1]}})


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    keys_a = sorted(map(str, a.batch.keys(include_nested=True, leaves_only=True)))
    assert keys_a == sorted(map(str, b.batch.keys(include_nested=True, leaves_only=True)))
    for key, value in a.batch.items(include_nested=True, leaves_only=True):
        other = b.batch.get(key)
        assert other.dtype == value.dtype and other.shape == value.shape and torch.equal(other, value), key
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for key, value in a.non_tensor_batch.items():
        assert list(value) == list(b.non_tensor_batch[key]) and value.dtype == b.non_tensor_batch[key].dtype
    assert a.meta_info == b.meta_info


def test_pickle_round_trip_preserves_every_dtype_nested_key_and_meta_info():
    proto = rich_proto()
    again = pickle.loads(pickle.dumps(proto))
    assert_same(proto, again)
    again.batch["f32"].add_(1.0)  # unpickled tensors own writable memory
    assert not torch.equal(again.batch["f32"], proto.batch["f32"])


def test_pickling_a_chunk_ships_only_its_own_rows():
    proto = DataProto.from_dict(tensors={"x": torch.zeros(1024, 256)})  # 1 MiB
    whole = len(pickle.dumps(proto))
    quarter = len(pickle.dumps(proto.chunk(4)[3]))
    assert whole > 1024 * 256 * 4 and quarter < whole / 3.5
    assert torch.equal(pickle.loads(pickle.dumps(proto.chunk(4)[3])).batch["x"], proto.batch["x"][768:])


def test_pickle_round_trip_of_conjugate_views_and_non_tensor_leaves():
    conj = torch.tensor([[1 + 2j, 3 - 1j]]).repeat(3, 1).conj()
    again = pickle.loads(pickle.dumps(DataProto.from_dict(tensors={"c": conj})))
    assert torch.equal(again.batch["c"], conj.resolve_conj())
    batch = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    batch.set_non_tensor("tag", "hello")  # handled by tensordict's own pickling
    again = pickle.loads(pickle.dumps(DataProto(batch=batch)))
    assert again.batch.get_non_tensor("tag") == "hello" and again.batch["x"].tolist() == [0, 1, 2]


def test_pickle_round_trip_of_non_contiguous_tensors():
    base = torch.arange(24.0).reshape(4, 6)
    proto = DataProto.from_dict(tensors={"t": base[:, ::2], "tt": base.t().contiguous().t()})
    again = pickle.loads(pickle.dumps(proto))
    assert torch.equal(again.batch["t"], base[:, ::2]) and torch.equal(again.batch["tt"], base)


class TaggedProto(DataProto):
    """A user subclass; pickling must give it back as itself."""


def test_pickle_keeps_a_subclass_and_ships_tensor_bytes_out_of_band_with_protocol_5():
    proto = TaggedProto.from_dict(tensors={"x": torch.arange(4096.0).reshape(64, 64)}, meta_info={"k": 1})
    buffers = []
    payload = pickle.dumps(proto, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().nbytes == 64 * 64 * 4 and len(payload) < 1024
    again = pickle.loads(payload, buffers=buffers)
    assert type(again) is TaggedProto and again.meta_info == {"k": 1}
    assert torch.equal(again.batch["x"], proto.batch["x"])
    assert type(pickle.loads(pickle.dumps(proto, protocol=4))) is TaggedProto  # in band, as numpy arrays


def test_unpickled_tensors_copy_read_only_buffers_unless_the_caller_borrows_them():
    from verl.protocol import _borrow_buffers, _borrowing

    proto = DataProto.from_dict(tensors={"x": torch.arange(64.0).reshape(16, 4)})
    buffers = []
    payload = pickle.dumps(proto, protocol=5, buffer_callback=buffers.append)
    frozen = np.frombuffer(buffers[0], dtype=np.uint8).copy()
    frozen.flags.writeable = False  # like the views Ray hands out of its object store
    owned = pickle.loads(payload, buffers=[frozen])
    assert owned.batch["x"].data_ptr() != frozen.ctypes.data  # a writable copy
    with _borrow_buffers():
        borrowed = pickle.loads(payload, buffers=[frozen])
    assert not _borrowing.active
    assert borrowed.batch["x"].data_ptr() == frozen.ctypes.data  # no copy
    merged = DataProto.concat([borrowed, owned])  # what the worker group does with borrowed results
    assert merged.batch["x"].data_ptr() not in (frozen.ctypes.data, owned.batch["x"].data_ptr())
    assert torch.equal(merged.batch["x"], torch.cat([proto.batch["x"], proto.batch["x"]]))


def _bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that float8, complex and NaN payloads compare exactly."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(ints[tensor.element_size()])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int8,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
    ],
)
def test_concat_pad_and_gathers_copy_exactly_what_torch_would_for_any_dtype_and_strided_parts(dtype):
    base = torch.randn(10, 6, generator=torch.Generator().manual_seed(0)) * 4
    full = base > 0 if dtype == torch.bool else base.to(dtype)
    parts = [full[:3, ::2], full[3:, ::2].contiguous()]  # one strided part, one contiguous
    merged = DataProto.concat([DataProto.from_dict(tensors={"v": p}) for p in parts]).batch["v"]
    expected = full[:, ::2]
    assert merged.dtype == dtype and merged.shape == expected.shape
    assert torch.equal(_bits_of(merged), _bits_of(expected))
    proto = DataProto.from_dict(tensors={"v": full[:7]})
    idx = [6, -1, 0, 0, 3]
    assert torch.equal(_bits_of(proto.select_idxs(idx).batch["v"]), _bits_of(full[:7][torch.tensor(idx)]))
    padded, pad_size = pad_dataproto_to_divisor(proto, 4)
    assert pad_size == 1 and torch.equal(_bits_of(padded.batch["v"]), _bits_of(full[[0, 1, 2, 3, 4, 5, 6, 0]]))
    repeated = proto.repeat(2, interleave=True).batch["v"]
    assert torch.equal(_bits_of(repeated), _bits_of(full[:7].repeat_interleave(2, dim=0)))


def test_concat_and_gathers_keep_autograd_and_type_promotion_like_torch():
    weight = torch.randn(4, 3, requires_grad=True)
    merged = DataProto.concat([DataProto.from_dict(tensors={"w": weight}), DataProto.from_dict(tensors={"w": weight})])
    merged.batch["w"].sum().backward()
    assert torch.equal(weight.grad, torch.full((4, 3), 2.0))
    gathered = DataProto.from_dict(tensors={"w": weight}).select_idxs([1, 1]).batch["w"]
    assert gathered.requires_grad
    mixed = DataProto.concat(
        [
            DataProto.from_dict(tensors={"v": torch.tensor([1, 2])}),
            DataProto.from_dict(tensors={"v": torch.tensor([0.5])}),
        ]
    )
    assert mixed.batch["v"].dtype == torch.float32 and mixed.batch["v"].tolist() == [1.0, 2.0, 0.5]


def test_save_to_disk_and_load_from_disk_round_trip(tmp_path):
    proto = rich_proto()
    path = tmp_path / "proto.pkl"
    proto.save_to_disk(path)
    assert_same(proto, DataProto.load_from_disk(path))
    with open(tmp_path / "other.pkl", "wb") as f:
        pickle.dump({"not": "a proto"}, f)
    with pytest.raises(TypeError, match="not a DataProto"):
        DataProto.load_from_disk(tmp_path / "other.pkl")


def test_copy_is_shallow_and_deepcopy_is_independent():
    proto = make_proto(3)
    shallow = copy.copy(proto)
    assert shallow.batch["obs"] is proto.batch["obs"] and shallow.batch is not proto.batch
    deep = copy.deepcopy(proto)
    deep.batch["obs"][0, 0] = 42.0
    deep.non_tensor_batch["info"][0]["row"] = 42
    assert proto.batch["obs"][0, 0] == 0.0 and proto.non_tensor_batch["info"][0]["row"] == 0


def test_to_moves_tensors_in_place_and_returns_self():
    proto = make_proto(2)
    assert proto.to("cpu") is proto and proto.batch.device == torch.device("cpu")
    assert proto.batch["obs"].device.type == "cpu"


@pytest.mark.gpu
def test_accelerator_proto_indexes_on_device_and_unpickles_on_cpu():
    from verl.utils.device import get_device

    proto = make_proto(4).to(get_device())
    assert proto.batch["obs"].device.type == get_device().type
    picked = proto[[3, 1]]
    assert picked.batch["obs"].device.type == get_device().type and picked.batch["obs"][:, 0].tolist() == [3.0, 1.0]
    again = pickle.loads(pickle.dumps(proto.chunk(2)[1]))
    assert again.batch["obs"].device.type == "cpu" and rows(again) == [2, 3]


def test_list_of_dict_to_dict_of_list():
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3, "b": 4}]) == {"a": [1, 3], "b": [2, 4]}


def test_importing_protocol_does_not_import_ray():
    code = "import sys, verl.protocol; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------- Ray


def test_ray_put_get_round_trip_gives_writable_tensors(ray_cluster):
    ray = ray_cluster
    proto = rich_proto()
    again = ray.get(ray.put(proto))
    assert_same(proto, again)
    again.batch["f32"].mul_(0.0)  # memory from Ray's read-only store must have been copied
    assert again.batch["f32"].abs().sum() == 0 and proto.batch["f32"].abs().sum() > 0


class _Rank:
    """Stands for the ranks of a worker group, all in one Ray actor: one worker process imports
    torch and verl for the test, where a task per call could start a cold worker each (the session
    cluster has 8 CPUs, so Ray ran the 3 producers and 2 consumers in up to 5 fresh processes)."""

    def produce(self, start: int) -> DataProto:
        # runs in a Ray worker: each "rank" returns two rows with its own metrics
        part = make_proto(6)[start : start + 2]
        part.meta_info["metrics"] = {"rank_start": start}
        return part

    def consume(self, future: DataProtoFuture) -> list[int]:
        return rows(future.get())  # materialised on the worker, not on the driver

    def produce_tensordict(self, start: int) -> TensorDict:
        return TensorDict({"row": torch.arange(start, start + 2)}, batch_size=[2])


def test_data_proto_future_concat_and_chunk_over_real_refs(ray_cluster):
    ray = ray_cluster
    worker = ray.remote(_Rank).remote()  # ends with its last handle, at the end of the test
    produce, consume = worker.produce, worker.consume

    refs = [produce.remote(s) for s in (0, 2, 4)]
    future = DataProtoFuture.concat(refs)
    whole = future.get()
    assert rows(whole) == [0, 1, 2, 3, 4, 5] and whole.meta_info["metrics"] == {"rank_start": [0, 2, 4]}

    chunks = future.chunk(2)
    assert len(chunks) == 2 and all(c.futures is future.futures for c in chunks)
    assert [rows(c.get()) for c in chunks] == [[0, 1, 2], [3, 4, 5]]
    assert ray.get([consume.remote(c) for c in chunks]) == [[0, 1, 2], [3, 4, 5]]

    # chunking a chunk composes: chunk 1 of 3 -> rows [3, 4, 5] -> its 3 single-row pieces
    assert [rows(c.get()) for c in chunks[1].chunk(3)] == [[3], [4], [5]]


def test_data_proto_future_over_tensordict_results_concatenates_and_chunks_them(ray_cluster):
    worker = ray_cluster.remote(_Rank).remote()
    future = DataProtoFuture.concat([worker.produce_tensordict.remote(s) for s in (0, 2, 4)])
    whole = future.get()
    assert isinstance(whole, TensorDict) and whole["row"].tolist() == [0, 1, 2, 3, 4, 5]
    assert [c.get()["row"].tolist() for c in future.chunk(3)] == [[0, 1], [2, 3], [4, 5]]
    mixed = DataProtoFuture.concat([worker.produce.remote(0), worker.produce_tensordict.remote(2)])
    with pytest.raises(TypeError, match="all DataProtos or all TensorDicts"):
        mixed.get()


def test_data_proto_future_concat_rejects_values_that_are_not_refs(ray_cluster):
    with pytest.raises(TypeError, match="expects ray.ObjectRefs"):
        DataProtoFuture.concat([make_proto(2)])
