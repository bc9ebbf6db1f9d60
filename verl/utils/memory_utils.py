"""Device memory housekeeping under upstream's names (`verl.utils.memory_utils`).

Every function is a no-op (or returns an empty answer) without a usable CUDA device, as upstream's
are on a machine without an accelerator, so code that calls them runs unchanged on CPU. The memory
history recorder and the snapshot dumper are torch's CUDA allocator tools (`torch.cuda.memory`);
the profiler's `torch_memory` tool (`verl.utils.profiler`) drives the same recorder from config.

Left out on purpose: upstream's NPU paths (this build has no NPU support) and the fallbacks for
torch versions older than this build requires (its `_record_memory_history` keyword probing).
"""

from __future__ import annotations

import gc
import logging
import os
from datetime import datetime
from pathlib import Path

from verl.utils.device import get_torch_device, is_cuda_available

__all__ = [
    "MemorySnapshotSampler",
    "aggressive_empty_cache",
    "enable_memory_visualize",
    "get_memory_info",
    "log_memory_usage",
    "optimize_memory_for_inference",
    "optimize_memory_for_training",
    "reset_memory_stats",
]

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

_GIB = 1024**3


def aggressive_empty_cache(force_sync: bool = True, max_retries: int = 3) -> None:
    """Collect garbage and return the caching allocator's unused blocks to the driver, repeated (up
    to `max_retries` times) while a round frees at least 1 GiB of reserved memory; `force_sync`
    synchronises the device after each round so pending frees land first."""
    if not is_cuda_available():
        return
    device = get_torch_device()
    for attempt in range(max_retries):
        reserved, allocated = device.memory_reserved(), device.memory_allocated()
        gc.collect()
        device.empty_cache()
        if force_sync:
            device.synchronize()
        freed_reserved = reserved - device.memory_reserved()
        freed_allocated = allocated - device.memory_allocated()
        logger.info(
            f"Memory cleanup attempt {attempt + 1}: Freed {freed_reserved / _GIB:.2f} GB reserved, "
            f"{freed_allocated / _GIB:.2f} GB allocated"
        )
        if freed_reserved < _GIB:
            break


def reset_memory_stats() -> None:
    """Reset the device's peak and accumulated allocator statistics."""
    if is_cuda_available():
        get_torch_device().reset_peak_memory_stats()
        get_torch_device().reset_accumulated_memory_stats()


def get_memory_info() -> dict[str, float]:
    """The current device's memory in GiB: total, reserved, allocated, cached (reserved - allocated),
    max allocated and max reserved; {} without CUDA."""
    if not is_cuda_available():
        return {}
    device = get_torch_device()
    reserved, allocated = device.memory_reserved(), device.memory_allocated()
    return {
        "total_memory_gb": device.get_device_properties(device.current_device()).total_memory / _GIB,
        "reserved_memory_gb": reserved / _GIB,
        "allocated_memory_gb": allocated / _GIB,
        "cached_memory_gb": (reserved - allocated) / _GIB,
        "max_memory_allocated_gb": device.max_memory_allocated() / _GIB,
        "max_memory_reserved_gb": device.max_memory_reserved() / _GIB,
    }


def log_memory_usage(stage: str = "current") -> None:
    """Log `get_memory_info` at INFO level, labelled with `stage`."""
    info = get_memory_info()
    if info:
        logger.info(
            f"Memory usage [{stage}]: Total: {info['total_memory_gb']:.2f} GB, "
            f"Allocated: {info['allocated_memory_gb']:.2f} GB, Reserved: {info['reserved_memory_gb']:.2f} GB, "
            f"Cached: {info['cached_memory_gb']:.2f} GB"
        )


def optimize_memory_for_inference() -> None:
    """Let this process use up to 95% of the device memory, then `aggressive_empty_cache`."""
    if is_cuda_available():
        get_torch_device().set_per_process_memory_fraction(0.95)
        aggressive_empty_cache(force_sync=True)


def optimize_memory_for_training() -> None:
    """Let this process use up to 90% of the device memory, then empty the cache (no sync)."""
    if is_cuda_available():
        get_torch_device().set_per_process_memory_fraction(0.9)
        aggressive_empty_cache(force_sync=False)


def enable_memory_visualize(
    trace_alloc_max_entries: int = 200_000,
    stack_depth: int = 32,
    context: str = "all",
    stacks: str = "all",
    devices=None,
    record_context: bool = True,
) -> None:
    """Start recording the CUDA allocator's history (for https://docs.pytorch.org/memory_viz), keeping
    the last `trace_alloc_max_entries` events with `context` ("alloc", "state" or "all") and `stacks`
    ("python" or "all") for `devices` (None: the current device; an index or a list). Call it on each
    rank before the large allocations. Without CUDA it logs a warning and returns. `stack_depth` and
    `record_context` are upstream's parameters for older torch versions; this torch records full
    stacks and always records context, so they have no effect."""
    if not is_cuda_available():
        logger.warning("[memory_visualize] Memory history recording is only available on CUDA devices")
        return
    record = get_torch_device().memory._record_memory_history
    for device in devices if isinstance(devices, list | tuple) else [devices]:
        record(enabled="all", context=context, stacks=stacks, max_entries=trace_alloc_max_entries, device=device)
    get_torch_device().reset_peak_memory_stats()
    get_torch_device().synchronize()


class MemorySnapshotSampler:
    """Dump the CUDA allocator's recorded history to pickle files (one per call and rank) for
    https://docs.pytorch.org/memory_viz; `enable_memory_visualize` must have started the recording."""

    def __init__(self, out_dir: str = "./mem_snapshots", tag: str = "periodic"):
        self.out_dir = out_dir
        self.tag = tag

    def dump_memory_snapshot(
        self, out_dir: str = "./mem_snapshots", tag: str = "snapshot", sub_dir: str | None = None
    ) -> str | None:
        """Write `<out_dir>/<sub_dir or YYYYmmdd-HHMM>/<tag>_rank<RANK>_pid<pid>.pickle`; returns the
        path, or None without CUDA (a warning) or when the dump fails (logged)."""
        if not is_cuda_available():
            logger.warning("[memory_visualize] is only available on CUDA devices.")
            return None
        folder = Path(out_dir) / (sub_dir if sub_dir is not None else datetime.now().strftime("%Y%m%d-%H%M"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{tag}_rank{os.environ.get('RANK', '0')}_pid{os.getpid()}.pickle"
        try:
            get_torch_device().synchronize()
            get_torch_device().memory._dump_snapshot(str(path))
        except Exception as e:  # a failed dump must not stop training
            logger.warning(f"[memory_visualize] dump to {path} failed: {e}")
            return None
        return str(path)
