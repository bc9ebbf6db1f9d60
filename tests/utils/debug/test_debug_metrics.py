"""verl.utils.debug.metrics: rollout-vs-actor probability gaps against a numpy float64 reference."""

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.utils.debug.metrics import calculate_debug_metrics, calculate_token_list_diff


def test_calculate_debug_metrics_matches_numpy_on_valid_tokens():
    rng = np.random.default_rng(1)
    actor = np.log(rng.uniform(0.05, 0.95, size=(3, 4)))
    rollout = actor + rng.normal(0, 0.05, size=(3, 4))
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    prompt_mask = np.ones((3, 2), dtype=np.int64)
    data = DataProto.from_dict(
        tensors={
            "old_log_probs": torch.tensor(actor),
            "rollout_log_probs": torch.tensor(rollout),
            "responses": torch.zeros(3, 4, dtype=torch.long),
            "attention_mask": torch.tensor(np.concatenate([prompt_mask, mask], axis=1)),
        }
    )
    metrics = calculate_debug_metrics(data)
    valid = mask.astype(bool)
    pa, pr = np.exp(actor)[valid], np.exp(rollout)[valid]
    diff = np.abs(pa - pr)
    assert metrics["training/rollout_probs_diff_valid"] == 1
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(diff.max(), rel=1e-12)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(diff.mean(), rel=1e-12)
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(diff.std(ddof=1), rel=1e-12)
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(np.corrcoef(pa, pr)[0, 1], rel=1e-12)


def test_calculate_token_list_diff_counts_valid_mismatches_per_row():
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    b = torch.tensor([[1, 0, 0], [0, 5, 6]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert calculate_token_list_diff(a, b, mask).tolist() == [1, 1]
    with pytest.raises(ValueError, match="equal shapes"):
        calculate_token_list_diff(a, b[:, :2], mask)
