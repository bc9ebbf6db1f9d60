"""Built-in rollout engine vs transformers `generate()` on the same model, batch and lengths (CPU).

Two scenarios, every engine under `torch.inference_mode`, sampling at temperature 1 with no
top-k/top-p, after `--warmup` untimed runs; the engines then run alternately `--repeats` times so
machine load hits them alike, and the median of each is reported.

- fixed (per `--presets` model): random left-padded prompts of mixed lengths, exactly
  `--new-tokens` tokens per row with no EOS handling in either engine (no EOS id for ours; the model's
  generation config loses its EOS for transformers, so it runs no EOS logits processor or stopping
  check). Every engine does the same work; this is the per-token speed. transformers runs twice:
  with its default dynamic cache (`hf`) and with `cache_implementation="static"` (`hf_static`).
- grpo: the project's RL workload, the bundled arith-tiny model on arithmetic prompts
  (`examples/grpo_trainer/run_arith_tiny_cpu.sh`: each prompt sampled `--grpo-n` times, up to 8
  new tokens, EOS on, rows stop at EOS). Both engines see the identical batch and sample from the
  same distribution; the number of tokens each samples differs by chance, so the ratio is the
  ratio of batch times and the mean response lengths are printed alongside.

    python benchmarks/rollout_vs_hf.py                      # tiny and small presets, then grpo
    python benchmarks/rollout_vs_hf.py --presets tiny --repeats 3 --threads 1
    python benchmarks/rollout_vs_hf.py --threads 1 --cpu-time   # on a loaded machine: CPU time, not wall

Last line: `bench rollout_vs_hf: ours_tok_s=... hf_tok_s=... ratio=... hf_static_tok_s=...
static_ratio=...` for the first preset, the same keys prefixed with each further preset's name,
then `grpo_ours_ms=... grpo_hf_ms=... grpo_ratio=...`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from verl.utils.machine import bench_headline


def model_dir(preset: str, workdir: Path) -> str:
    from verl.models import bundled_model_path
    from verl.models.factory import make_tiny

    if preset == "tiny":
        try:
            return bundled_model_path("arith-tiny")
        except FileNotFoundError:
            pass
    return make_tiny(preset, str(workdir / preset), seed=0)


def prompts(batch: int, vocab: int, min_len: int, max_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen)
    input_ids = torch.randint(3, vocab, (batch, max_len), generator=gen)
    attention_mask = (torch.arange(max_len)[None, :] >= (max_len - lengths)[:, None]).long()
    return input_ids * attention_mask, attention_mask


def alternate(fns: dict, warmup: int, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each function, timed in alternation."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            runs[name].append(clock() - start)
    return {name: statistics.median(times) for name, times in runs.items()}


def hf_generate(model, input_ids, attention_mask, new_tokens: int, **kwargs):
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        return model.generate(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            **kwargs,
        )


def bench_fixed(preset: str, args, workdir: Path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from verl.workers.rollout.native.engine import GenerationEngine
    from verl.workers.rollout.sampling import SamplingParams

    path = model_dir(preset, workdir)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None
    engine = GenerationEngine.from_model(path, device="cpu", dtype=torch.float32)
    input_ids, attention_mask = prompts(args.batch, hf_model.config.vocab_size, args.prompt_len // 2, args.prompt_len)
    new_tokens = args.new_tokens
    sampling = SamplingParams(do_sample=True, temperature=1.0)

    def ours():
        with torch.inference_mode():
            out = engine.generate(input_ids, attention_mask, new_tokens, sampling, eos_token_id=None, pad_token_id=0)
        assert out.responses.shape == (args.batch, new_tokens)

    def hf(**kwargs):
        out = hf_generate(hf_model, input_ids, attention_mask, new_tokens, pad_token_id=0, **kwargs)
        assert out.shape == (args.batch, input_ids.shape[1] + new_tokens)

    seconds = alternate(
        {"ours": ours, "hf": hf, "hf_static": lambda: hf(cache_implementation="static")},
        args.warmup,
        args.repeats,
        args.clock,
    )
    tok_s = {name: args.batch * new_tokens / s for name, s in seconds.items()}
    params = sum(p.numel() for p in hf_model.parameters())
    print(
        f"fixed {preset}: {params / 1e6:.2f}M params, batch {args.batch}, prompt <= {args.prompt_len}, "
        f"{new_tokens} new tokens, {torch.get_num_threads()} threads, native={engine.is_native}: "
        f"ours {tok_s['ours']:,.0f} tok/s, hf {tok_s['hf']:,.0f} tok/s (ratio {tok_s['ours'] / tok_s['hf']:.2f}), "
        f"hf static cache {tok_s['hf_static']:,.0f} tok/s (ratio {tok_s['ours'] / tok_s['hf_static']:.2f})"
    )
    return tok_s


def bench_grpo(args) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.models import bundled_model_path
    from verl.utils.dataset.arith import make_arith_rows
    from verl.workers.rollout.native.engine import GenerationEngine
    from verl.workers.rollout.sampling import SamplingParams

    path = bundled_model_path("arith-tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    rows, _ = make_arith_rows(num_train=args.grpo_prompts, num_test=0, seed=1)
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    input_ids = enc.input_ids.repeat_interleave(args.grpo_n, 0)
    attention_mask = enc.attention_mask.repeat_interleave(args.grpo_n, 0)
    eos, pad, new_tokens = tokenizer.eos_token_id, tokenizer.pad_token_id, args.grpo_new_tokens

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = GenerationEngine.from_model(path, device="cpu", dtype=torch.float32)
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    lengths = {"ours": [], "hf": []}

    def ours():
        with torch.inference_mode():
            out = engine.generate(input_ids, attention_mask, new_tokens, sampling, eos_token_id=eos, pad_token_id=pad)
        lengths["ours"].append(out.response_mask.sum(-1).float().mean().item())

    def hf():
        out = hf_generate(hf_model, input_ids, attention_mask, new_tokens, eos_token_id=eos, pad_token_id=pad)
        response = out[:, input_ids.shape[1] :]
        is_eos = (response == eos).long()
        lengths["hf"].append(((is_eos.cumsum(-1) - is_eos) == 0).sum(-1).float().mean().item())

    seconds = alternate({"ours": ours, "hf": hf}, args.warmup, args.repeats, args.clock)
    ms = {name: s * 1e3 for name, s in seconds.items()}
    mean_len = {name: statistics.mean(v) for name, v in lengths.items()}
    print(
        f"grpo arith-tiny: {args.grpo_prompts} prompts x {args.grpo_n} samples, prompt {input_ids.shape[1]} tokens, "
        f"<= {new_tokens} new tokens with EOS, {torch.get_num_threads()} threads: ours {ms['ours']:.1f} ms "
        f"(mean response {mean_len['ours']:.2f} tokens), hf {ms['hf']:.1f} ms (mean response {mean_len['hf']:.2f}), "
        f"ratio {ms['hf'] / ms['ours']:.2f}"
    )
    return ms


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small", help="comma-separated verl.models presets")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16, help="longest prompt; others are down to half")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--grpo-prompts", type=int, default=16, help="distinct prompts of the grpo scenario")
    parser.add_argument("--grpo-n", type=int, default=8, help="samples per prompt (rollout.n)")
    parser.add_argument("--grpo-new-tokens", type=int, default=8, help="data.max_response_length")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time instead of wall time: stable on a loaded machine, needs --threads 1",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time and torch.get_num_threads() != 1:
        parser.error("--cpu-time counts every thread's time, spin-waits included; use it with --threads 1")
    args.clock = time.process_time if args.cpu_time else time.perf_counter

    fields = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, preset in enumerate(args.presets.split(",")):
            tok_s = bench_fixed(preset, args, Path(tmp))
            prefix = "" if i == 0 else f"{preset}_"
            fields += [
                f"{prefix}ours_tok_s={tok_s['ours']:.0f}",
                f"{prefix}hf_tok_s={tok_s['hf']:.0f}",
                f"{prefix}ratio={tok_s['ours'] / tok_s['hf']:.2f}",
                f"{prefix}hf_static_tok_s={tok_s['hf_static']:.0f}",
                f"{prefix}static_ratio={tok_s['ours'] / tok_s['hf_static']:.2f}",
            ]
    ms = bench_grpo(args)
    fields += [
        f"grpo_ours_ms={ms['ours']:.1f}",
        f"grpo_hf_ms={ms['hf']:.1f}",
        f"grpo_ratio={ms['hf'] / ms['ours']:.2f}",
    ]
    print(bench_headline("rollout_vs_hf", " ".join(fields)))


if __name__ == "__main__":
    main()
