"""DAPO's overlong reward shaping and dynamic-sampling group filter, by hand-worked examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.trainer.ppo.core_algos import compute_overlong_penalty, filter_groups_by_metric_variance


def test_overlong_penalty_is_zero_before_the_buffer_and_ramps_linearly_to_minus_factor_at_the_limit():
    lengths = torch.tensor([5, 16, 17, 18, 20])
    penalty = compute_overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    half = compute_overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))


@pytest.mark.parametrize("buffer_len", [0, 21])
def test_overlong_buffer_longer_than_the_response_or_empty_is_an_error(buffer_len):
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        compute_overlong_penalty(
            torch.tensor([3]), max_response_length=20, overlong_buffer_len=buffer_len, penalty_factor=1
        )


def test_filter_groups_drops_groups_whose_metric_is_constant_and_keeps_singletons():
    uids = np.array(["a", "a", "b", "b", "b", "c", "d", "d"], dtype=object)
    acc = [1, 0, 1, 1, 1, 0, 0, 0]
    keep, kept = filter_groups_by_metric_variance(acc, uids)
    assert kept == ["a", "c"]
    assert keep.tolist() == [True, True, False, False, False, True, False, False]
    keep_t, kept_t = filter_groups_by_metric_variance(torch.tensor(acc, dtype=torch.float32), uids)
    assert kept_t == kept and keep_t.tolist() == keep.tolist()


def test_filter_groups_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one per response"):
        filter_groups_by_metric_variance([1, 0], np.array(["a"], dtype=object))
