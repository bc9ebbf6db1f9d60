"""Driver metrics under upstream names, checked on a hand-built batch."""

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    flatten_validation_metrics,
    process_validation_metrics,
)


def _batch():
    # 2 samples, prompt length 3 (left-padded), response length 4 (right-padded).
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    scores = torch.tensor([[0.0, 1.0, 0, 0], [0.0, 0.0, 0.0, 0.5]])
    return DataProto.from_dict(
        tensors={
            "responses": torch.zeros(2, 4, dtype=torch.long),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": scores - 0.25 * response_mask,
            "advantages": torch.tensor([[1.0, 3.0, 99.0, 99.0], [-1.0, -1.0, -1.0, -1.0]]),
            "returns": torch.tensor([[2.0, 2.0, 0, 0], [1.0, 1.0, 1.0, 1.0]]),
            "values": torch.tensor([[2.0, 2.0, 0, 0], [1.0, 1.0, 1.0, 1.0]]),
        }
    )


def test_data_metrics_match_hand_computed_values():
    m = compute_data_metrics(_batch(), use_critic=True)
    assert m["critic/score/mean"] == pytest.approx(0.75)
    assert m["critic/score/max"] == pytest.approx(1.0) and m["critic/score/min"] == pytest.approx(0.5)
    # rewards: 1 - 0.5 = 0.5 and 0.5 - 1.0 = -0.5
    assert m["critic/rewards/mean"] == pytest.approx(0.0)
    # advantages over the 6 valid tokens only (the 99s are padding)
    assert m["critic/advantages/mean"] == pytest.approx((1 + 3 - 4) / 6)
    assert m["critic/advantages/max"] == pytest.approx(3.0)
    assert m["critic/vf_explained_var"] == pytest.approx(1.0, abs=1e-4)  # values == returns
    assert m["response_length/mean"] == pytest.approx(3.0)
    assert m["response_length/clip_ratio"] == pytest.approx(0.5)  # one of two hit 4 tokens
    assert m["prompt_length/mean"] == pytest.approx(2.5)  # 2 and 3 valid prompt tokens
    assert m["prompt_length/clip_ratio"] == pytest.approx(0.5)


def test_timing_and_throughput_use_response_tokens_for_generation():
    batch = _batch()
    timing = {"gen": 0.6, "update_actor": 1.1, "step": 2.0}
    t = compute_timing_metrics(batch, timing)
    assert t["timing_s/gen"] == 0.6
    assert t["timing_per_token_ms/gen"] == pytest.approx(600 / 6)  # 6 response tokens
    assert t["timing_per_token_ms/update_actor"] == pytest.approx(1100 / 11)  # 5 prompt + 6 response
    assert "timing_per_token_ms/step" not in t
    p = compute_throughput_metrics(batch, timing, n_gpus=2)
    assert p["perf/total_num_tokens"] == 12
    assert p["perf/throughput"] == pytest.approx(12 / (2.0 * 2))


def test_validation_metrics_mean_best_worst_and_majority():
    sources = np.array(["a"] * 4 + ["b"] * 2, dtype=object)
    uids = np.array(["p0", "p0", "p1", "p1", "q0", "q0"], dtype=object)
    infos = {"acc": [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], "pred": ["5", "6", "7", "7", "1", "1"]}
    nested = process_validation_metrics(sources, uids, infos)
    assert nested["a"]["acc"]["mean@2"] == pytest.approx(0.25)
    assert nested["a"]["acc"]["best@2/mean"] == pytest.approx(0.5)
    assert nested["a"]["acc"]["worst@2/mean"] == pytest.approx(0.0)
    # p0 tie -> first prediction "5" (correct); p1 majority "7" (wrong)
    assert nested["a"]["acc"]["maj@2/mean"] == pytest.approx(0.5)
    flat = flatten_validation_metrics(nested)
    assert flat["val-core/a/acc/mean@2"] == pytest.approx(0.25)
    assert flat["val-core/b/acc/mean@2"] == pytest.approx(1.0)
    assert "val-aux/a/acc/std@2" in flat
