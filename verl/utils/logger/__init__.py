"""Upstream's small logging helpers (`verl.utils.logger`): rank-aware printing and logging, the console
logger of upstream's tracker, and the base of its logging decorators. See `aggregate_logger`."""

from verl.utils.logger.aggregate_logger import (
    DecoratorLoggerBase,
    LocalLogger,
    concat_dict_to_str,
    log_with_rank,
    print_rank_0,
    print_with_rank,
    print_with_rank_and_timer,
)

__all__ = [
    "DecoratorLoggerBase",
    "LocalLogger",
    "concat_dict_to_str",
    "log_with_rank",
    "print_rank_0",
    "print_with_rank",
    "print_with_rank_and_timer",
]
