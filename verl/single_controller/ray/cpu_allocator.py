"""glibc malloc settings for CPU workers: keep freed memory in the process instead of returning it.

Why: a CPU worker's step allocates and frees the same few-MB tensors every time (the rollout's KV
cache and weight copy, freed by `sleep()` and allocated again by the next `generate`; the update's
activations, logits and the flat gradient buffer). With glibc's defaults, blocks above its mmap
threshold get their own mapping and are unmapped when freed, and the heap top is trimmed when
more than the trim threshold is free. The next step then touches every page of them afresh: on
the 2-core Xeon VM a default-run worker took 1,600-2,900 minor page faults per step (each ~3 us
under load, zeroing included), against 4-441 (median ~140) with the settings below (issue #31; in
docs/benchmarks.md). The arithmetic is untouched; only where freed memory goes changes.

What: `MALLOC_MMAP_THRESHOLD_` (blocks below 256 MiB come from the heap), `MALLOC_TRIM_THRESHOLD_`
(never trim the heap top below 1 GiB free) and `MALLOC_TOP_PAD_` (grow the heap 64 MiB at a time),
all read by glibc when the process starts, so they go into the worker's environment at launch.
Setting any of them disables glibc's own adaptive threshold, so all three are set together.

Scope and limits, deliberately:
- CPU worker groups only (`use_gpu=False`). A GPU worker's host memory holds pinned buffers and
  offloaded states whose peaks a never-trimmed heap would keep; its step time is device time.
- The cost is memory: a worker keeps its peak heap (the bundled model: tens of MB). For a large
  model trained on CPU that peak is what the next step needs again anyway.
- A user's own `MALLOC_*` setting (in the driver's environment, `worker_env` or the class's
  `runtime_env`) wins: then none of ours is added. `VERL_CPU_MALLOC_TUNING=0` turns it off.
- Only glibc reads these variables; other C libraries (musl, macOS) ignore them harmlessly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

CPU_WORKER_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(256 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
    "MALLOC_TOP_PAD_": str(64 * 2**20),
}

TUNING_SWITCH = "VERL_CPU_MALLOC_TUNING"


def cpu_worker_malloc_env(use_gpu: bool, *user_envs: Mapping[str, str]) -> dict[str, str]:
    """The malloc variables to add to a worker's environment (empty when they do not apply).

    use_gpu: whether the worker group's pool has GPUs (then nothing is added, see the module docstring).
    user_envs: environments the user controls (the driver's, `worker_env`, the class's runtime_env
        env_vars); any `MALLOC_*` variable in one of them means the user chose, and nothing is added.
    """
    if use_gpu:
        return {}
    switch = os.environ.get(TUNING_SWITCH, "1").strip().lower()
    if switch in ("0", "false", "off", "no"):
        return {}
    if switch not in ("1", "true", "on", "yes"):
        raise ValueError(
            f"{TUNING_SWITCH}={os.environ[TUNING_SWITCH]!r} is not a switch; set it to 1 (CPU workers keep freed "
            "memory, fewer page faults per step) or 0 (glibc's defaults)"
        )
    for env in user_envs:
        chosen = sorted(k for k in env if k.startswith("MALLOC_"))
        if chosen:
            logger.info("CPU workers keep the user's malloc settings %s (verl adds none)", chosen)
            return {}
    return dict(CPU_WORKER_MALLOC_ENV)
