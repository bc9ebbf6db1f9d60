"""verl.utils.as_torch_index / group_mean_std against hand-worked and float64 references."""

import numpy as np
import torch

from verl.utils import as_torch_index, group_mean_std


def test_as_torch_index_label_kinds():
    assert as_torch_index([3, 1, 3], device="cpu").tolist() == [3, 1, 3]
    assert as_torch_index(np.array([2.0000001, 0.0]), device="cpu").tolist() == [2, 0]
    assert as_torch_index(["10", "2"], device="cpu").tolist() == [10, 2]
    assert as_torch_index(["u-b", "u-a", "u-b"], device="cpu").tolist() == [1, 0, 1]
    assert as_torch_index(np.array(["x", 1, "x"], dtype=object), device="cpu").tolist() == [1, 0, 1]
    assert as_torch_index(torch.tensor([-5, 7, -5]), device="cpu").tolist() == [0, 1, 0]
    assert as_torch_index(torch.tensor([0.5, 1.5, 0.5]), device="cpu").tolist() == [0, 1, 0]
    assert as_torch_index(torch.tensor([4, 4]), device="cpu").dtype == torch.int64


def test_group_mean_std_matches_float64_reference():
    rng = np.random.default_rng(0)
    scores = rng.normal(1000.0, 1e-3, size=12)  # large, close scores: float32 sums would lose the variance
    groups = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
    mean, std, count = group_mean_std(torch.tensor(scores), torch.tensor(groups), eps=1e-12)
    for g in range(5):
        vals = scores[groups == g]
        assert count[g] == len(vals)
        if len(vals) == 1:  # a group of one: mean 0, std 1
            assert mean[g] == 0.0 and std[g] == 1.0
        else:
            np.testing.assert_allclose(mean[g].item(), vals.mean(), rtol=1e-7)
            np.testing.assert_allclose(std[g].item(), vals.std(ddof=1), rtol=1e-5)
    assert mean.dtype == std.dtype == count.dtype == torch.float32


def test_group_mean_std_floors_the_variance_at_eps():
    mean, std, _ = group_mean_std(torch.tensor([2.0, 2.0]), torch.tensor([0, 0]), eps=1e-6)
    assert mean.tolist() == [2.0] and abs(std.item() - 1e-3) < 1e-9
