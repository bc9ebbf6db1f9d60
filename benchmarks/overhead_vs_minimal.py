"""Seconds per GRPO step: the whole framework against a minimal single-process loop (issue #9).

`ours` is `python -m verl.trainer.main_ppo` run as a subprocess: Ray driver, a 2-rank worker group
(FSDP2 over gloo, one CPU thread each), the built-in rollout engine with a weight sync per step,
the reward manager, driver-side advantages. Its seconds per step are `timing_s/step` read back
from the file logger's metrics.jsonl (validation and checkpointing are off, so they are not in it).

`minimal` is the same algorithm written out in one process (`MinimalGRPO` below, ~80 lines): the
bundled model, 32 prompts x 8 samples, at most 8 new tokens, temperature 1, the 0/1 `arith`
scorer of `verl.utils.reward_score`, group-normalised advantages (unbiased std, eps 1e-6),
token-mean policy-gradient loss (on-policy, so the PPO ratio is 1), grad-norm clip 1, one AdamW
step per batch (lr 1e-4, weight decay 0.01), no KL, no step for a batch whose advantages are all
zero. It generates with our engine (`verl.workers.rollout.native.engine.GenerationEngine`, its
weights copied from the model after each update) or with transformers' `generate()`
(`--generate hf`), and uses as many torch threads as the framework has worker processes (2), so
both use the same cores. The ratio ours/minimal is the framework's overhead; the issue's goal is
at most 1.25.

The same loop also measures learning: `--curve STEPS` trains the minimal loop for STEPS steps and
prints the held-out greedy accuracy on the 500 test problems every `--eval-every` steps. That is
how the slow learning of the default run was traced (docs/benchmarks.md).

Run:
    python benchmarks/overhead_vs_minimal.py                       # 2 warm-up + 10 timed steps each
    python benchmarks/overhead_vs_minimal.py --steps 50            # longer
    python benchmarks/overhead_vs_minimal.py --curve 60 --eval-every 20 --lr 1e-4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from verl.utils.device import get_device, synchronize
from verl.utils.machine import bench_headline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MinimalGRPO:
    """GRPO on the arithmetic task in one process, with nothing but torch and transformers."""

    def __init__(
        self,
        model_path: str,
        train_rows: list[dict],
        batch_size: int = 32,
        n: int = 8,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        generate: str = "engine",
        seed: int = 1,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        self.rows = train_rows
        self.order: list[int] = []
        self.batch_size, self.n, self.max_new_tokens, self.temperature = batch_size, n, max_new_tokens, temperature
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.device = get_device()
        self.model = AutoModelForCausalLM.from_pretrained(model_path).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.generate_with = generate
        self.engine = None
        if generate == "engine":
            from verl.workers.rollout.native.engine import GenerationEngine

            self.engine = GenerationEngine.from_model(self.model, device=self.device, dtype="auto")
        elif generate != "hf":
            raise ValueError(f"--generate {generate!r} is not one of engine, hf")

    def _next_rows(self) -> list[dict]:
        if len(self.order) < self.batch_size:  # a new epoch, reshuffled
            self.order = list(range(len(self.rows)))
            self.rng.shuffle(self.order)
        picked, self.order = self.order[: self.batch_size], self.order[self.batch_size :]
        return [self.rows[i] for i in picked]

    def _prompts(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        texts = [
            self.tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
            for row in rows
            for _ in range(self.n)
        ]
        enc = self.tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        return {key: value.to(self.device) for key, value in enc.items()}

    @torch.no_grad()
    def _sample(self, enc: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(responses [B, R], response_mask [B, R]): the mask is 1 up to and including the first EOS."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if self.engine is not None:
            from verl.workers.rollout.sampling import SamplingParams

            sampling = SamplingParams(do_sample=True, temperature=self.temperature, top_k=-1, top_p=1.0)
            out = self.engine.generate(enc["input_ids"], enc["attention_mask"], self.max_new_tokens, sampling, eos, pad)
            return out.responses, out.response_mask
        self.model.eval()
        out = self.model.generate(
            **enc,
            max_new_tokens=self.max_new_tokens,
            do_sample=True,
            temperature=self.temperature,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        responses = out[:, enc["input_ids"].shape[1] :]
        responses = torch.nn.functional.pad(responses, (0, self.max_new_tokens - responses.shape[1]), value=pad)
        is_eos = (responses == eos).long()
        mask = ((is_eos.cumsum(-1) - is_eos) == 0).long()
        return responses.masked_fill(mask == 0, pad), mask

    def step(self) -> dict[str, float]:
        """One GRPO step; returns the phase seconds and the mean sampled reward."""
        from verl.utils.reward_score import default_compute_score

        timing = {}
        start = time.perf_counter()
        rows = self._next_rows()
        enc = self._prompts(rows)
        responses, mask = self._sample(enc)
        synchronize()
        timing["gen"] = time.perf_counter() - start

        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        truths = [row["reward_model"]["ground_truth"] for row in rows for _ in range(self.n)]
        scores = torch.tensor([default_compute_score("arith", t, g) for t, g in zip(texts, truths)], device=self.device)
        groups = scores.view(-1, self.n)
        advantages = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)).view(-1)
        timing["reward_adv"] = time.perf_counter() - start - timing["gen"]

        if (advantages != 0).any():  # an all-zero batch has zero gradient, but AdamW would still move
            self.model.train()
            prompt_len = enc["input_ids"].shape[1]
            input_ids = torch.cat([enc["input_ids"], responses], dim=-1)
            attention_mask = torch.cat([enc["attention_mask"], mask], dim=-1)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            logits = logits[:, prompt_len - 1 : -1].float() / self.temperature
            log_probs = logits.log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)
            loss = -(advantages[:, None] * log_probs * mask).sum() / mask.sum()
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            if self.engine is not None:
                self.engine.update_weights(self.model.state_dict().items())
        synchronize()
        timing["step"] = time.perf_counter() - start
        timing["update"] = timing["step"] - timing["gen"] - timing["reward_adv"]
        return {**timing, "reward": float(scores.mean())}


def run_minimal(args, train_rows) -> list[float]:
    loop = MinimalGRPO(
        args.model, train_rows, args.batch_size, args.n, args.max_new_tokens, lr=args.lr, generate=args.generate
    )
    seconds, phases = [], {}
    for i in range(args.warmup + args.steps):
        out = loop.step()
        if i >= args.warmup:
            seconds.append(out["step"])
            for key in ("gen", "reward_adv", "update"):
                phases.setdefault(key, []).append(out[key])
    print("minimal phases (mean s): " + " ".join(f"{k}={statistics.mean(v):.3f}" for k, v in phases.items()))
    return seconds


def run_ours(args) -> list[float]:
    """Train with main_ppo in a subprocess and return timing_s/step of the timed steps."""
    with tempfile.TemporaryDirectory(prefix="verl-overhead-") as work:
        run_dir = os.path.join(work, "run")
        overrides = [
            f"actor_rollout_ref.model.path={args.model}",
            f"data.train_batch_size={args.batch_size}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch_size}",
            # one micro-batch per rank, as the yaml default
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch_size * args.n // 2}",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"data.max_response_length={args.max_new_tokens}",
            "actor_rollout_ref.rollout.temperature=1.0",
            f"actor_rollout_ref.actor.optim.lr={args.lr}",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
            "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "trainer.n_gpus_per_node=2",
            f"trainer.total_training_steps={args.warmup + args.steps}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            "trainer.logger=[file]",
            "trainer.progress_bar=false",
            f"trainer.run_dir={run_dir}",
            f"trainer.default_local_dir={os.path.join(work, 'checkpoints')}",
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name=arith_demo", *overrides],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"main_ppo failed with exit status {proc.returncode}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    steps = sorted((r for r in records if "timing_s/step" in r["data"]), key=lambda r: r["step"])
    timed = steps[args.warmup :]
    phases = ("gen", "reward", "update_actor", "update_weights", "generate_sequences")
    means = {p: statistics.mean(r["data"].get(f"timing_s/{p}", 0.0) for r in timed) for p in phases}
    print(f"ours: {wall:.1f} s wall for {len(steps)} steps including start-up")
    print("ours phases (mean s): " + " ".join(f"{k}={v:.3f}" for k, v in means.items()))
    return [r["data"]["timing_s/step"] for r in timed]


def run_curve(args, train_rows, test_rows) -> None:
    from verl.utils.dataset.arith import evaluate_greedy_accuracy

    loop = MinimalGRPO(
        args.model, train_rows, args.batch_size, args.n, args.max_new_tokens, lr=args.lr, generate=args.generate
    )
    start = time.perf_counter()
    accuracy = evaluate_greedy_accuracy(loop.model, loop.tokenizer, test_rows)
    print(f"step 0: held-out greedy accuracy {accuracy:.3f}", flush=True)
    rewards = []
    for step in range(1, args.curve + 1):
        rewards.append(loop.step()["reward"])
        if step % args.eval_every == 0 or step == args.curve:
            accuracy = evaluate_greedy_accuracy(loop.model, loop.tokenizer, test_rows)
            print(
                f"step {step}: held-out greedy accuracy {accuracy:.3f}, mean sampled reward "
                f"{statistics.mean(rewards):.3f}, {time.perf_counter() - start:.0f} s",
                flush=True,
            )
            rewards = []
    print(bench_headline("overhead_vs_minimal_curve", f"steps={args.curve} lr={args.lr} final_accuracy={accuracy:.3f}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--generate", choices=("engine", "hf"), default="engine", help="the minimal loop's generator")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the minimal loop (= worker count)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--model", default=os.path.join(REPO, "verl", "assets", "arith-tiny"))
    parser.add_argument("--curve", type=int, default=0, help="only train the minimal loop this many steps, evaluating")
    parser.add_argument("--eval-every", type=int, default=20)
    args = parser.parse_args()

    from verl.utils.dataset.arith import ensure_arith_data, load_rows

    torch.set_num_threads(args.threads)
    train_path, test_path = ensure_arith_data()
    train_rows = load_rows(train_path)
    if args.curve:
        run_curve(args, train_rows, load_rows(test_path))
        return

    ours = run_ours(args)
    minimal = run_minimal(args, train_rows)
    print("ours s/step:    " + " ".join(f"{s:.3f}" for s in ours))
    print("minimal s/step: " + " ".join(f"{s:.3f}" for s in minimal) + f"  (generation: {args.generate})")
    # Medians: a shared machine's load spikes hit single steps, and the median ignores them.
    ours_s, minimal_s = statistics.median(ours), statistics.median(minimal)
    print(f"means: ours {statistics.mean(ours):.3f} s, minimal {statistics.mean(minimal):.3f} s")
    print(
        bench_headline(
            "overhead_vs_minimal",
            f"ours_s_per_step={ours_s:.3f} minimal_s_per_step={minimal_s:.3f} "
            f"ratio={ours_s / minimal_s:.2f} minimal_generate={args.generate}",
        )
    )


if __name__ == "__main__":
    main()
