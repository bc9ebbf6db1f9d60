"""DataProto serialisation and row operations, side by side with tensordict's own pickling.

What the single controller pays per data-parallel RPC: chunk the batch, pickle each chunk to a
worker, unpickle the results and concatenate them. Prints the best of a few repetitions; the
last line is `bench protocol: ...` with the ratios.

    python benchmarks/bench_protocol.py [--mb 64] [--chunks 8] [--repeats 5] [--ray]
"""

from __future__ import annotations

import argparse
import pickle
import time

import torch

from verl.protocol import DataProto
from verl.utils.machine import bench_headline


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def make_proto(megabytes: int) -> DataProto:
    """A PPO-like batch: int64 token ids and masks, float32 log-probs/advantages, a uid per row."""
    seq, resp = 1024, 512
    per_row = seq * 8 * 3 + resp * 4 * 4  # input_ids, attention_mask, position_ids + 4 float tensors
    rows = max(1, megabytes * 2**20 // per_row)
    tensors = {
        "input_ids": torch.randint(0, 32000, (rows, seq)),
        "attention_mask": torch.ones(rows, seq, dtype=torch.int64),
        "position_ids": torch.arange(seq).repeat(rows, 1),
    }
    for key in ("old_log_probs", "ref_log_prob", "advantages", "returns"):
        tensors[key] = torch.randn(rows, resp)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": [f"u{i}" for i in range(rows)]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="size of the tensor payload in MiB")
    parser.add_argument("--chunks", type=int, default=8, help="data-parallel ranks to chunk for")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ray", action="store_true", help="also time ray.put + ray.get (starts a local Ray)")
    args = parser.parse_args()

    proto = make_proto(args.mb)
    while len(proto) % args.chunks:  # keep the chunk exact for any --chunks
        proto = proto[: len(proto) - 1]
    payload_mb = sum(t.numel() * t.element_size() for t in proto.batch.values()) / 2**20
    blob = pickle.dumps(proto, protocol=pickle.HIGHEST_PROTOCOL)
    td_blob = pickle.dumps(proto.batch, protocol=pickle.HIGHEST_PROTOCOL)

    ours_dump = best_of(lambda: pickle.dumps(proto, protocol=pickle.HIGHEST_PROTOCOL), args.repeats)
    ours_load = best_of(lambda: pickle.loads(blob), args.repeats)
    td_dump = best_of(lambda: pickle.dumps(proto.batch, protocol=pickle.HIGHEST_PROTOCOL), args.repeats)
    td_load = best_of(lambda: pickle.loads(td_blob), args.repeats)
    chunk = proto.chunk(args.chunks)[0]
    ours_chunk_mb = len(pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)) / 2**20
    td_chunk_mb = len(pickle.dumps(chunk.batch, protocol=pickle.HIGHEST_PROTOCOL)) / 2**20
    parts = proto.chunk(args.chunks)
    chunk_s = best_of(lambda: proto.chunk(args.chunks), args.repeats)
    concat_s = best_of(lambda: DataProto.concat(parts), args.repeats)

    print(f"payload {payload_mb:.1f} MiB, {len(proto)} rows, {len(proto.batch.keys())} tensors")
    print(
        f"pickle round trip   ours {1e3 * (ours_dump + ours_load):7.1f} ms   tensordict {1e3 * (td_dump + td_load):7.1f} ms"
    )
    print(f"one of {args.chunks} chunks    ours {ours_chunk_mb:7.1f} MiB  tensordict {td_chunk_mb:7.1f} MiB")
    print(f"chunk({args.chunks}) {1e3 * chunk_s:.2f} ms, concat of {args.chunks} {1e3 * concat_s:.1f} ms")
    ray_fields = ""
    if args.ray:
        import ray

        ray.init(num_cpus=1, include_dashboard=False)
        ours_ray = best_of(lambda: ray.get(ray.put(proto)), args.repeats)
        td_ray = best_of(lambda: ray.get(ray.put(proto.batch)), args.repeats)
        ray.shutdown()
        print(f"ray put+get         ours {1e3 * ours_ray:7.1f} ms   tensordict {1e3 * td_ray:7.1f} ms")
        ray_fields = f" ray_ms={1e3 * ours_ray:.1f} ray_speedup={td_ray / ours_ray:.2f}"
    print(
        bench_headline(
            "protocol",
            f"payload_mb={payload_mb:.0f} roundtrip_ms={1e3 * (ours_dump + ours_load):.1f} "
            f"roundtrip_speedup={(td_dump + td_load) / (ours_dump + ours_load):.2f} "
            f"chunk_bytes_ratio={td_chunk_mb / ours_chunk_mb:.2f} concat_ms={1e3 * concat_s:.1f}{ray_fields}",
        )
    )


if __name__ == "__main__":
    main()
