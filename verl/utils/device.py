"""The one place that knows which accelerator exists.

Every other module asks here for the device name, the torch.distributed backend, memory figures
and cache/synchronise calls, so CPU is a first-class device on the same code path as CUDA. A test
greps the package for hard-coded accelerator literals outside this module.

The device can be forced (config `trainer.device=cpu|cuda|auto`) with `set_device_preference`,
or through the `VERL_DEVICE` environment variable, which worker processes inherit.
"""

from __future__ import annotations

import contextlib
import os

import torch

_CUDA = "cuda"
_VALID = ("auto", "cpu", _CUDA)


def set_device_preference(preference: str) -> None:
    """Force the device for this process and the workers it starts (`auto`, `cpu` or `cuda`)."""
    if preference not in _VALID:
        raise ValueError(
            f"trainer.device={preference!r} is not one of {list(_VALID)}; use 'auto' to pick CUDA when present"
        )
    if preference == _CUDA and not torch.cuda.is_available():
        raise RuntimeError(
            "trainer.device=cuda was requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
            "install a CUDA build of torch or set trainer.device=cpu"
        )
    os.environ["VERL_DEVICE"] = preference


def is_cuda_available() -> bool:
    pref = os.environ.get("VERL_DEVICE", "auto")
    if pref == "cpu":
        return False
    return torch.cuda.is_available()


def get_device_name() -> str:
    """'cuda' when a CUDA device is usable (and not disabled), else 'cpu'."""
    return _CUDA if is_cuda_available() else "cpu"


def get_torch_device():
    """The torch device module (`torch.cuda`) or `torch.cpu` on CPU."""
    return getattr(torch, get_device_name())


def get_device_id() -> int:
    """Local device index on CUDA (LOCAL_RANK modulo visible devices); 0 on CPU."""
    if not is_cuda_available():
        return 0
    return int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)


def get_device(index: int | None = None) -> torch.device:
    if not is_cuda_available():
        return torch.device("cpu")
    return torch.device(_CUDA, get_device_id() if index is None else index)


def get_dist_backend() -> str:
    """torch.distributed backend: nccl on CUDA, gloo on CPU."""
    return "nccl" if is_cuda_available() else "gloo"


def synchronize() -> None:
    if is_cuda_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if is_cuda_available():
        torch.cuda.empty_cache()


def set_device() -> None:
    """Bind this process to its local device (no-op on CPU)."""
    if is_cuda_available():
        torch.cuda.set_device(get_device_id())


def memory_stats() -> dict[str, float]:
    """Memory in GiB: device allocated/reserved/peak on CUDA; process RSS always."""
    gib = 1024**3
    stats: dict[str, float] = {}
    if is_cuda_available():
        stats["allocated_gb"] = torch.cuda.memory_allocated() / gib
        stats["reserved_gb"] = torch.cuda.memory_reserved() / gib
        stats["max_allocated_gb"] = torch.cuda.max_memory_allocated() / gib
    try:
        import psutil

        stats["cpu_rss_gb"] = psutil.Process().memory_info().rss / gib
    except ImportError:  # psutil is a dependency; tolerate odd environments
        pass
    return stats


def peak_flops_per_device(dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense peak FLOP/s of the local device for MFU, or None when unknown (CPU, unlisted GPU)."""
    if not is_cuda_available():
        return None
    name = torch.cuda.get_device_name()
    table = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}
    for key, flops in table.items():
        if key in name:
            return flops if dtype in (torch.bfloat16, torch.float16) else flops / 2
    return None


def has_fused_adamw(tensor: torch.Tensor) -> bool:
    """Whether torch's fused AdamW kernel runs on `tensor`: a floating-point tensor (or DTensor) on
    CPU or CUDA."""
    return tensor.is_floating_point() and tensor.device.type in ("cpu", "cuda")


def free_memory_bytes(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of `device` that new tensors of this process can use: the driver's free
    memory plus what torch's caching allocator holds unused (reusable without the driver); None on
    CPU, which has no such budget."""
    device = torch.device(device)
    if device.type != _CUDA:
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached, total


def is_cuda_device(device: torch.device | str) -> bool:
    """Whether `device` names a CUDA device (whether or not one is present here)."""
    return torch.device(device).type == _CUDA


def device_context(device: torch.device):
    """A context in which `device` is the current CUDA device (streams, graphs, memory pools and
    Triton launches are taken from the current device, which in a new thread is device 0); a no-op
    for other devices."""
    device = torch.device(device)
    if device.type == _CUDA:
        return torch.cuda.device(device)
    return contextlib.nullcontext()
