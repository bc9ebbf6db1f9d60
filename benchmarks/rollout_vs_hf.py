"""Built-in rollout engine vs transformers `generate()`: tokens/s on the same model, batch and lengths.

Both load the same HF checkpoint directory (the bundled tiny model when present, else a freshly
built random-init preset), sample at temperature 1 with no top-k/top-p, and generate exactly
`--new-tokens` tokens per row (EOS disabled: `min_new_tokens` for transformers, no EOS id for
ours), from left-padded prompts of mixed lengths. After a warm-up, the two run alternately
`--repeats` times so machine load hits both alike; the median of each is reported.

    python benchmarks/rollout_vs_hf.py                      # tiny (~1M) and small (~5M) presets
    python benchmarks/rollout_vs_hf.py --presets tiny --repeats 3

Last line: `bench rollout_vs_hf: ours_tok_s=... hf_tok_s=... ratio=...` for the first preset, then
the same three keys prefixed with each further preset's name.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


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


def bench_preset(preset: str, args, workdir: Path) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    from verl.workers.rollout.native.engine import GenerationEngine
    from verl.workers.rollout.sampling import SamplingParams

    path = model_dir(preset, workdir)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = GenerationEngine.from_model(path, device="cpu", dtype=torch.float32)
    input_ids, attention_mask = prompts(args.batch, hf_model.config.vocab_size, args.prompt_len // 2, args.prompt_len)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    new_tokens = args.new_tokens
    sampling = SamplingParams(do_sample=True, temperature=1.0)

    def ours():
        out = engine.generate(input_ids, attention_mask, new_tokens, sampling, eos_token_id=None, pad_token_id=0)
        assert out.responses.shape == (args.batch, new_tokens)

    def hf():
        with torch.no_grad():
            out = hf_model.generate(
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        assert out.shape == (args.batch, input_ids.shape[1] + new_tokens)

    runs = {"ours": [], "hf": []}
    for _ in range(args.warmup):
        ours()
        hf()
    for _ in range(args.repeats):
        for name, fn in (("ours", ours), ("hf", hf)):
            start = time.perf_counter()
            fn()
            runs[name].append(args.batch * new_tokens / (time.perf_counter() - start))
    ours_tok_s, hf_tok_s = statistics.median(runs["ours"]), statistics.median(runs["hf"])
    params = sum(p.numel() for p in hf_model.parameters())
    print(
        f"{preset}: {params / 1e6:.2f}M params, batch {args.batch}, prompt <= {args.prompt_len}, {new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, native={engine.is_native}: ours {ours_tok_s:,.0f} tok/s, "
        f"hf {hf_tok_s:,.0f} tok/s, ratio {ours_tok_s / hf_tok_s:.2f}"
    )
    return ours_tok_s, hf_tok_s


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small", help="comma-separated verl.models presets")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16, help="longest prompt; others are down to half")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    fields = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, preset in enumerate(args.presets.split(",")):
            ours_tok_s, hf_tok_s = bench_preset(preset, args, Path(tmp))
            prefix = "" if i == 0 else f"{preset}_"
            fields += [
                f"{prefix}ours_tok_s={ours_tok_s:.0f}",
                f"{prefix}hf_tok_s={hf_tok_s:.0f}",
                f"{prefix}ratio={ours_tok_s / hf_tok_s:.2f}",
            ]
    print("bench rollout_vs_hf: " + " ".join(fields))


if __name__ == "__main__":
    main()
