"""verl.utils.tensordict_utils: mixed tensor / jagged / non-tensor TensorDicts."""

import pytest
import torch
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack

from verl.utils import tensordict_utils as tu


def _jagged(rows):
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.float32) for r in rows], layout=torch.jagged)


def _sample():
    return tu.get_tensordict(
        {
            "obs": torch.arange(8).reshape(4, 2),
            "seq": _jagged([[1], [2, 3], [4, 5, 6], [7]]),
            "turn_scores": [[], [0.5], [0.9, 0.1], [1.0]],
        },
        {"experiment": "run1"},
    )


def test_get_tensordict_kinds_and_python_accessors():
    td = _sample()
    assert td.batch_size == torch.Size([4])
    assert isinstance(td.get("turn_scores"), NonTensorStack) and isinstance(td.get("experiment"), NonTensorData)
    assert tu.get(td, "turn_scores") == [[], [0.5], [0.9, 0.1], [1.0]]
    assert tu.get(td, "experiment") == "run1" and tu.get(td, "missing", 7) == 7
    assert tu.get_non_tensor_data(td, "experiment", None) == "run1"
    with pytest.raises(ValueError, match="'b' has 3 rows but earlier values have 2"):
        tu.get_tensordict({"a": torch.zeros(2), "b": [1, 2, 3]})
    with pytest.raises(TypeError, match="holds tensors"):
        tu.get_tensordict({"a": [torch.zeros(1)]})
    assert tu.get_tensordict({}, {"k": 1}).batch_size == torch.Size([])


def test_index_select_gathers_every_kind_and_keeps_metadata():
    td = tu.index_select_tensor_dict(_sample(), [3, 1])
    assert torch.equal(td["obs"], torch.tensor([[6, 7], [2, 3]]))
    assert [r.tolist() for r in td["seq"].unbind()] == [[7.0], [2.0, 3.0]]
    assert tu.get(td, "turn_scores") == [[1.0], [0.5]]
    assert tu.get(td, "experiment") == "run1"
    assert tu.index_select_tensor_dict(None, [0]) is None


def test_chunk_and_concat_round_trip_including_jagged_rows():
    td = _sample()
    parts = tu.chunk_tensordict(td, 2)
    assert [len(p) for p in parts] == [2, 2]
    assert [r.tolist() for r in parts[1]["seq"].unbind()] == [[4.0, 5.0, 6.0], [7.0]]
    back = tu.concat_tensordict(parts)
    assert torch.equal(back["obs"], td["obs"])
    assert [r.tolist() for r in back["seq"].unbind()] == [r.tolist() for r in td["seq"].unbind()]
    assert tu.get(back, "turn_scores") == tu.get(td, "turn_scores")
    with pytest.raises(ValueError, match="do not split into 3"):
        tu.chunk_tensordict(td, 3)


def test_chunk_splits_3d_jagged_tensors_row_by_row():
    rows = [torch.arange(3 * n, dtype=torch.float32).reshape(3, n) for n in (2, 4, 1, 3)]
    pos = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    td = TensorDict({"position_ids": pos, "x": torch.arange(4)}, batch_size=[4])
    parts = tu.chunk_tensordict(td, 2)
    got = [r for p in parts for r in p["position_ids"].unbind()]
    assert all(torch.equal(a, b) for a, b in zip(got, rows))


def test_row_selections_keep_m_rope_positions_ragged_in_their_last_dimension():
    """[B, 3, j] rows, the selected ones of equal length: still [b, 3, j], each row as it was."""
    from verl.utils.seqlen_balancing import restore_dynamic_batch

    rows = [torch.arange(3 * n).reshape(3, n) + 100 * i for i, n in enumerate((2, 4, 2, 2))]
    pos = tu.jagged_from_rows(rows, ragged_idx=2)
    td = TensorDict({"position_ids": pos, "x": torch.arange(4)}, batch_size=[4])
    for picked in ([0, 2], [3], [0, 2, 3]):
        got = tu.index_select_tensor_dict(td, picked)["position_ids"]
        assert got.shape[1] == 3 and [r.tolist() for r in got.unbind()] == [rows[i].tolist() for i in picked]
    parts = tu.chunk_tensordict(TensorDict({"p": tu.jagged_from_rows([rows[0], rows[2]], 2)}, batch_size=[2]), 2)
    assert [p["p"].shape[1] for p in parts] == [3, 3]
    assert torch.equal(parts[1]["p"].unbind()[0], rows[2])
    joined = tu.concat_nested_tensors([parts[0]["p"], parts[1]["p"]])
    assert joined.shape[1] == 3 and [r.tolist() for r in joined.unbind()] == [rows[0].tolist(), rows[2].tolist()]
    back = restore_dynamic_batch(tu.jagged_from_rows([rows[2], rows[0]], 2), [[1, 0]])
    assert back.shape[1] == 3 and [r.tolist() for r in back.unbind()] == [rows[0].tolist(), rows[2].tolist()]


