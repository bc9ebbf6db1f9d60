"""Phase timing for the driver's step: `with marked_timer("gen", timing_raw): ...` adds seconds."""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def marked_timer(name: str, timing_raw: dict[str, float]):
    """Accumulate the wall-clock seconds of the block into `timing_raw[name]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - start
