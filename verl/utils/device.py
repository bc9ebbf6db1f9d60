"""The one place that knows which accelerator exists.

Every other module asks here for the device name, the torch.distributed backend, memory figures
and cache/synchronise calls, so CPU is a first-class device on the same code path as CUDA. A test
greps the package for hard-coded accelerator literals outside this module.

The device can be forced (config `trainer.device=cpu|cuda|auto`) with `set_device_preference`,
or through the `VERL_DEVICE` environment variable, which worker processes inherit.

Process groups: on CUDA the workers' torch.distributed group is created with one backend per
device type, `cpu:gloo,cuda:nccl` (`get_group_backend`), so the small host-side collectives the
trainer runs on CPU tensors (micro-batch counts of the token-budget split, checkpoint step counts,
the rollout engine's flags) work next to the NCCL collectives on device tensors. Code that runs a
host-side collective on a group it did not create asks `collective_device(group)` where its tensor
must live: a group may still be NCCL-only (one a user or a library built with `backend="nccl"`).

Compute dtype: `default_compute_dtype()` is bfloat16 on CUDA (what upstream verl computes in)
and float32 on CPU (bf16 matmuls are slow or emulated there, and the CPU tests compare against
float64 references). fp32 matmuls that remain on CUDA (an explicit fp32 config) run on the
tensor cores as TF32, set once per process in `set_device` (`enable_tf32`): without it an H100
runs them at about 1/15 of its bf16 rate.
"""

from __future__ import annotations

import contextlib
import os

import torch

_CUDA = "cuda"
ACCELERATOR_NAME = _CUDA  # the accelerator's name where config vocabularies use it (profiler contents)
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


def preference_uses_accelerator(preference: str) -> bool:
    """Whether `trainer.device=preference` runs on the accelerator on this machine: `cuda`, or `auto`
    with a CUDA device visible (the environment's `VERL_DEVICE` is not consulted: the preference is)."""
    if preference not in _VALID:
        raise ValueError(f"trainer.device={preference!r} is not one of {list(_VALID)}")
    return preference == _CUDA or (preference == "auto" and torch.cuda.is_available())


class _CudaAvailable:
    """Whether a CUDA device is usable (and not disabled with `VERL_DEVICE=cpu`), asked at each use.

    Upstream's `is_cuda_available` is a module-level bool (`if is_cuda_available:`) and ours was a
    function (`is_cuda_available()`); this object is both, so code written either way reads the same
    answer, and it follows `trainer.device` / `VERL_DEVICE` instead of freezing it at import."""

    def __call__(self) -> bool:
        if os.environ.get("VERL_DEVICE", "auto") == "cpu":
            return False
        return torch.cuda.is_available()

    def __bool__(self) -> bool:
        return self()

    def __repr__(self) -> str:
        return repr(self())


is_cuda_available = _CudaAvailable()


def get_device_name() -> str:
    """'cuda' when a CUDA device is usable (and not disabled), else 'cpu'."""
    return _CUDA if is_cuda_available() else "cpu"


def get_torch_device():
    """The torch device module (`torch.cuda`) or `torch.cpu` on CPU."""
    return getattr(torch, get_device_name())


_RAY_NOSET_VISIBLE = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def _ray_sets_no_visible_devices() -> bool:
    """Whether Ray leaves CUDA_VISIBLE_DEVICES alone (Ray's own reading of the variable: 1 or true)."""
    return os.environ.get(_RAY_NOSET_VISIBLE, "").strip().lower() in ("1", "true")


