"""get_dynamic_pipeline_shards against hand-worked splits."""

import pytest

from verl.model_merger.megatron_model_merger import get_dynamic_pipeline_shards


@pytest.mark.parametrize(
    "layers, stages, expected",
    [
        (4, 1, [4]),
        (5, 2, [2, 3]),
        (7, 3, [2, 3, 2]),  # middle 3: ends 4 -> 2 + 2
        (10, 4, [2, 3, 3, 2]),  # middle 3: ends 4 -> 2 + 2 (middle 4 would leave 1 + 1)
        (24, 5, [4, 5, 5, 5, 5]),  # middle 5: ends 9 -> 4 + 5
        (61, 8, [6, 8, 8, 8, 8, 8, 8, 7]),
        (3, 3, [1, 1, 1]),
    ],
)
def test_splits(layers, stages, expected):
    shards = get_dynamic_pipeline_shards(layers, stages)
    assert shards == expected and sum(shards) == layers


def test_invalid_requests():
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages"):
        get_dynamic_pipeline_shards(3, 4)
    with pytest.raises(ValueError, match="at least 1"):
        get_dynamic_pipeline_shards(3, 0)
