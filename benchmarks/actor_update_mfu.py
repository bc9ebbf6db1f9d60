"""Model FLOPs utilisation of the PPO actor update: our `DataParallelPPOActor.update_policy` on an
FSDP2 model (world size 1: NCCL on CUDA, gloo on CPU), bf16 compute with fp32 master weights and
gradient reduction (the worker's default mixed precision on CUDA), fused AdamW.

Default workload (the GPU acceptance's): Qwen2.5-0.5B's shape (random weights), 4 sequences of
4096 tokens (512 prompt + 3584 response, no padding), one mini-batch, split by tokens as upstream's
`use_dynamic_bsz` with its default `ppo_max_token_len_per_gpu=16384` (so one forward/backward of
4 x 4096); `--micro-batch N` splits by rows instead. `--preset tiny --seq-len 256` runs the same code on CPU in seconds.

FLOPs counted (the work the update has to do, nothing the implementation adds): per token,
6 x the decoder layers' matmul weights, plus causal attention, 6 x 2 x layers x q_dim x (mean
context = (S + 1) / 2) for QK^T and AV (forward 2 x 2 x context x q_dim per layer, backward twice
that); the LM head (6 x vocab x hidden) only at the response + 1 positions whose logits the actor
computes; the embedding lookup is no matmul. MFU divides by the elapsed time
of `update_policy` (synchronised) and the device's peak: the dense bf16 peak for known GPUs
(`verl.utils.device.peak_flops_per_device`), `--peak-tflops` otherwise; on CPU the measured fp32
matmul rate of this machine stands in for the peak, so the CPU figure reads "% of what this
machine's matmul reaches".

    python benchmarks/actor_update_mfu.py                                   # GPU default
    python benchmarks/actor_update_mfu.py --preset tiny --seq-len 256       # CPU, seconds
    python benchmarks/actor_update_mfu.py --fused                           # use_fused_kernels=true

Last line: `bench actor_update_mfu: mfu_pct=... tflops=... tok_s=... seconds=... peak_tflops=... device=...`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from verl.utils.machine import bench_headline


def layer_matmul_params(config) -> int:
    """Weights of the decoder layers that take part in a matmul per token (attention and MLP
    projections; norms and biases are no matmul)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return config.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def update_flops(config, num_sequences: int, seq_len: int, head_positions: int) -> float:
    """FLOPs of forward + backward over `num_sequences` causal sequences of `seq_len` tokens whose
    LM head runs at `head_positions` positions per sequence (the actor computes logits only where
    they predict a response token: response length + 1)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_dim = config.num_attention_heads * head_dim
    tokens = num_sequences * seq_len
    layers = 6 * layer_matmul_params(config) * tokens
    head = 6 * config.vocab_size * config.hidden_size * head_positions * num_sequences
    attention = 6 * 2 * config.num_hidden_layers * q_dim * (seq_len + 1) / 2 * tokens
    return layers + head + attention


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    from verl.utils.device import synchronize

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def make_batch(vocab: int, num_sequences: int, prompt_len: int, response_len: int, seed: int = 0):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (num_sequences, prompt_len), generator=g)
    responses = torch.randint(3, vocab, (num_sequences, response_len), generator=g)
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.ones_like(input_ids)
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids).clone()
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": torch.ones_like(responses),
            "old_log_probs": torch.zeros(responses.shape),
            "advantages": torch.randn(responses.shape, generator=g),
        },
        batch_size=[num_sequences],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b-shape")
    parser.add_argument("--num-sequences", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=None, help="default: seq_len / 8")
    parser.add_argument(
        "--max-token-len",
        type=int,
        default=16384,
        help="use_dynamic_bsz token budget per forward/backward (upstream's default ppo_max_token_len_per_gpu)",
    )
    parser.add_argument("--micro-batch", type=int, default=None, help="fixed rows per forward/backward instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--fused", action="store_true", help="use_fused_kernels=true: log-probs from the hidden states, no whole logits"
    )
    parser.add_argument("--profile", action="store_true", help="print the top kernels of one update (torch.profiler)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="default: the device's dense bf16 peak")
    args = parser.parse_args()

    import torch.distributed as dist

    from verl.models.factory import build_config, build_tokenizer, get_preset
    from verl.protocol import DataProto
    from verl.utils import fsdp_utils
    from verl.utils.device import get_device, get_dist_backend, is_cuda_available, peak_flops_per_device, synchronize
    from verl.utils.optim import build_optimizer
    from verl.workers.actor import DataParallelPPOActor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    on_cuda = is_cuda_available()
    device = get_device()
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(get_dist_backend(), rank=0, world_size=1)
    try:
        preset = get_preset(args.preset)
        config = build_config(preset, build_tokenizer(preset))
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = fsdp_utils.apply_fsdp2(model)  # bf16 params / fp32 reduce on CUDA, the model's dtype on CPU
        optimizer = build_optimizer(model.parameters(), {"lr": 1e-6})
        prompt_len = args.prompt_len or args.seq_len // 8
        response_len = args.seq_len - prompt_len
        actor_config = {
            "ppo_mini_batch_size": args.num_sequences,
            "ppo_micro_batch_size_per_gpu": args.micro_batch,
            "use_dynamic_bsz": args.micro_batch is None,
            "ppo_max_token_len_per_gpu": args.max_token_len,
            "use_remove_padding": False,
            "grad_clip": 1.0,
            "policy_loss": {"loss_mode": "vanilla"},
            "share_prompt_forward": False,
            "skip_zero_advantage_step": False,
            "use_fused_kernels": args.fused,
        }
        actor = DataParallelPPOActor(actor_config, model, optimizer)
        batch = make_batch(config.vocab_size, args.num_sequences, prompt_len, response_len)
        data = DataProto.from_dict(tensors=dict(batch.items()), meta_info={"temperature": 1.0})

        def timed_update() -> float:
            synchronize()
            start = time.perf_counter()
            actor.update_policy(data)
            synchronize()
            return time.perf_counter() - start

        timed_update()  # warm-up: allocator, kernels, fused AdamW state
        if args.profile:
            from profiling import print_profile

            print_profile(lambda: actor.update_policy(data), on_cuda)
        seconds = statistics.median(timed_update() for _ in range(args.repeats))
        flops = update_flops(config, args.num_sequences, args.seq_len, head_positions=response_len + 1)
        if args.peak_tflops:
            peak, peak_source = args.peak_tflops * 1e12, "--peak-tflops"
        elif on_cuda:
            peak, peak_source = peak_flops_per_device(torch.bfloat16), "dense bf16 peak of the device"
            if not peak:
                raise SystemExit(f"unknown peak for {torch.cuda.get_device_name()}: pass --peak-tflops")
        else:
            peak, peak_source = measure_matmul_flops(device, torch.float32), "measured fp32 matmul rate"
        achieved = flops / seconds
        tokens = args.num_sequences * args.seq_len
        name = torch.cuda.get_device_name() if on_cuda else "cpu"
        memory = f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if on_cuda else ""
        split = (
            f"micro-batch {args.micro_batch}" if args.micro_batch else f"dynamic batches of {args.max_token_len} tokens"
        )
        print(
            f"{name}: {args.preset}, {args.num_sequences} x {args.seq_len} tokens, {split}, "
            f"{'fused' if args.fused else 'unfused'} log-probs, "
            f"{seconds * 1e3:.0f} ms per update, {flops / 1e12:.2f} TFLOP{memory}"
        )
        print(f"achieved {achieved / 1e12:.1f} TFLOP/s of {peak / 1e12:.1f} ({peak_source})")
        print(
            bench_headline(
                "actor_update_mfu",
                f"mfu_pct={100 * achieved / peak:.1f} tflops={achieved / 1e12:.2f} fused={int(args.fused)} "
                f"tok_s={tokens / seconds:.0f} seconds={seconds:.3f} peak_tflops={peak / 1e12:.1f} device={name.replace(' ', '_')}",
            )
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
