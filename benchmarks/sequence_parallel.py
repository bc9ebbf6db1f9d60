"""Ulysses sequence parallelism: activation memory and throughput per rank at sp=1 vs sp=2.

One packed batch of long sequences (`--seq-len` tokens in `--sequences` equal sequences) through a
random-init Qwen2-shaped model, forward and backward, with the sequence split across sp gloo ranks
on this machine (`verl.utils.ulysses`: pad-and-slice, the all-to-all around sdpa attention, the
gather of log-probs). sp=1 runs the same code path in a group of one.

Figures, per rank: `act_mb` is the activation memory of one forward/backward, measured as the bytes
autograd saves for the backward (`torch.autograd.graph.saved_tensors_hooks`, parameters excluded;
on CPU there is no allocator high-water mark to read, and the saved tensors are what sequence
parallelism is meant to shrink); `tok_s` is tokens this rank holds / median seconds of a
forward+backward over `--repeats` runs after one warm-up. Ranks of one machine share its cores, so
tok_s at sp=2 on a 2-core machine measures the split's overhead, not a speed-up.

    python benchmarks/sequence_parallel.py                    # 8k tokens, CPU, ~1 minute
    python benchmarks/sequence_parallel.py --seq-len 2048     # quick

Last line: `bench sequence_parallel: act_mb_sp1=... act_mb_sp2=... mem_ratio=... tok_s_sp1=... tok_s_sp2=... ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl.utils.machine import bench_headline


def _model(args):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _saved_bytes(params: set[int]):
    total = [0]

    def pack(t):
        if t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t

    return total, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _rank(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from verl.utils import ulysses

        ulysses.patch_sdpa_attention()
        model = _model(args)
        per = args.seq_len // args.sequences
        ids = torch.randint(0, args.vocab, (1, per * args.sequences), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(per).repeat(args.sequences)[None]
        params = {p.data_ptr() for p in model.parameters()}
        times, act = [], 0
        for i in range(args.repeats + 1):
            model.zero_grad(set_to_none=True)
            total, hooks = _saved_bytes(params)
            start = time.perf_counter()
            with hooks:
                log_probs, _ = ulysses.packed_forward(model, ids, pos, dist.group.WORLD, 1.0, {}, grad_scale=world)
            log_probs.sum().backward()
            dist.barrier()
            if i:
                times.append(time.perf_counter() - start)
            act = total[0]
        if rank == 0:
            local_tokens = ids.size(1) // world
            with open(out, "w") as f:
                json.dump({"act_mb": act / 2**20, "tok_s": local_tokens / statistics.median(times)}, f)
    finally:
        dist.destroy_process_group()


def run(sp: int, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(sp, port, args, out), nprocs=sp, join=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192, help="packed tokens per batch")
    parser.add_argument("--sequences", type=int, default=2, help="sequences packed into the batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = {sp: run(sp, args) for sp in (1, 2)}
    for sp, r in results.items():
        print(f"sp={sp}: activation memory per rank {r['act_mb']:.1f} MB, {r['tok_s']:.0f} tokens/s per rank")
    ratio = results[2]["act_mb"] / results[1]["act_mb"]
    fields = (
        f"act_mb_sp1={results[1]['act_mb']:.1f} act_mb_sp2={results[2]['act_mb']:.1f} mem_ratio={ratio:.3f} "
        f"tok_s_sp1={results[1]['tok_s']:.0f} tok_s_sp2={results[2]['tok_s']:.0f} seq_len={args.seq_len}"
    )
    print(bench_headline("sequence_parallel", fields))


if __name__ == "__main__":
    main()
