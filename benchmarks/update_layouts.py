"""The actor update of a small model, part by part: FSDP2 vs plain replicas, padded vs packed responses.

Both comparisons run `DataParallelPPOActor.update_policy` on the bundled model (`verl/assets/arith-tiny`)
with a GRPO-shaped batch like the bundled task's: per rank `--groups` prompts of 14-17 tokens
(left-padded to 32) x `--n` responses of 3-4 tokens (right-padded to 8), one micro-batch, fused
AdamW, one thread per process.

- `fsdp` vs `replicas` (2 gloo ranks, one process each): the model under FSDP2 with `fsdp_size=1`
  (replicated over an HSDP mesh: what small models used before) against plain replicas
  (`verl.workers.dp_training.replicate_over_ranks`: one flat gradient all-reduce per step).
- `padded` vs `packed` (one process): the shared-prompt response pass with the prompt cache copied
  to every row against the packed pass (each group's responses end to end on its own prompt cache;
  `verl.utils.shared_prompt.packed_response_layout`), with the same model and batch; the two
  alternate update by update.

Figures are median milliseconds per update after `--warmup` updates.

    python benchmarks/update_layouts.py

Last line: `bench update_layouts: fsdp_ms=... replicas_ms=... replica_speedup=... padded_ms=... packed_ms=... packed_speedup=...`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl.utils.machine import bench_headline

MODEL = os.path.join(os.path.dirname(__file__), "..", "verl", "assets", "arith-tiny")


def grpo_batch(groups: int, n: int, seed: int):
    from verl.protocol import DataProto
    from verl.utils.model import compute_position_id_with_mask

    g = torch.Generator().manual_seed(seed)
    prompt_len, response_len, rows = 32, 8, groups * n
    lengths = torch.randint(14, 18, (groups,), generator=g)
    prompts = torch.zeros(groups, prompt_len, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    for i, length in enumerate(lengths.tolist()):
        prompts[i, -length:] = torch.randint(3, 200, (length,), generator=g)
        prompt_mask[i, -length:] = 1
    order = torch.arange(groups).repeat_interleave(n)
    response_lengths = torch.randint(3, 5, (rows,), generator=g)
    response_mask = (torch.arange(response_len)[None] < response_lengths[:, None]).long()
    responses = torch.randint(3, 200, (rows, response_len), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask[order], response_mask], dim=1)
    tensors = {
        "prompts": prompts[order],
        "responses": responses,
        "input_ids": torch.cat([prompts[order], responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "old_log_probs": torch.zeros(rows, response_len),
        "advantages": torch.randn(rows, 1, generator=g) * response_mask,
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0})


def make_actor(model, rows: int):
    from verl.workers.actor import DataParallelPPOActor

    config = {
        "ppo_mini_batch_size": rows,
        "ppo_micro_batch_size_per_gpu": rows,
        "ppo_epochs": 1,
        "grad_clip": 1.0,
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
    }
    return DataParallelPPOActor(config, model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))


def _rank(rank: int, world: int, port: int, layout: str, args, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.workers.dp_training import replicate_over_ranks

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="sdpa")
    model = apply_fsdp2(model, {"fsdp_size": 1}) if layout == "fsdp" else replicate_over_ranks(model)
    actor = make_actor(model, args.groups * args.n)
    data = grpo_batch(args.groups, args.n, seed=rank)
    seconds = []
    for _ in range(args.warmup + args.updates):
        dist.barrier()
        start = time.perf_counter()
        actor.update_policy(data)
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(statistics.median(seconds[args.warmup :]) * 1e3))
    dist.destroy_process_group()


def two_rank_update_ms(layout: str, args) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ms")
        mp.start_processes(_rank, args=(2, port, layout, args, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            return float(f.read())


def response_pass_ms(args) -> tuple[float, float]:
    """(padded, packed) median ms per update in this process, the two alternating."""
    from transformers import AutoModelForCausalLM

    import verl.utils.shared_prompt as shared_prompt

    torch.set_num_threads(1)
    automatic = shared_prompt.packed_response_layout

    def packed(*a, **k):  # always pack (the automatic choice packs this batch too)
        return automatic(*a, **{**k, "padded_positions": 1 << 30})

    choices = {"padded": lambda *a, **k: None, "packed": packed}
    data = grpo_batch(args.groups, args.n, seed=0)
    actors = {
        name: make_actor(AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="sdpa"), len(data))
        for name in choices
    }
    seconds = {name: [] for name in choices}
    try:
        for i in range(args.warmup + 2 * args.updates):
            for name in list(choices)[:: 1 if i % 2 else -1]:
                shared_prompt.packed_response_layout = choices[name]
                start = time.perf_counter()
                actors[name].update_policy(data)
                if i >= args.warmup:
                    seconds[name].append(time.perf_counter() - start)
    finally:
        shared_prompt.packed_response_layout = automatic
    return statistics.median(seconds["padded"]) * 1e3, statistics.median(seconds["packed"]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=12, help="prompts per rank (default 12)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (default 8)")
    parser.add_argument("--updates", type=int, default=20, help="timed updates per case (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates first (default 3)")
    args = parser.parse_args()

    fsdp_ms = two_rank_update_ms("fsdp", args)
    replicas_ms = two_rank_update_ms("replicas", args)
    padded_ms, packed_ms = response_pass_ms(args)
    print(f"2 ranks: FSDP2 (fsdp_size=1) {fsdp_ms:.1f} ms, plain replicas {replicas_ms:.1f} ms per update")
    print(f"1 process: padded response pass {padded_ms:.1f} ms, packed {packed_ms:.1f} ms per update")
    print(
        bench_headline(
            "update_layouts",
            f"fsdp_ms={fsdp_ms:.1f} replicas_ms={replicas_ms:.1f} "
            f"replica_speedup={fsdp_ms / replicas_ms:.2f} padded_ms={padded_ms:.1f} packed_ms={packed_ms:.1f} "
            f"packed_speedup={padded_ms / packed_ms:.2f}",
        )
    )


if __name__ == "__main__":
    main()