def test_union_pop_keys_and_equality():
    td = _sample()
    tu.union_tensor_dict(td, tu.get_tensordict({"obs": torch.arange(8).reshape(4, 2), "new": torch.ones(4)}))
    assert torch.equal(td["new"], torch.ones(4))
    with pytest.raises(ValueError, match="'obs' exists in both"):
        tu.union_tensor_dict(td, tu.get_tensordict({"obs": torch.zeros(4, 2)}))
    popped = tu.pop_keys(td, ["new", "experiment"])
    assert not {"new", "experiment"} & set(td.keys())
    assert torch.equal(popped["new"], torch.ones(4)) and tu.get(popped, "experiment") == "run1"
    assert tu.pop(td, "turn_scores") == [[], [0.5], [0.9, 0.1], [1.0]] and tu.pop(td, "turn_scores", "gone") == "gone"
    kept = tu.get_keys(td, ["obs"])
    tu.assert_tensordict_eq(kept, tu.get_tensordict({"obs": torch.arange(8).reshape(4, 2)}))
    with pytest.raises(AssertionError, match="'obs' differs"):
        tu.assert_tensordict_eq(kept, tu.get_tensordict({"obs": torch.zeros(4, 2, dtype=torch.long)}))
    with pytest.raises(KeyError, match="'nope'"):
        tu.get_keys(td, ["nope"])


def test_refusals_are_value_errors_and_upstreams_assertion_errors():
    assert issubclass(tu.TensorDictError, ValueError) and issubclass(tu.TensorDictError, AssertionError)
    td = _sample()
    with pytest.raises(AssertionError, match="obs in tensor_dict1 and tensor_dict2 are not the same object"):
        tu.union_tensor_dict(td, tu.get_tensordict({"obs": torch.zeros(4, 2, dtype=torch.long)}))
    with pytest.raises(AssertionError, match="do not split into 3"):
        tu.chunk_tensordict(td, 3)
    with pytest.raises(tu.TensorDictError, match="'b' has 3 rows"):
        tu.get_tensordict({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_concat_keeps_the_first_parts_batch_wide_value_and_leaves_the_parts_unchanged():
    parts = [
        tu.get_tensordict({"x": torch.tensor([1, 2]), "s": ["a", "b"]}, {"temp": 1.0, "name": "run"}),
        tu.get_tensordict({"x": torch.tensor([3]), "s": ["c"]}, {"temp": 2.0, "name": "run"}),
        tu.get_tensordict({"x": torch.tensor([4]), "s": ["d"]}, {"temp": 3.0, "name": "run"}),
    ]
    out = tu.concat_tensordict(parts)
    assert out["x"].tolist() == [1, 2, 3, 4] and tu.get(out, "s") == ["a", "b", "c", "d"]
    assert isinstance(out.get("temp"), NonTensorData) and out["temp"] == 1.0 and out["name"] == "run"
    assert [p["temp"] for p in parts] == [1.0, 2.0, 3.0] and [len(p) for p in parts] == [2, 1, 1]
    jagged = [
        tu.get_tensordict({"seq": _jagged([[1], [2, 3]])}, {"temp": 0.5}),
        tu.get_tensordict({"seq": _jagged([[4, 5, 6]])}, {"temp": 0.7}),
    ]
    out = tu.concat_tensordict(jagged)
    assert [r.tolist() for r in out["seq"].unbind()] == [[1.0], [2.0, 3.0], [4.0, 5.0, 6.0]] and out["temp"] == 0.5


def test_pad_to_divisor_cycles_first_rows_and_unpad_restores():
    td = tu.get_tensordict({"x": torch.arange(3), "s": ["a", "b", "c"]})
    padded, pad = tu.pad_to_divisor(td, 4)
    assert pad == 1 and padded["x"].tolist() == [0, 1, 2, 0] and tu.get(padded, "s") == ["a", "b", "c", "a"]
    padded8, pad8 = tu.pad_to_divisor(td, 8)
    assert pad8 == 5 and padded8["x"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert tu.unpad(padded8, pad8)["x"].tolist() == [0, 1, 2]
    assert tu.pad_to_divisor(td, 3) == (td, 0)


def test_make_iterator_matches_a_seeded_dataloader_order():
    td = tu.get_tensordict({"x": torch.arange(8)})
    batches = list(tu.make_iterator(td, mini_batch_size=4, epochs=2, seed=3, dataloader_kwargs={"shuffle": True}))
    generator = torch.Generator().manual_seed(3)
    expected = []
    loader = torch.utils.data.DataLoader(torch.arange(8), batch_size=4, shuffle=True, generator=generator)
    for _ in range(2):
        expected.extend(b.tolist() for b in loader)
    assert [b["x"].tolist() for b in batches] == expected
    assert sorted(sum(expected[:2], [])) == list(range(8))


def test_assign_non_tensor_and_contiguous():
    td = TensorDict({"x": torch.arange(6).reshape(2, 3).t().contiguous().t()}, batch_size=[2])
    tu.assign_non_tensor(td, note="hi", per_row=[{"a": 1}, {"a": 2}])
    assert tu.get(td, "note") == "hi" and tu.get(td, "per_row") == [{"a": 1}, {"a": 2}]
    out = tu.contiguous(td)
    assert out["x"].is_contiguous() and torch.equal(out["x"], td["x"]) and tu.get(out, "note") == "hi"
