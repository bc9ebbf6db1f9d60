"""One helper for the benchmarks' `--profile`: run a callable once under torch.profiler and print
where the time goes (top kernels by self time on the device, the device's busy fraction of the
wall time, and the number of kernel launches), compact enough to read from a remote log."""

from __future__ import annotations

import time

import torch


def print_profile(fn, on_cuda: bool, rows: int = 25, shapes: bool = True) -> None:
    from torch.profiler import ProfilerActivity, profile

    from verl.utils.device import synchronize

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    synchronize()
    with profile(activities=activities, record_shapes=shapes) as prof:
        start = time.perf_counter()
        fn()
        synchronize()
        wall = time.perf_counter() - start
    sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70))
    if shapes:  # the same ops split by input shape: which tensors the time goes to
        table = prof.key_averages(group_by_input_shape=True).table(
            sort_by=sort, row_limit=rows, max_name_column_width=40, max_shapes_column_width=90
        )
        print(table)
    if on_cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e6  # us -> s (overlapping streams counted twice)
        print(
            f"profile: wall {wall * 1e3:.1f} ms, device busy {busy * 1e3:.1f} ms ({100 * busy / wall:.0f}%), {len(kernels)} kernels"
        )
    else:
        print(f"profile: wall {wall * 1e3:.1f} ms")
