"""Rank-aware printing and logging, with upstream's names and output formats.

- `concat_dict_to_str(d, step)`: `"step:<step> - key:value - ..."` over the numeric values, in order.
- `LocalLogger(print_to_console=True)`: `log(data, step)` prints that line (upstream's console tracker);
  `flush()` does nothing (the print flushes).
- `DecoratorLoggerBase(role, logger=None, level=DEBUG, rank=0, log_only_rank_0=True)`: `logging_function(s)`
  writes `"<role> <s>"` to `logger` at `level`, or prints it when there is no logger; only on rank 0 unless
  `log_only_rank_0=False`.
- `print_rank_0(msg)`, `print_with_rank(msg, rank, log_only_rank_0)` (`"[Rank r] msg"`),
  `print_with_rank_and_timer` (`"[YYYY-mm-dd HH:MM:SS] [Rank r] msg"`), `log_with_rank(msg, rank, logger,
  level=INFO, log_only_rank_0=False)`.
"""

from __future__ import annotations

import datetime
import logging
import numbers
import pprint


def concat_dict_to_str(dict: dict, step) -> str:
    parts = [f"step:{step}"]
    parts += [f"{key}:{pprint.pformat(value)}" for key, value in dict.items() if isinstance(value, numbers.Number)]
    return " - ".join(parts)


class LocalLogger:
    """Prints each step's numeric metrics on one line."""

    def __init__(self, print_to_console: bool = True):
        self.print_to_console = print_to_console

    def flush(self) -> None:
        """Nothing buffered: each line is printed and flushed as it is logged."""

    def log(self, data: dict, step) -> None:
        if self.print_to_console:
            print(concat_dict_to_str(data, step=step), flush=True)


class DecoratorLoggerBase:
    """The base of upstream's logging decorators (`GPUMemoryLogger`): where and on which rank a line goes."""

    def __init__(
        self,
        role: str,
        logger: logging.Logger | None = None,
        level=logging.DEBUG,
        rank: int = 0,
        log_only_rank_0: bool = True,
    ):
        self.role, self.logger, self.level = role, logger, level
        self.rank, self.log_only_rank_0 = rank, log_only_rank_0
        self.logging_function = self.log_by_print if logger is None else self.log_by_logging

    def _on_this_rank(self) -> bool:
        return not self.log_only_rank_0 or self.rank == 0

    def log_by_print(self, log_str: str) -> None:
        if self._on_this_rank():
            print(f"{self.role} {log_str}", flush=True)

    def log_by_logging(self, log_str: str) -> None:
        if self.logger is None:
            raise ValueError(f"{type(self).__name__}({self.role!r}) has no logger to log to")
        if self._on_this_rank():
            self.logger.log(self.level, f"{self.role} {log_str}")


def print_rank_0(message) -> None:
    """Print on rank 0 of the default process group (or always, without one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_with_rank(message: str, rank: int = 0, log_only_rank_0: bool = False) -> None:
    if not log_only_rank_0 or rank == 0:
        print(f"[Rank {rank}] {message}", flush=True)


def print_with_rank_and_timer(message: str, rank: int = 0, log_only_rank_0: bool = False) -> None:
    if not log_only_rank_0 or rank == 0:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp}] [Rank {rank}] {message}", flush=True)


def log_with_rank(message: str, rank, logger: logging.Logger, level=logging.INFO, log_only_rank_0: bool = False):
    if not log_only_rank_0 or rank == 0:
        logger.log(level, f"[Rank {rank}] {message}")
