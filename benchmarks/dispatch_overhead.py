"""Round-trip cost of a DP_COMPUTE_PROTO call through a worker group, against raw Ray.

Two CPU workers echo their chunk back. `ms_1mb` / `ms_64mb` are the median milliseconds of one
`wg.echo(batch)` call (pad, chunk, ship, run, ship back, concat) for a DataProto of 1 MiB and
64 MiB of float32 tensors. The `raw_` figures send the same bytes as numpy halves straight to two
bare Ray actors and back, through Ray's own transport; ours sends large payloads through its
shared-memory channels (verl/single_controller/shm.py) and only the rest through Ray. The ratios
are ours over bare Ray. Goal: ms_1mb <= 5.

Every repetition runs each case once, in rotating order, so a load swing on a shared machine hits
them alike; the figures are medians over the repetitions.

The breakdown replays the stages of `WorkerGroup._call` one by one with timestamps (the worker
stamps its entry and exit into `meta_info["timing"]`; the clock is the machine's monotonic clock,
shared by all processes):

- dispatch: pad and chunk the DataProto (driver);
- submit: pickle each chunk and submit the actor calls (driver);
- to_worker: from the end of submit until the last worker starts the method (transfer, unpickle);
- back: from the last worker's return until `ray.get` returns (pickle, transfer, unpickle);
- collect: concatenate the results and drop the padding (driver).

The bare-Ray case splits into submit (pickle + submit) and wait (everything until `ray.get`
returns).

Run: python benchmarks/dispatch_overhead.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import ray
import torch

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RAY_SYSTEM_CONFIG, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.machine import bench_headline

ROW_FLOATS = 1024  # one row = 4 KiB


class EchoWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data):
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo_stamped(self, data):
        enter = time.perf_counter()
        data.meta_info["timing"] = {"enter": enter, "exit": time.perf_counter()}
        return data


@ray.remote(num_cpus=0)
class RawEcho:
    def echo(self, array):
        return array


def _ms(start: float, end: float) -> float:
    return (end - start) * 1e3


def _staged_call(wg: RayWorkerGroup, data: DataProto) -> dict[str, float]:
    """`wg.echo_stamped(data)`, stage by stage (the steps of WorkerGroup._call for a blocking
    DP_COMPUTE_PROTO call)."""
    from verl.protocol import _borrow_buffers

    mode = Dispatch.DP_COMPUTE_PROTO
    t0 = time.perf_counter()
    calls, pad_size = mode.dispatch(wg, (data,), {})
    t1 = time.perf_counter()
    lease: list = []
    refs = wg._submit("echo_stamped", calls, lease=lease, large_results=True)
    t2 = time.perf_counter()
    with _borrow_buffers():
        outputs = wg._wait(refs, ranks=list(range(wg.world_size)), role=wg.role, method="echo_stamped", lease=lease)
    t3 = time.perf_counter()
    out = mode.collect(wg, outputs, pad_size, futures=False)
    t4 = time.perf_counter()
    timing = out.meta_info["timing"]  # max over the ranks
    return {
        "total": _ms(t0, t4),
        "dispatch": _ms(t0, t1),
        "submit": _ms(t1, t2),
        "to_worker": _ms(t2, timing["enter"]),
        "back": _ms(timing["exit"], t3),
        "collect": _ms(t3, t4),
    }


def _raw_call(actors: list, halves: list[np.ndarray]) -> dict[str, float]:
    t0 = time.perf_counter()
    refs = [actor.echo.remote(half) for actor, half in zip(actors, halves)]
    t1 = time.perf_counter()
    ray.get(refs)
    t2 = time.perf_counter()
    return {"total": _ms(t0, t2), "submit": _ms(t0, t1), "wait": _ms(t1, t2)}


def _timed(fn: Callable[[], object]) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        start = time.perf_counter()
        fn()
        return {"total": _ms(start, time.perf_counter())}

    return run


def _interleaved_medians(cases: dict[str, Callable[[], dict[str, float]]], repeats: int) -> dict[str, dict]:
    """{case: {stage: median ms}}; each repetition runs every case once, the order rotating."""
    names = list(cases)
    for name in names:  # warm-up
        cases[name]()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            for stage, ms in cases[name]().items():
                samples[name].setdefault(stage, []).append(ms)
    return {name: {stage: statistics.median(v) for stage, v in stages.items()} for name, stages in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _system_config=RAY_SYSTEM_CONFIG,
        runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
    )
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker))
    raw = [RawEcho.remote() for _ in range(2)]

    results = {}
    breakdown = {}
    for label, mib, repeats in (("1mb", 1, args.repeats), ("64mb", 64, max(3, args.repeats // 6))):
        rows = mib * 1024 * 1024 // (ROW_FLOATS * 4)
        data = DataProto.from_dict(tensors={"x": torch.randn(rows, ROW_FLOATS)})
        out = wg.echo(data)
        assert torch.equal(out.batch["x"], data.batch["x"]), "echo changed the data"
        halves = np.array_split(np.random.rand(rows * ROW_FLOATS // 2).astype(np.float32).repeat(2), 2)
        medians = _interleaved_medians(
            {
                "ours": _timed(lambda data=data: wg.echo(data)),
                "raw": lambda halves=halves: _raw_call(raw, halves),
                "ours_staged": lambda data=data: _staged_call(wg, data),
            },
            repeats,
        )
        results[f"ms_{label}"] = medians["ours"]["total"]
        results[f"raw_ms_{label}"] = medians["raw"]["total"]
        results[f"ratio_{label}"] = results[f"ms_{label}"] / results[f"raw_ms_{label}"]
        breakdown[label] = medians
    ray.shutdown()

    for label, medians in breakdown.items():
        print(f"{label}: median ms per round trip, {label} payload")
        for name in ("ours", "ours_staged", "raw"):
            print(f"  {name:12s} " + " ".join(f"{stage}={ms:.2f}" for stage, ms in medians[name].items()))
    staged = breakdown["1mb"]["ours_staged"]
    for stage in ("dispatch", "submit", "to_worker", "back", "collect"):
        results[f"{stage}_ms_1mb"] = staged[stage]
    results["raw_submit_ms_1mb"] = breakdown["1mb"]["raw"]["submit"]
    results["raw_wait_ms_1mb"] = breakdown["1mb"]["raw"]["wait"]
    print(bench_headline("dispatch_overhead", " ".join(f"{k}={v:.2f}" for k, v in results.items())))


if __name__ == "__main__":
    main()
