"""Cost of `rollout.logprobs_mode` in the sampler (`verl.workers.rollout.sampling.select_tokens`), CPU.

One decode step's token choice for a [batch, vocab] logits block, side by side: no filter, and
top-k with each log-prob mode. With top-k/top-p, `processed_logprobs` (the default) renormalises
over the kept tokens as vLLM does, which costs a masked log-softmax over the vocabulary.

    python benchmarks/sampling_logprobs_modes.py --batch 64 --vocab 32000 --repeats 30
"""

from __future__ import annotations

import argparse
import time

import torch

from verl.workers.rollout.sampling import SamplingParams, select_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    cases = {
        "plain": SamplingParams(temperature=0.7),
        "topk_processed": SamplingParams(temperature=0.7, top_k=args.top_k),
        "topk_raw": SamplingParams(temperature=0.7, top_k=args.top_k, logprobs_mode="raw_logprobs"),
    }
    ms = {}
    for name, params in cases.items():
        for _ in range(3):
            select_tokens(logits, params, True, generator)
        start = time.perf_counter()
        for _ in range(args.repeats):
            select_tokens(logits, params, True, generator)
        ms[name] = (time.perf_counter() - start) / args.repeats * 1e3
        print(f"{name}: {ms[name]:.2f} ms per step (log-probs on)")
    print(
        "bench sampling_logprobs_modes: "
        + " ".join(f"{k}_ms={v:.2f}" for k, v in ms.items())
        + f" processed_over_raw={ms['topk_processed'] / ms['topk_raw']:.2f}"
    )


if __name__ == "__main__":
    main()
