"""Round-trip cost of a DP_COMPUTE_PROTO call through a worker group, against raw Ray.

Two CPU workers echo their chunk back. `ms_1mb` / `ms_64mb` are the median milliseconds of one
`wg.echo(batch)` call (pad, chunk, ship, run, ship back, concat) for a DataProto of 1 MiB and
64 MiB of float32 tensors. The `raw_` figures send the same bytes as numpy halves straight to two
bare Ray actors and back: the floor that any dispatch layer on Ray pays. The ratios are ours over
the floor. Goal: ms_1mb <= 5.

Run: python benchmarks/dispatch_overhead.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import ray
import torch

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RAY_SYSTEM_CONFIG, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

ROW_FLOATS = 1024  # one row = 4 KiB


class EchoWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data):
        return data


@ray.remote(num_cpus=0)
class RawEcho:
    def echo(self, array):
        return array


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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
    for label, mib, repeats in (("1mb", 1, args.repeats), ("64mb", 64, max(3, args.repeats // 6))):
        rows = mib * 1024 * 1024 // (ROW_FLOATS * 4)
        data = DataProto.from_dict(tensors={"x": torch.randn(rows, ROW_FLOATS)})
        out = wg.echo(data)
        assert torch.equal(out.batch["x"], data.batch["x"]), "echo changed the data"
        halves = np.array_split(np.random.rand(rows * ROW_FLOATS // 2).astype(np.float32).repeat(2), 2)
        results[f"ms_{label}"] = _median_ms(lambda data=data: wg.echo(data), repeats)
        results[f"raw_ms_{label}"] = _median_ms(
            lambda halves=halves: ray.get([a.echo.remote(h) for a, h in zip(raw, halves)]), repeats
        )
        results[f"ratio_{label}"] = results[f"ms_{label}"] / results[f"raw_ms_{label}"]
    ray.shutdown()
    print("bench dispatch_overhead: " + " ".join(f"{k}={v:.2f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
