"""Which machine a figure comes from: CPU model, kernel ISA, usable cores, load.

The CPU model behind these machines changes between sessions (an AMD EPYC at ~130 fp32 GFLOP/s on
two threads, an Intel Xeon with AVX-512 at ~236), and a figure without its machine cannot be
compared with another. Every benchmark's last line therefore ends with the same fields:

    cpu=<model, spaces as underscores> isa=<torch's kernel ISA> cores=<usable cores>
    load1=<1-minute load average at the start>/<at the end>

`isa` is what PyTorch's CPU kernels dispatch to (`torch.backends.cpu.get_cpu_capability()`:
DEFAULT, AVX2, AVX512, ...), plus the `+bf16`/`+amx` extensions /proc/cpuinfo reports, since
those decide bf16 matmul speed. `cores` counts the cores this process may run on (its affinity
mask), not the host's. The load average is read twice because the figures of a benchmark that
shares the machine move with the load: a run whose end load is above its core count had company.
"""

from __future__ import annotations

import os
import platform


def _load1() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


# Read at import: a benchmark imports this module before it starts measuring.
_START_LOAD = _load1()


def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo, or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The first `model name` of /proc/cpuinfo (`platform.processor()` elsewhere)."""
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def kernel_isa() -> str:
    """PyTorch's dispatch ISA with the bf16/AMX extensions that change bf16 matmul speed."""
    try:
        import torch

        isa = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        isa = "unknown"
    flags = cpu_flags()
    extras = [name for name, flag in (("bf16", "avx512_bf16"), ("amx", "amx_tile")) if flag in flags]
    return "+".join([isa, *extras])


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def machine_fields() -> dict[str, str]:
    """The fields every headline ends with, as strings without spaces."""
    end_load = _load1()
    return {
        "cpu": cpu_model().replace(" ", "_"),
        "isa": kernel_isa(),
        "cores": str(usable_cores()),
        "load1": f"{_START_LOAD:.2f}/{end_load:.2f}",
    }


def bench_headline(name: str, fields: str) -> str:
    """`bench NAME: <fields> cpu=... isa=... cores=... load1=start/end`: a benchmark's last line."""
    machine = " ".join(f"{key}={value}" for key, value in machine_fields().items())
    return f"bench {name}: {fields} {machine}"