def local_device_index(
    local_rank: int, device_count: int, ray_gpu_ids: list | None = None, visible_devices: str | None = None
) -> int:
    """Which of the visible CUDA devices this process uses (pure: the inputs are read by `get_device_id`).

    Normally Ray (or torchrun with one device per process after `CUDA_VISIBLE_DEVICES`) makes the
    process's own GPU the only visible one, or LOCAL_RANK numbers the processes of a node: the
    index is `local_rank % device_count`. Under `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES` Ray
    leaves every GPU of the node visible, and LOCAL_RANK is the worker's bundle index, which need
    not be the GPU Ray reserved for it (two ranks could share one GPU). Then `ray_gpu_ids` (from
    `ray.get_gpu_ids()`) names the reserved GPU: an id of the node's devices, or one of the entries of
    `visible_devices` (the node's CUDA_VISIBLE_DEVICES when Ray was started with one), whose position
    is the torch index.
    """
    if not ray_gpu_ids:
        return local_rank % max(device_count, 1)
    gpu = str(ray_gpu_ids[0]).strip()
    visible = [d.strip() for d in (visible_devices or "").split(",") if d.strip()]
    if visible:
        if gpu not in visible:
            raise RuntimeError(
                f"Ray assigned GPU {gpu} to this worker, but CUDA_VISIBLE_DEVICES={visible_devices!r} does not list "
                f"it; with {_RAY_NOSET_VISIBLE} set, start Ray with the same CUDA_VISIBLE_DEVICES as the workers"
            )
        return visible.index(gpu)
    return int(gpu)


