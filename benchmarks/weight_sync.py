"""Hybrid-engine weight sync: seconds to move an FSDP2 actor's weights into the built-in engine.

What is timed is the production path, the one `ActorRolloutRefWorker.generate_sequences` takes
before every generation: `verl.workers.engine_workers.sync_rollout_weights`. The actor's sharded
fp32 master weights (FSDP2 over a world of one: NCCL on CUDA, gloo on CPU) are cast to the rollout
dtype shard by shard, gathered, and copied into the engine (`HFRollout` -> `GenerationEngine`),
which is woken from the level-2 sleep the worker leaves it in after each generation (weights freed,
so the wake-up reallocates them). Between syncs the engine is put back to sleep as the worker does.

Model: a `verl.models` preset with random weights (`qwen2.5-0.5b-shape` by default), saved as an HF
checkpoint in a temporary directory and loaded by the worker's own engine (`FSDPEngineWithLMHead`: the
same loader, sharding and mixed-precision policy as training); the engine is built from the same
checkpoint. Rollout dtype bf16 unless `--rollout-dtype` says otherwise.

Figures: median seconds of `--repeats` syncs after one warm-up; `gb` is the engine's weight bytes
(what each sync writes), `gb_s` = gb / seconds.

    python benchmarks/weight_sync.py                              # Qwen2.5-0.5B shape (GPU; ~1 GB temp checkpoint)
    python benchmarks/weight_sync.py --preset tiny --repeats 5    # CPU

Last line: `bench weight_sync: seconds=... gb=... gb_s=... device=...`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from verl.utils.machine import bench_headline, cpu_model


def device_name() -> str:
    from verl.utils.device import get_device, is_cuda_available

    if is_cuda_available():
        return torch.cuda.get_device_name(get_device())
    return cpu_model()


def init_world_of_one() -> None:
    """A one-rank default process group (FSDP2 needs one): NCCL on CUDA, gloo on CPU."""
    from verl.single_controller.base.worker import get_free_port
    from verl.utils import device as dev

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dev.set_device()
    port = get_free_port()
    dist.init_process_group(dev.get_dist_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b-shape", help="a verl.models preset (tiny for CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs after one warm-up (median reported)")
    parser.add_argument(
        "--rollout-dtype", default="bfloat16", help="the engine's dtype (rollout.dtype): bfloat16, float32, auto"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from omegaconf import OmegaConf

    from verl.models.factory import make_tiny
    from verl.utils import device as dev
    from verl.workers.engine import FSDPEngineWithLMHead
    from verl.workers.engine_workers import rollout_dtype, sync_rollout_weights
    from verl.workers.rollout.hf_rollout import HFRollout

    init_world_of_one()
    rollout_cfg = OmegaConf.create({"dtype": args.rollout_dtype})
    with tempfile.TemporaryDirectory(prefix="weight_sync_bench_") as tmp:
        path = make_tiny(args.preset, os.path.join(tmp, args.preset), seed=0, dtype="bfloat16")
        # fsdp_size=1 is the whole world of one; unlike the default -1 it never turns a small model
        # into a plain replica, so every preset is measured under FSDP2
        actor = FSDPEngineWithLMHead(OmegaConf.create({"path": path}), {"fsdp_size": 1})
        rollout = HFRollout(path, config=rollout_cfg, device=dev.get_device())
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(actor.module, FSDPModule), "the benchmark measures an FSDP2 actor"
    rollout.sleep()  # the worker's state between generations
    dtype = rollout_dtype(rollout_cfg)
    num_params = sum(p.numel() for p in actor.module.parameters())

    def one_sync() -> float:
        dev.synchronize()
        start = time.perf_counter()
        sync_rollout_weights(actor, rollout, dtype)
        dev.synchronize()
        return time.perf_counter() - start

    one_sync()  # warm-up: first allocations, NCCL/gloo first use
    weight_bytes = rollout.engine.memory_bytes()["weights"]
    times = []
    for _ in range(args.repeats):
        rollout.sleep()
        times.append(one_sync())
    seconds = statistics.median(times)
    gb = weight_bytes / 1e9
    device = device_name()
    print(
        f"{args.preset}: {num_params / 1e6:.1f}M parameters, fp32 FSDP2 masters (world 1, {dist.get_backend()}) "
        f"-> engine in {dtype}: {gb:.3f} GB per sync; syncs (s): {', '.join(f'{t:.4f}' for t in times)}"
    )
    dist.destroy_process_group()
    print(
        bench_headline(
            "weight_sync",
            f"seconds={seconds:.4g} gb={gb:.4g} gb_s={gb / seconds:.4g} device={device.replace(' ', '_')}",
        )
    )


if __name__ == "__main__":
    main()
