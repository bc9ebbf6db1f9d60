"""verl.utils.metric: reduction by name and by explicit aggregation."""

import pytest
import torch

from verl.utils.metric import AggregationType, Metric, reduce_metrics


def test_reduce_metrics_uses_max_min_or_mean_by_name():
    metrics = {"loss": [1.0, 2.0, 6.0], "grad_max": [1.0, 9.0, 3.0], "len_min": [4.0, 2.0, 8.0]}
    out = reduce_metrics(metrics)
    assert out is metrics  # in place, as upstream
    assert out == {"loss": 3.0, "grad_max": 9.0, "len_min": 2.0}


def test_metric_aggregation_overrides_the_name_rule():
    out = reduce_metrics({"max_reward_sum": Metric("sum", [1.0, 2.0, 4.5]), "x": Metric(AggregationType.MIN, 3)})
    assert out == {"max_reward_sum": 7.5, "x": 3.0}


def test_metric_accepts_scalar_tensors_and_merges_same_aggregation_only():
    m = Metric("mean", torch.tensor(2.0))
    m.append(torch.tensor([4.0]))
    m.append(Metric("mean", [6.0]))
    assert m.values == [2.0, 4.0, 6.0] and m.aggregate() == 4.0
    with pytest.raises(ValueError, match="sum metric into a mean"):
        m.extend(Metric("sum", [1.0]))
    with pytest.raises(ValueError, match="shape"):
        m.append(torch.ones(2))
    with pytest.raises(ValueError, match="unknown metric aggregation 'median'"):
        Metric("median")


def test_metric_chain_from_dict_and_init_list():
    chained = Metric.chain([Metric("max", [1, 5]), Metric("max", [3])])
    assert chained.aggregation is AggregationType.MAX and chained.aggregate() == 5.0
    assert Metric.chain([]).aggregation is AggregationType.MEAN
    per_key = Metric.from_dict({"a": 1.0, "b": 2.0}, aggregation="sum")
    assert {k: v.aggregate() for k, v in per_key.items()} == {"a": 1.0, "b": 2.0}
    empty = per_key["a"].init_list()
    assert empty.aggregation is AggregationType.SUM and empty.values == []
