"""Upstream's `verl.utils.logger` helpers: the lines they print or log, and on which rank."""

from __future__ import annotations

import logging
import re

import numpy as np

from verl.utils.logger import (
    DecoratorLoggerBase,
    LocalLogger,
    concat_dict_to_str,
    log_with_rank,
    print_rank_0,
    print_with_rank,
    print_with_rank_and_timer,
)


def test_local_logger_prints_the_numeric_metrics_of_a_step(capsys):
    assert concat_dict_to_str({"a": 1, "b": "x", "c": 0.5, "d": np.float64(2.0)}, step=3) == (
        "step:3 - a:1 - c:0.5 - d:np.float64(2.0)"
    )
    LocalLogger().log({"loss": 0.25, "note": "skip"}, step=7)
    LocalLogger(print_to_console=False).log({"loss": 1.0}, step=8)
    assert capsys.readouterr().out == "step:7 - loss:0.25\n"


def test_rank_prints_and_logs(capsys, caplog):
    print_rank_0("zero")
    print_with_rank("hello", rank=2)
    print_with_rank("quiet", rank=2, log_only_rank_0=True)
    print_with_rank_and_timer("timed", rank=0, log_only_rank_0=True)
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["zero", "[Rank 2] hello"]
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] \[Rank 0\] timed", out[2]) and len(out) == 3
    logger = logging.getLogger("verl.test.logger")
    with caplog.at_level(logging.INFO, logger="verl.test.logger"):
        log_with_rank("a", rank=1, logger=logger)
        log_with_rank("b", rank=1, logger=logger, log_only_rank_0=True)
    assert [r.getMessage() for r in caplog.records] == ["[Rank 1] a"]


def test_decorator_logger_base_routes_by_logger_and_rank(capsys, caplog):
    DecoratorLoggerBase("actor").logging_function("printed")
    DecoratorLoggerBase("actor", rank=1).logging_function("not on rank 1")
    DecoratorLoggerBase("actor", rank=1, log_only_rank_0=False).logging_function("rank 1 too")
    assert capsys.readouterr().out.splitlines() == ["actor printed", "actor rank 1 too"]
    logger = logging.getLogger("verl.test.decorator")
    with caplog.at_level(logging.DEBUG, logger="verl.test.decorator"):
        DecoratorLoggerBase("critic", logger=logger).logging_function("logged")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, "critic logged")]


def _timing_case(rank, world_size):
    import torch.distributed as dist

    from verl.utils.profiler.performance import gather_timing, reduce_timing, topk_reduce_ratio_min_max

    timing = {"b": 3.0 + 2 * rank, "a": 1.0 + 2 * rank}  # rank 0: a=1, b=3; rank 1: a=3, b=5
    assert reduce_timing(timing) == {"a": 2.0, "b": 4.0}
    assert reduce_timing(timing, dist.ReduceOp.MAX) == {"a": 3.0, "b": 5.0}
    assert gather_timing(timing) == {"a": [1.0, 3.0], "b": [3.0, 5.0]}
    # values 1 and 2: the 50th percentile is 1.5, so one of the two ranks is above it
    assert topk_reduce_ratio_min_max(1.0 + rank, k=50) == (0.5, 1.0, 2.0)


def test_upstreams_timing_reductions_over_two_ranks():
    from tests.distributed_helpers import run_distributed

    run_distributed(_timing_case, 2)


def test_timing_reductions_without_a_process_group_keep_the_local_values():
    from verl.utils.profiler.performance import gather_timing, reduce_timing, topk_reduce_ratio_min_max

    assert reduce_timing({"a": 1.5}) == {"a": 1.5}
    assert gather_timing({"a": 1.5}) == {"a": [1.5]}
    assert topk_reduce_ratio_min_max(2.0) == (-1.0, -1.0, -1.0)
