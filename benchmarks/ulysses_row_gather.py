"""The sp group's row gather (verl/workers/ulysses_rows.py): pickled objects vs packed tensor bytes.

Every rank of a Ulysses group must hold the same rows, so each worker call starts with an
all-gather of the chunks the driver sent to the group's ranks. This compares, on 2 gloo ranks of
this machine, `all_gather_object` of the whole DataProto (the former implementation) with
`UlyssesRows.gather` (tensors as one uint8 all-gather, non-tensor columns pickled), on a chunk
shaped like an actor update's: `--rows` rows of `--prompt + --response` tokens with the usual keys.

    python benchmarks/ulysses_row_gather.py                 # 64 rows x 2048 tokens, ~1 minute
    python benchmarks/ulysses_row_gather.py --rows 8        # quick

Last line: `bench ulysses_row_gather: pickle_ms=... tensor_ms=... speedup=... mb_per_rank=... ...`
(median milliseconds of one gather on rank 0 after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl.utils.machine import bench_headline


def _chunk(rank: int, args):
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(rank)
    rows, width, resp = args.rows, args.prompt + args.response, args.response
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 150_000, (rows, width), generator=g),
            "attention_mask": torch.ones(rows, width, dtype=torch.int64),
            "position_ids": torch.arange(width).repeat(rows, 1),
            "responses": torch.randint(0, 150_000, (rows, resp), generator=g),
            "response_mask": torch.ones(rows, resp, dtype=torch.int64),
            "old_log_probs": torch.randn(rows, resp, generator=g),
            "ref_log_prob": torch.randn(rows, resp, generator=g),
            "advantages": torch.randn(rows, resp, generator=g),
        },
        non_tensors={"uid": np.array([f"{rank}-{i}" for i in range(rows)], dtype=object)},
        meta_info={"temperature": 1.0},
    )


def _pickled_gather(data, group, world):
    from verl.protocol import DataProto

    parts = [None] * world
    dist.all_gather_object(parts, data, group=group)
    return DataProto.concat(parts)


def _rank(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VERL_DEVICE="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from verl.workers.ulysses_rows import UlyssesRows

        rows = UlyssesRows(world, "actor_rollout_ref.actor")
        data = _chunk(rank, args)
        reference = _pickled_gather(data, rows.group, world)
        gathered = rows.gather(data)
        for key, value in reference.batch.items():  # the two ways must agree before they are timed
            assert torch.equal(gathered.batch[key], value), key
        timings = {}
        for name, fn in (
            ("pickle", lambda: _pickled_gather(data, rows.group, world)),
            ("tensor", lambda: rows.gather(data)),
        ):
            times = []
            for _ in range(args.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            timings[name] = 1000 * statistics.median(times[1:])
        if rank == 0:
            nbytes = sum(v.numel() * v.element_size() for v in data.batch.values())
            with open(out, "w") as f:
                json.dump({**timings, "mb_per_rank": nbytes / 2**20}, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="rows each rank was sent")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(2, port, args, out), nprocs=2, join=True)
        with open(out) as f:
            r = json.load(f)
    print(f"all_gather_object of the DataProto: {r['pickle']:.1f} ms; packed tensor bytes: {r['tensor']:.1f} ms")
    fields = (
        f"pickle_ms={r['pickle']:.1f} tensor_ms={r['tensor']:.1f} speedup={r['pickle'] / r['tensor']:.2f} "
        f"mb_per_rank={r['mb_per_rank']:.1f} rows={args.rows} tokens={args.prompt + args.response}"
    )
    print(bench_headline("ulysses_row_gather", fields))


if __name__ == "__main__":
    main()
