"""Fused vs unfused log-prob + entropy with their backward: peak memory and time at a real vocabulary.

What is timed is what the actor's LM head does per micro-batch with and without
`use_fused_kernels`, from the last hidden states [tokens, hidden] and the head's weight [vocab, hidden]:

    unfused  logits = hidden @ W^T (whole, in the compute dtype), divided by the temperature in place,
             then the chunked `logprobs_from_logits` and `entropy_from_logits_with_chunking`
             (verl.utils.torch_functional), as `DataParallelPPOActor` runs them
    fused    `fused_linear_for_ppo` (verl.utils.experimental.torch_functional): chunk by chunk,
             the logits recomputed in the backward, never whole

followed by the backward of a loss that weights every log-prob and entropy (gradients to the hidden
states and the weight, as in training). Each variant runs in its own child process, so the peak is
its own: on CUDA `torch.cuda.max_memory_allocated` above the inputs, on CPU the peak resident set
(`ru_maxrss`) above the resident set after the inputs were made. Time: median of `--repeats` after
one warm-up (none on CPU with `--repeats 1`).

    python benchmarks/fused_logprob.py                                 # CPU: 152k vocab, 4096 tokens, hidden 896 (minutes)
    python benchmarks/fused_logprob.py --device cuda --tokens 16384    # GPU, bf16 (the default workload of 4 x 4096)

Last line: `bench fused_logprob: unfused_s=... fused_s=... unfused_mib=... fused_mib=... mem_ratio=... ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from verl.utils.machine import bench_headline


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run_variant(args) -> dict:
    from verl.utils.experimental.torch_functional import fused_linear_for_ppo
    from verl.utils.torch_functional import entropy_from_logits_with_chunking, logprobs_from_logits

    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden**0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    w_lp = torch.randn(args.tokens, generator=gen).to(device)
    w_ent = torch.randn(args.tokens, generator=gen).to(device)

    def step(hidden=hidden, weight=weight, labels=labels, w_lp=w_lp, w_ent=w_ent):
        if args.variant == "fused":
            log_probs, entropy = fused_linear_for_ppo(hidden, weight, labels, args.temperature, args.chunk_size)
        else:
            logits = hidden @ weight.t()
            logits.div_(args.temperature)
            log_probs = logprobs_from_logits(logits, labels)
            entropy = entropy_from_logits_with_chunking(logits)
        ((log_probs * w_lp).sum() + (entropy * w_ent).sum()).backward()
        hidden.grad = weight.grad = None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # the same ops on a few rows first: the libraries and kernels they load are not the variant's memory
    step(hidden[:64], weight[:4096], labels[:64] % 4096, w_lp[:64], w_ent[:64])
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    times = []
    for i in range(args.repeats + (1 if args.repeats > 1 else 0)):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if args.repeats == 1 or i > 0:  # the first of several is the warm-up
            times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": statistics.median(times), "peak_mib": peak / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2.5's")
    parser.add_argument("--hidden", type=int, default=896, help="Qwen2.5-0.5B's")
    parser.add_argument("--tokens", type=int, default=None, help="default: 4096")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: fp32 CPU, bf16 CUDA")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--chunk-size", type=int, default=512, help="tokens per chunk of the fused path")
    parser.add_argument("--repeats", type=int, default=None, help="default: 1 on CPU, 5 on CUDA")
    parser.add_argument("--variant", choices=["fused", "unfused"], help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    on_cuda = args.device == "cuda"
    args.tokens = args.tokens or 4096
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    args.repeats = args.repeats or (5 if on_cuda else 1)
    if on_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch; run with --device cpu")
    if args.variant:
        print(json.dumps(_run_variant(args)))
        return

    results = {}
    for variant in ("unfused", "fused"):
        child = [sys.executable, __file__, "--variant", variant] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "variant"
        ]
        out = subprocess.run(child, check=True, capture_output=True, text=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{variant}: {results[variant]['seconds']:.3f} s, peak {results[variant]['peak_mib']:.0f} MiB")
    name = torch.cuda.get_device_name().replace(" ", "_") if on_cuda else "cpu"
    unfused, fused = results["unfused"], results["fused"]
    print(
        f"{args.tokens} tokens x vocab {args.vocab} x hidden {args.hidden}, {args.dtype}, "
        f"whole logits {args.tokens * args.vocab * torch.finfo(getattr(torch, args.dtype)).bits / 8 / 2**20:.0f} MiB"
    )
    print(
        bench_headline(
            "fused_logprob",
            f"unfused_s={unfused['seconds']:.3f} fused_s={fused['seconds']:.3f} "
            f"time_ratio={fused['seconds'] / unfused['seconds']:.2f} unfused_mib={unfused['peak_mib']:.0f} "
            f"fused_mib={fused['peak_mib']:.0f} mem_ratio={fused['peak_mib'] / max(unfused['peak_mib'], 1):.3f} "
            f"tokens={args.tokens} vocab={args.vocab} hidden={args.hidden} dtype={args.dtype} device={name}",
        )
    )


if __name__ == "__main__":
    main()
