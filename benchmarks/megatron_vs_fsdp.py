"""Actor training throughput: the megatron backend next to FSDP2, through the real workers.

Each layout runs `ActorRolloutRefWorker(role="actor").update_actor` (the RPC body the trainer
calls) in its own group of `--ranks` processes, on the same model directory and the same PPO batch:

- `fsdp`: `verl.workers.fsdp_workers` (FSDP2 over all ranks);
- `tpN` / `ppN` / `cpN`: `verl.workers.megatron_workers` with tensor / pipeline / context
  parallel size N (the remaining ranks are data parallel); `ppNvM`: pipeline size N with M
  virtual stages per rank (the interleaved schedule).

Every update is one optimizer step over `--batch` sequences of `--seq-len` tokens (prompt half,
response half; no padding), after one warm-up update. Tokens/s counts every token of the batch,
forward and backward, over the whole group; MFU is reported where the device's peak is known.

    python benchmarks/megatron_vs_fsdp.py                    # CPU: 2 gloo ranks, `base` preset (24M), fsdp,tp2,pp2,pp2v2,cp2
    python benchmarks/megatron_vs_fsdp.py --ranks 1 --layouts fsdp,tp1 --preset qwen2.5-0.5b-shape \
        --dtype bf16 --batch 4 --seq-len 4096                # one GPU (not run yet: see docs)

Last line: `bench megatron_vs_fsdp: fsdp_tok_s=... <layout>_tok_s=... <layout>_vs_fsdp=... ...`.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import tempfile
import time

import torch
import torch.multiprocessing as mp

from verl.utils.machine import bench_headline


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(batch: int, seq_len: int, vocab: int, seed: int = 0):
    """A PPO batch without padding: prompts and responses of half the length each."""
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    prompt_len = seq_len // 2
    response_len = seq_len - prompt_len
    input_ids = torch.randint(3, vocab, (batch, seq_len), generator=g)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    response_mask = torch.ones(batch, response_len, dtype=torch.long)
    tensors = {
        "prompts": input_ids[:, :prompt_len],
        "responses": input_ids[:, prompt_len:],
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": torch.arange(seq_len).expand(batch, seq_len).clone(),
        "response_mask": response_mask,
        # near-on-policy old log-probs and random advantages: the loss exercises clipping paths
        "old_log_probs": -5.0 + 0.1 * torch.randn(batch, response_len, generator=g),
        "advantages": torch.randn(batch, response_len, generator=g),
    }
    meta = {"temperature": 1.0}
    return DataProto.from_dict(tensors=tensors, meta_info=meta)


def config_name(layout: str) -> str:
    """The bundled demo config of a layout's backend (the tiny model's CPU settings)."""
    return "arith_demo" if layout == "fsdp" else "arith_demo_megatron"


def _overrides(args, layout: str, model_dir: str) -> list[str]:
    per_rank = max(1, args.batch // args.ranks)
    common = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={args.gradient_checkpointing}",
        f"data.train_batch_size={args.batch}",
        f"data.max_prompt_length={args.seq_len // 2}",
        f"data.max_response_length={args.seq_len - args.seq_len // 2}",
        "actor_rollout_ref.rollout.n=1",
        "algorithm.adv_estimator=reinforce_plus_plus",  # one sample per prompt: n=1 is valid
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={min(per_rank, args.micro_batch)}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"trainer.n_gpus_per_node={args.ranks}",
    ]
    if layout == "fsdp":
        # explicit either way: FSDP's default (null) would compute in bf16 on GPU even for --dtype fp32
        common.append(f"actor_rollout_ref.actor.fsdp_config.mixed_precision={{param_dtype:{args.dtype}}}")
        return common
    match = re.fullmatch(r"(tp|pp|cp)(\d+)(?:v(\d+))?", layout)
    if match is None or (match[3] and match[1] != "pp"):
        raise ValueError(f"unknown layout {layout!r}: use fsdp, tpN, ppN, cpN or ppNvM (M virtual stages per stage)")
    key = {
        "tp": "tensor_model_parallel_size",
        "pp": "pipeline_model_parallel_size",
        "cp": "context_parallel_size",
    }[match[1]]
    out = [
        *common,
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.ref.strategy=megatron",
        f"actor_rollout_ref.actor.megatron.{key}={match[2]}",
        f"actor_rollout_ref.actor.megatron.dtype={args.dtype}",
    ]
    if match[3]:
        out.append(f"actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size={match[3]}")
    return out


def _rank(rank: int, world: int, port: int, args, layout: str, model_dir: str, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from verl.trainer.config import load_ppo_config
    from verl.utils.device import synchronize

    if layout == "fsdp":
        from verl.workers.fsdp_workers import ActorRolloutRefWorker
    else:
        from verl.workers.megatron_workers import ActorRolloutRefWorker

    cfg = load_ppo_config(_overrides(args, layout, model_dir), config_name=config_name(layout))
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    vocab = worker.actor_model.hf_config.vocab_size
    full = _batch(args.batch, args.seq_len, min(vocab, 50_000))
    if layout == "fsdp":
        dp, dp_rank = world, rank
    else:  # the ranks of one tensor/pipeline/context group take the same data-parallel shard
        from megatron.core import parallel_state as mpu

        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    shard = full.chunk(dp)[dp_rank] if dp > 1 else full
    times, mfu = [], []
    for step in range(args.steps + 1):
        synchronize()
        start = time.perf_counter()
        metrics = worker.update_actor(shard).meta_info["metrics"]
        synchronize()
        if step:  # the first update is the warm-up
            times.append(time.perf_counter() - start)
            if "perf/mfu/actor" in metrics:
                mfu.append(metrics["perf/mfu/actor"])
    if rank == 0:
        seconds = sorted(times)[len(times) // 2]
        results.put((layout, seconds, args.batch * args.seq_len / seconds, sum(mfu) / len(mfu) if mfu else None))


def run_layout(args, layout: str, model_dir: str) -> dict:
    ctx = mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    results = ctx.SimpleQueue()
    mp.start_processes(
        _rank,
        args=(args.ranks, _free_port(), args, layout, model_dir, results),
        nprocs=args.ranks,
        start_method=ctx.get_start_method(),
    )
    name, seconds, tok_s, mfu = results.get()
    return {"layout": name, "s_per_update": seconds, "tok_s": tok_s, "mfu": mfu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base", help="verl.models.factory preset (random weights)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--layouts",
        default="fsdp,tp2,pp2,pp2v2,cp2",
        help="comma-separated: fsdp, tpN, ppN, cpN, ppNvM (M virtual stages)",
    )
    parser.add_argument("--batch", type=int, default=16, help="sequences per update (whole group)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8, help="micro-batch size per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed updates (the median is reported)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()

    from verl.models.factory import make_tiny

    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(
        f"{args.preset}, {args.ranks} ranks on {device}, {args.batch} x {args.seq_len} tokens per update, {args.dtype}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(args.preset, os.path.join(tmp, "model"), dtype="float32")
        rows = [run_layout(args, layout, model_dir) for layout in layouts]
    print(f"{'layout':8} {'s/update':>9} {'tokens/s':>10} {'MFU':>6}")
    for row in rows:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        print(f"{row['layout']:8} {row['s_per_update']:9.3f} {row['tok_s']:10.0f} {mfu:>6}")
    base = next((r for r in rows if r["layout"] == "fsdp"), None)
    fields = []
    for row in rows:
        fields.append(f"{row['layout']}_tok_s={row['tok_s']:.0f}")
        if base is not None and row is not base:
            fields.append(f"{row['layout']}_vs_fsdp={row['tok_s'] / base['tok_s']:.2f}")
        if row["mfu"] is not None:
            fields.append(f"{row['layout']}_mfu={row['mfu']:.3f}")
    print(bench_headline("megatron_vs_fsdp", " ".join(fields)))


if __name__ == "__main__":
    main()
