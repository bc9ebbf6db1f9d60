"""Driver metrics under upstream names, checked on a hand-built batch."""

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.metric_utils import (
    _compute_response_info,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    compute_variance_proxy_metrics,
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
    # bootstrap over 1000 resamples of 2: p0 = [1, 0] has E[max] = 1 - 1/4, E[min] = 1/4; p1 = [0, 0] gives 0
    tolerance = 4 * (0.75 * 0.25 / 1000) ** 0.5  # four standard errors of the resampled mean
    assert nested["a"]["acc"]["best@2/mean"] == pytest.approx(0.75 / 2, abs=tolerance / 2)
    assert nested["a"]["acc"]["worst@2/mean"] == pytest.approx(0.25 / 2, abs=tolerance / 2)
    # majority of two draws from p0: (5,5) -> 1, (6,6) -> 0, ties go to the first vote drawn -> E = 1/2
    assert nested["a"]["acc"]["maj@2/mean"] == pytest.approx(0.5 / 2, abs=tolerance / 2)
    assert "pred" not in nested["a"]
    flat = flatten_validation_metrics(nested)
    assert flat["val-core/a/acc/mean@2"] == pytest.approx(0.25)
    assert flat["val-core/b/acc/mean@2"] == pytest.approx(1.0)
    assert "val-aux/a/acc/std@2" in flat and "val-core/a/acc/best@2/std" in flat


def test_single_samples_report_only_the_mean():
    nested = process_validation_metrics(np.array(["s", "s"]), np.array(["u0", "u1"]), {"acc": [1.0, 0.0]})
    assert nested == {"s": {"acc": {"mean@1": 0.5}}}


def test_bootstrap_metric_estimates_the_expected_best_of_n():
    from verl.trainer.ppo.metric_utils import bootstrap_metric

    data = [0.1, 0.4, 0.4, 0.9, 0.2]
    ordered = sorted(data)
    n, size = len(data), 3
    # E[max of 3 draws with replacement] = sum_k v_(k) [(k/n)^3 - ((k-1)/n)^3]
    expected_max = sum(v * ((k / n) ** size - ((k - 1) / n) ** size) for k, v in enumerate(ordered, start=1))
    [(mean, std)] = bootstrap_metric(data, size, [np.max], n_bootstrap=20000, seed=1)
    assert mean == pytest.approx(expected_max, abs=4 * std / 20000**0.5)
    again = bootstrap_metric(data, size, [np.max, np.min], n_bootstrap=500, seed=7)
    assert again == bootstrap_metric(data, size, [np.max, np.min], n_bootstrap=500, seed=7)
    assert again != bootstrap_metric(data, size, [np.max, np.min], n_bootstrap=500, seed=8)
    slow = bootstrap_metric(data, size, [lambda x: float(np.max(x))], n_bootstrap=500, seed=7)
    assert slow[0] == pytest.approx(again[0], rel=1e-12)  # the vectorised path draws the same resamples
    state = np.random.get_state()[1].copy()
    bootstrap_metric(data, 2, [np.mean], seed=3)
    assert np.array_equal(np.random.get_state()[1], state)  # the global generator is untouched


def test_calc_maj_val_and_seeded_validation():
    from verl.trainer.ppo.metric_utils import calc_maj_val

    votes = [{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "A", "val": 0.7}, {"pred": "B", "val": 0.1}]
    assert calc_maj_val(votes, vote_key="pred", val_key="val") == 0.9  # tie: the vote seen first
    assert calc_maj_val(votes[1:], vote_key="pred", val_key="val") == 0.8
    sources, uids = np.array(["s"] * 5), np.array(["u"] * 5)
    infos = {"acc": [1.0, 0.0, 1.0, 0.0, 0.0]}
    first = process_validation_metrics(sources, uids, infos, seed=1)
    assert first == process_validation_metrics(sources, uids, infos, seed=1)
    assert first != process_validation_metrics(sources, uids, infos, seed=2)
    assert sorted(first["s"]["acc"]) == sorted(
        ["mean@5", "std@5"] + [f"{k}@{n}/{s}" for k in ("best", "worst") for n in (2, 4, 5) for s in ("mean", "std")]
    )


def test_compute_throughout_metrics_reads_global_token_num():
    from verl.trainer.ppo.metric_utils import compute_throughout_metrics

    batch = _batch()
    timing = {"step": 2.0}
    assert compute_throughout_metrics(batch, timing, n_gpus=2) == compute_throughput_metrics(batch, timing, n_gpus=2)
    batch.meta_info["global_token_num"] = [5, 5, 6]
    out = compute_throughout_metrics(batch, timing, n_gpus=2)
    assert out == {"perf/total_num_tokens": 16, "perf/time_per_step": 2.0, "perf/throughput": 16 / 4.0}


def test_rows_with_an_empty_response_count_as_aborted_and_leave_the_score_statistics():
    two = _batch()
    tensors = {}
    # a third row cut by over-sampling: prompt kept, nothing generated, yet a score was computed
    for key, row in (
        ("responses", torch.zeros(4, dtype=torch.long)),
        ("attention_mask", torch.tensor([1, 1, 1, 0, 0, 0, 0])),
        ("response_mask", torch.zeros(4, dtype=torch.long)),
        ("token_level_scores", torch.tensor([0.0, 0.0, 0.0, -3.0])),
        ("token_level_rewards", torch.tensor([0.0, 0.0, 0.0, -3.0])),
        ("advantages", torch.zeros(4)),
        ("returns", torch.zeros(4)),
        ("values", torch.zeros(4)),
    ):
        tensors[key] = torch.cat([two.batch[key], row[None].to(two.batch[key].dtype)])
    m = compute_data_metrics(DataProto.from_dict(tensors=tensors), use_critic=True)
    assert m["critic/score/mean"] == pytest.approx(0.75) and m["critic/score/min"] == pytest.approx(0.5)
    assert m["critic/rewards/min"] == pytest.approx(-0.5)  # the aborted row's -3 is left out
    assert m["response/aborted_ratio"] == pytest.approx(1 / 3)
    assert m["response_length/mean"] == pytest.approx(2.0)  # (2 + 4 + 0) / 3: every row
    assert m["response_length_non_aborted/mean"] == pytest.approx(3.0)
    assert m["response_length_non_aborted/min"] == pytest.approx(2.0)
    assert m["response_length_non_aborted/clip_ratio"] == pytest.approx(0.5)


def test_a_batch_with_only_empty_responses_keeps_every_row_in_the_score_statistics():
    batch = _batch()
    batch.batch["response_mask"] = torch.zeros_like(batch.batch["response_mask"])
    m = compute_data_metrics(batch)
    assert m["response/aborted_ratio"] == 1.0 and m["critic/score/mean"] == pytest.approx(0.75)
    assert m["response_length_non_aborted/mean"] == 0.0


def test_response_info_splits_the_attention_mask_at_the_response():
    info = _compute_response_info(_batch())
    assert info["prompt_length"].tolist() == [2.0, 3.0] and info["response_length"].tolist() == [3.0, 4.0]
    assert info["response_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def _variance_batch(with_is_weights: bool) -> DataProto:
    # sequence 0: pi = .5, .25 (third token padding); sequence 1: pi = 1, .5, .5
    pi = torch.tensor([[0.5, 0.25, 0.9], [1.0, 0.5, 0.5]], dtype=torch.float64)
    tensors = {
        "old_log_probs": pi.log(),
        "sum_pi_squared": torch.tensor([[0.5, 0.25, 0.3], [1.0, 0.5, 0.25]], dtype=torch.float64),
        "advantages": torch.tensor([[2.0, 2.0, 99.0], [-1.0, -1.0, -1.0]], dtype=torch.float64),
        "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
    }
    if with_is_weights:
        tensors["rollout_is_weights"] = torch.tensor([[2.0, 1.0, 5.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    return DataProto.from_dict(tensors=tensors)


def test_variance_proxies_match_hand_worked_values():
    # W = sum_t (1 - 2 pi_t + sum pi^2): 0.5 + 0.75 = 1.25 and 0 + 0.5 + 0.25 = 0.75; A = 2 and -1
    m = compute_variance_proxy_metrics(_variance_batch(False), gradient_norm=0.5)
    assert m["variance_proxy/proxy1_signal_strength"] == pytest.approx(0.25)
    assert m["variance_proxy/proxy2_total_power"] == pytest.approx((4 * 1.25 + 1 * 0.75) / 2)  # 2.875
    assert m["variance_proxy/proxy3_pure_noise"] == pytest.approx(2.875 - 0.25)  # / (N - 1) = 1
    assert m["variance_proxy/expected_a_squared"] == pytest.approx(2.5)
    assert m["variance_proxy/expected_w"] == pytest.approx(1.0)


def test_variance_proxies_with_importance_weights_and_without_a_gradient_norm():
    # token terms scaled by rho^2: W = 0.5 * 4 + 0.75 = 2.75 and 0.75; mean rho = 1.5 and 1
    m = compute_variance_proxy_metrics(_variance_batch(True))
    assert m["variance_proxy/proxy2_total_power"] == pytest.approx((2.25 * 4 * 1.25 + 1 * 1 * 0.75) / 2)  # 6.0
    assert m["variance_proxy/expected_w"] == pytest.approx((2.75 + 0.75) / 2)
    assert m["variance_proxy/proxy1_signal_strength"] == 0.0 and m["variance_proxy/proxy3_pure_noise"] == 0.0


def test_variance_proxies_need_sum_pi_squared():
    assert compute_variance_proxy_metrics(_batch(), gradient_norm=1.0) == {}
