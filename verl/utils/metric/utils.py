"""Metric values and how lists of them are reduced to one number (upstream's `verl.utils.metric`).

- `reduce_metrics(metrics)`: each entry of a `{name: list of values}` dict becomes one number: the
  max of the list when the name contains "max", the min when it contains "min", else the mean. A
  `Metric` entry reduces with its own aggregation instead of guessing from the name.
- `Metric(aggregation, value=None)`: numbers collected with an explicit aggregation (mean, sum, min,
  max). Merging two metrics of different aggregations is an error: a sum and a mean of the same
  name cannot be combined into anything meaningful.

The reduction works in place on the dict it is given and returns it, as upstream's does (callers
rely on either form). Values must be numbers or one-element tensors; anything else is an error
naming the value's type.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import numpy as np
import torch

__all__ = ["AggregationType", "Metric", "reduce_metrics"]


class AggregationType(Enum):
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_NUMBER_TYPES = (int, float, np.integer, np.floating)


class Metric:
    """Numbers to be aggregated one way (`aggregation`: "mean", "sum", "min", "max" or an
    `AggregationType`); `value` is a first number or a list of numbers."""

    def __init__(self, aggregation: str | AggregationType, value=None) -> None:
        if isinstance(aggregation, str):
            try:
                aggregation = AggregationType(aggregation)
            except ValueError:
                raise ValueError(
                    f"unknown metric aggregation {aggregation!r}; use one of {[a.value for a in AggregationType]}"
                ) from None
        if not isinstance(aggregation, AggregationType):
            raise ValueError(f"metric aggregation must be a string or AggregationType, got {aggregation!r}")
        self.aggregation = aggregation
        self.values: list[float] = []
        if value is not None:
            if isinstance(value, (list, tuple)):
                self.extend(list(value))
            else:
                self.append(value)

    def append(self, value) -> None:
        """Add one number (a one-element tensor counts as a number), or all numbers of another Metric."""
        if isinstance(value, Metric):
            self.extend(value)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"a metric value must be a number; got a tensor of shape {tuple(value.shape)}")
            value = value.detach().item()
        if isinstance(value, bool) or not isinstance(value, _NUMBER_TYPES):
            raise ValueError(f"a metric value must be an int, float or one-element tensor, got {type(value).__name__}")
        self.values.append(value)

    def extend(self, values) -> None:
        """Add a list of numbers, or the numbers of a Metric with the same aggregation."""
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(
                    f"cannot merge a {values.aggregation.value} metric into a {self.aggregation.value} metric"
                )
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        if not self.values:
            raise ValueError(f"cannot aggregate an empty {self.aggregation.value} metric")
        reducer = {
            AggregationType.MEAN: np.mean,
            AggregationType.SUM: np.sum,
            AggregationType.MIN: np.min,
            AggregationType.MAX: np.max,
        }[self.aggregation]
        return float(reducer(self.values))

    @classmethod
    def chain(cls, metric_lists: list[Metric]) -> Metric:
        """One metric holding the numbers of all given metrics (which must share an aggregation);
        an empty list gives an empty mean metric."""
        if not metric_lists:
            return cls(aggregation=AggregationType.MEAN)
        chained = cls(aggregation=metric_lists[0].aggregation)
        for metric in metric_lists:
            chained.extend(metric)
        return chained

    @classmethod
    def from_dict(cls, data: dict[str, Any], aggregation: str | AggregationType) -> dict[str, Metric]:
        """{name: Metric(aggregation, value)} for each entry of `data`."""
        return {key: cls(aggregation=aggregation, value=value) for key, value in data.items()}

    def init_list(self) -> Metric:
        """An empty metric with this one's aggregation (what `append_to_dict` starts a new key with)."""
        return Metric(aggregation=self.aggregation)

    def __repr__(self) -> str:
        return f"Metric({self.aggregation.value}, {self.values})"


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Replace each list in `metrics` by one number (see the module docstring); returns the dict."""
    for key, value in metrics.items():
        if isinstance(value, Metric):
            metrics[key] = value.aggregate()
        elif "max" in key:
            metrics[key] = np.max(value)
        elif "min" in key:
            metrics[key] = np.min(value)
        else:
            metrics[key] = np.mean(value)
    return metrics
