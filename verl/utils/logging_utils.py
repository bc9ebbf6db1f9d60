"""Per-rank logging: every record carries the process's rank so interleaved worker output reads."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s [%(rank_tag)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK")
        role = os.environ.get("VERL_ROLE")
        tag = "driver" if rank is None else f"rank {rank}"
        record.rank_tag = f"{role} {tag}" if role else tag
        return True


def get_logger(name: str, level: str | int | None = None) -> logging.Logger:
    """A logger whose lines start with the role and rank (`[actor_rollout rank 1]`).

    Level: `level`, else the `VERL_LOGGING_LEVEL` environment variable, else WARNING.
    """
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
        logger.addFilter(_RankFilter())
        logger.propagate = False
    logger.setLevel(level or os.environ.get("VERL_LOGGING_LEVEL", "WARNING"))
    return logger