def get_device_id() -> int | str:
    """Local device index on CUDA (see `local_device_index`); "cpu" on CPU, as upstream's
    (`torch.cpu.current_device()`), so `tensor.to(get_device_id())` stays on the host there."""
    if not is_cuda_available():
        return "cpu"
    gpu_ids = None
    if _ray_sets_no_visible_devices():
        import ray

        if ray.is_initialized():
            gpu_ids = ray.get_gpu_ids()
    return local_device_index(
        int(os.environ.get("LOCAL_RANK", 0)),
        torch.cuda.device_count(),
        gpu_ids,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def get_device(index: int | None = None) -> torch.device:
    if not is_cuda_available():
        return torch.device("cpu")
    return torch.device(_CUDA, get_device_id() if index is None else index)


def get_dist_backend() -> str:
    """The one torch.distributed backend of this device: nccl on CUDA, gloo on CPU (for groups that
    carry tensors of one device only, e.g. a weight transfer)."""
    return "nccl" if is_cuda_available() else "gloo"


def group_backend(device_name: str) -> str:
    """The backend of a process group on `device_name`: gloo for CPU tensors plus NCCL for CUDA
    tensors on CUDA (see the module docstring), gloo alone on CPU."""
    return f"cpu:gloo,{_CUDA}:nccl" if device_name == _CUDA else "gloo"


def get_group_backend() -> str:
    """`group_backend` of this process's device: what the workers' process group is created with."""
    return group_backend(get_device_name())


def group_handles_cpu(backend: str) -> bool:
    """Whether a group created with `backend` (as `torch.distributed.get_backend` names it) runs
    collectives on CPU tensors: gloo or MPI, or a per-device spec with a `cpu:` entry."""
    spec = str(backend).lower().replace(" ", "")
    if ":" not in spec:
        return spec in ("gloo", "mpi")
    return any(part.split(":", 1)[0] == "cpu" for part in spec.split(","))


def collective_device(group=None) -> torch.device:
    """Where a small tensor must live for a collective over `group` (None: the default group): the
    CPU when the group has a CPU backend (no device round trip, no host sync), else this rank's
    device (an NCCL-only group)."""
    import torch.distributed as dist

    return torch.device("cpu") if group_handles_cpu(dist.get_backend(group)) else get_device()


def default_compute_dtype() -> torch.dtype:
    """bfloat16 on CUDA, float32 on CPU (see the module docstring)."""
    return torch.bfloat16 if is_cuda_available() else torch.float32


def enable_tf32() -> None:
    """Run float32 matmuls and convolutions on CUDA as TF32 (10-bit mantissa inputs, fp32 accumulation).

    Process-wide and CUDA-only: CPU matmuls keep full float32. torch >= 2.9 has the per-backend
    `fp32_precision` switches (the older `allow_tf32` flags warn there)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:  # older torch
        matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def synchronize() -> None:
    if is_cuda_available():
        torch.cuda.synchronize()


def new_stream(device: torch.device):
    """A fresh stream on accelerator `device` (one the default stream never implicitly waits for);
    None on CPU, where work is not queued."""
    if torch.device(device).type != _CUDA:
        return None
    return torch.cuda.Stream(device=device)


def stream_wait_current(stream) -> None:
    """Make `stream` wait for the work queued so far on this thread's current stream of its device
    (a no-op for None)."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))


def queued_work_done(device: torch.device | str) -> bool:
    """Whether everything this thread queued on its current stream of `device` has run (True on
    CPU, where nothing is queued). Polling this instead of synchronising lets a host thread give up
    at a deadline."""
    device = torch.device(device)
    if device.type != _CUDA:
        return True
    return torch.cuda.current_stream(device).query()


def on_stream(stream):
    """Context in which this thread queues its accelerator work on `stream` (nothing for None)."""
    import contextlib

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def empty_cache() -> None:
    if is_cuda_available():
        torch.cuda.empty_cache()


def set_device() -> None:
    """Bind this process to its local device and let fp32 matmuls use TF32 (no-op on CPU)."""
    if is_cuda_available():
        torch.cuda.set_device(get_device_id())
        enable_tf32()


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


# Ascend NPUs are not supported by this implementation: code written for upstream that branches on
# this flag takes its CUDA/CPU path here.
is_npu_available = False


def auto_set_device(config) -> None:
    """Settle `config.trainer.device` for this process and the workers it starts (upstream's hook,
    called by recipes' drivers before `ray.init`).

    Upstream switches the device to `npu` on Ascend machines; there are none here, so the configured
    value is kept and checked (`auto`, `cpu` or `cuda`; `cuda` without a CUDA device is an error that
    says so) and exported as `VERL_DEVICE`, which the workers inherit: `auto` then trains on the GPU
    when there is one, else on the CPU, as `main_ppo` does."""
    trainer = getattr(config, "trainer", None) if config is not None else None
    if trainer is None or "device" not in trainer:
        return
    set_device_preference(trainer.device)


def get_nccl_backend() -> str:
    """The collective backend for accelerator tensors (upstream's name): NCCL. CPU-only groups use
    gloo (`get_dist_backend`); the workers' own group mixes both (`get_group_backend`)."""
    return "nccl"


def get_visible_devices_keyword() -> str:
    """The environment variable that selects the visible accelerators of a process."""
    return "CUDA_VISIBLE_DEVICES"


def enable_full_determinism(seed: int) -> None:
    """Deterministic kernels and seeded random streams in this process (`fsdp_config.full_determinism`).

    torch.use_deterministic_algorithms (an op without a deterministic kernel then raises instead of
    silently varying), cuDNN without autotuning, cuBLAS with a fixed workspace, and `random`, NumPy
    and torch seeded with `seed`. Slower; for runs that must repeat bit for bit on the same hardware.
    """
    import os
    import random

    import numpy as np

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def is_torch_npu_available(check_device: bool = True) -> bool:
    """Upstream's Ascend NPU check: always False, this build has no NPU support."""
    return False


def get_resource_name() -> str:
    """The Ray resource a worker's bundle asks for: "GPU" when a CUDA device is usable, else "CPU"
    (upstream answers "NPU" there; CPU workers here take CPU bundles)."""
    return "GPU" if is_cuda_available() else "CPU"


def set_expandable_segments(enable: bool) -> None:
    """Turn the CUDA caching allocator's expandable segments on or off (fewer fragmentation OOMs
    when on); a no-op without CUDA, as upstream."""
    if is_cuda_available():
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{bool(enable)}")


def get_device_capability(device_id: int = 0) -> tuple[int | None, int | None]:
    """(major, minor) compute capability of CUDA device `device_id`; (None, None) without CUDA."""
    if not is_cuda_available():
        return None, None
    return torch.cuda.get_device_capability(device_id)
