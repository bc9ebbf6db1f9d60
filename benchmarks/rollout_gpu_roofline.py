"""Built-in rollout engine on one GPU against the memory-bandwidth roofline of decoding.

Model: Qwen2.5-0.5B's shape (verl.models preset `qwen2.5-0.5b-shape`, random bf16 weights), batch
256, 128-token prompts, 256 new tokens (EOS disabled), temperature-1 sampling.

Roofline: a decode step must read every weight once (the embedding matrix counts once, as the
tied LM head) plus the KV cache of every sequence up to its current length; at the measured
device-copy bandwidth (or `--bandwidth-gbs`) that bounds tokens/s at
`batch / ((weight_bytes + mean_kv_bytes_per_step) / bandwidth)`. Prefill time is included in the
measured tokens/s, so the reported fraction is conservative.

    python benchmarks/rollout_gpu_roofline.py                # ours only
    python benchmarks/rollout_gpu_roofline.py --with-hf      # also transformers generate() (slow)
    python benchmarks/rollout_gpu_roofline.py --sleep-between  # hybrid-engine steps: sleep, wake, sync

`--sleep-between` puts the engine to sleep (level 2: KV cache and weights freed) after every timed
generation and wakes it and syncs the weights before the next, as the hybrid engine does each RL
step; sleep drops the CUDA graphs, so every timed generation includes recapturing them (reported
as captures and capture seconds per generation).

Last line: `bench rollout_gpu_roofline: ours_tok_s=... roofline_tok_s=... pct_roofline=... [captures_per_gen=...
capture_s_per_gen=...] [hf_tok_s=...]`.
"""

from __future__ import annotations

import argparse
import time

import torch

from verl.utils.machine import bench_headline


def measure_copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    from verl.utils.device import synchronize

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - start)


def roofline_tok_s(config, batch: int, prompt_len: int, new_tokens: int, bandwidth: float, dtype_bytes: int) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    lm_head = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    weight_bytes = (layers * per_layer + lm_head + h) * dtype_bytes
    kv_bytes_per_token = 2 * layers * kv * dtype_bytes
    mean_context = prompt_len + (new_tokens - 1) / 2
    kv_bytes = batch * mean_context * kv_bytes_per_token
    step_s = (weight_bytes + kv_bytes) / bandwidth
    return {"weight_gb": weight_bytes / 1e9, "kv_gb_per_step": kv_bytes / 1e9, "tok_s": batch / step_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b-shape")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="default: measured device copy bandwidth")
    parser.add_argument("--eager", action="store_true", help="disable CUDA graphs")
    parser.add_argument("--with-hf", action="store_true", help="also time transformers generate() once")
    parser.add_argument("--profile", action="store_true", help="print the top kernels of a 32-token generate")
    parser.add_argument(
        "--cpu", action="store_true", help="run on CPU in fp32 (a smoke run of this script: use tiny sizes)"
    )
    parser.add_argument(
        "--sleep-between",
        action="store_true",
        help="sleep (level 2), wake and sync the weights between generations, as the hybrid engine does",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from verl.models.factory import build_config, build_tokenizer, get_preset
    from verl.utils.device import get_device, is_cuda_available, synchronize
    from verl.workers.rollout.native.engine import GenerationEngine
    from verl.workers.rollout.sampling import SamplingParams

    if not is_cuda_available() and not args.cpu:
        raise SystemExit(
            "rollout_gpu_roofline needs a CUDA device; run benchmarks/rollout_vs_hf.py on CPU "
            "(--cpu runs this script on CPU as a smoke test, with tiny sizes)"
        )
    device = get_device() if is_cuda_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = get_preset(args.preset)
    config = build_config(preset, build_tokenizer(preset))
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    engine = GenerationEngine.from_model(
        model, device=device, dtype=dtype, use_cuda_graph=not args.eager and device.type == "cuda"
    )
    if not (args.with_hf or args.sleep_between):
        del model

    gen = torch.Generator(device=device).manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt_len), device=device, generator=gen)
    attention_mask = torch.ones_like(input_ids)
    sampling = SamplingParams(do_sample=True, temperature=1.0)

    def ours() -> float:
        if args.sleep_between:  # untimed, as the weight sync is timed separately in training
            engine.sleep(2)
            engine.wake_up()
            engine.update_weights(model.named_parameters())
        synchronize()
        start = time.perf_counter()
        out = engine.generate(input_ids, attention_mask, args.new_tokens, sampling, eos_token_id=None, pad_token_id=0)
        synchronize()
        assert out.responses.shape == (args.batch, args.new_tokens)
        return args.batch * args.new_tokens / (time.perf_counter() - start)

    ours()  # warm-up: CUDA-graph capture
    if args.profile:
        from profiling import print_profile

        synchronize()
        start = time.perf_counter()
        engine.generate(input_ids, attention_mask, 1, sampling, eos_token_id=None, pad_token_id=0)
        synchronize()
        print(f"prefill + 1 token: {(time.perf_counter() - start) * 1e3:.1f} ms")
        print_profile(
            lambda: engine.generate(input_ids, attention_mask, 32, sampling, eos_token_id=None, pad_token_id=0),
            device.type == "cuda",
        )
    before = engine.graph_stats()
    ours_tok_s = max(ours() for _ in range(args.repeats))
    after = engine.graph_stats()
    bandwidth = (
        args.bandwidth_gbs * 1e9
        if args.bandwidth_gbs
        else measure_copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 26))
    )
    roof = roofline_tok_s(config, args.batch, args.prompt_len, args.new_tokens, bandwidth, dtype_bytes=dtype.itemsize)
    pct = 100 * ours_tok_s / roof["tok_s"]
    print(
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: {args.preset}, batch {args.batch}, {args.prompt_len}+{args.new_tokens} tokens, "
        f"cuda_graphs={engine.graphs is not None}, graphs captured={engine.graphs.num_graphs() if engine.graphs else 0}"
    )
    captures = (after["captures"] - before["captures"]) / args.repeats
    capture_s = (after["capture_s"] - before["capture_s"]) / args.repeats
    if args.sleep_between:
        print(f"per timed generation: {captures:.1f} graph captures taking {capture_s:.3f} s")
    print(
        f"weights {roof['weight_gb']:.2f} GB + KV {roof['kv_gb_per_step']:.2f} GB per step at {bandwidth / 1e12:.2f} TB/s "
        f"-> roofline {roof['tok_s']:,.0f} tok/s; ours {ours_tok_s:,.0f} tok/s = {pct:.1f}% of roofline"
    )
    fields = [f"ours_tok_s={ours_tok_s:.0f}", f"roofline_tok_s={roof['tok_s']:.0f}", f"pct_roofline={pct:.1f}"]
    if args.sleep_between:
        fields += [f"captures_per_gen={captures:.1f}", f"capture_s_per_gen={capture_s:.3f}"]
    if args.with_hf:
        synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
            )
        synchronize()
        hf_tok_s = args.batch * args.new_tokens / (time.perf_counter() - start)
        print(f"transformers generate(): {hf_tok_s:,.0f} tok/s; ours/hf = {ours_tok_s / hf_tok_s:.1f}x")
        fields.append(f"hf_tok_s={hf_tok_s:.0f}")
    print(bench_headline("rollout_gpu_roofline", " ".join(fields)))


if __name__ == "__main__":
    main()
