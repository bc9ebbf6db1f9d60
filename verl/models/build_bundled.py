"""Rebuild the bundled `verl/assets/arith-tiny` model from scratch.

    python -m verl.models.build_bundled                 # writes verl/assets/arith-tiny
    python -m verl.models.build_bundled --out /tmp/arith-tiny --seed 2

Recipe: a freshly initialised `tiny` preset (Qwen2, ~1M parameters, seed 1) is fine-tuned in one
process by the plain loop below on the default arithmetic task (2-digit addition, 5000 training
problems, data seed 0): batch 64 drawn from a seeded shuffle, left-padded chat-template prompts,
cross-entropy on the answer tokens (digits + eos) only, AdamW lr 1e-3 (betas 0.9/0.999, no weight
decay, no gradient clipping), constant schedule, one CPU thread. Every `--eval-every` steps from
`--eval-from` the held-out greedy accuracy on the 500 test problems is measured, and training
stops at the first evaluation inside [`--min-accuracy`, `--max-accuracy`] (default 25%-50%).

Why stop early: the RL examples start from this checkpoint and must have room to show learning.
SFT on this task jumps from ~10% to over 90% within ~100 steps, so the band is caught by
evaluating often rather than by fixing a step count.

Why a plain loop and not `verl.trainer.fsdp_sft_trainer` (which has its own tests): GRPO learns
this task from a checkpoint only as fast as the checkpoint's *sampled* answers are right, and
checkpoints stopped at the same greedy accuracy differ a lot there. Measured with the minimal GRPO
loop of `benchmarks/overhead_vs_minimal.py` (32 prompts x 8 samples, lr 1e-4): this recipe's
checkpoint went 28.8% -> 53% greedy accuracy in 50 RL steps, while checkpoints from the SFT
trainer's defaults (gradient clipping at 1.0; lr 1e-3 or 3e-4) started at 25.6% and 29.0% greedy
but 19.6% and 8.8% sampled accuracy and reached only 30% and 27% after 50-60 RL steps.
One thread and seeded everything make the build deterministic on a given torch version.
The result, its accuracy history and the exact settings are written to `training_info.json`
beside the weights, and `README.md` there repeats how to reproduce it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

TRAIN_BATCH_SIZE = 64
LEARNING_RATE = 1e-3


def _encode_sft_batch(tokenizer, rows: list[dict]):
    """Left-padded (input_ids, labels, attention_mask): labels are -100 except on the answer + eos."""
    import torch

    ids, labels = [], []
    for row in rows:
        prompt = tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"]
        answer_ids = answer_ids + [tokenizer.eos_token_id]
        ids.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    width = max(map(len, ids))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in ids])
    label_ids = torch.tensor([[-100] * (width - len(x)) + x for x in labels])
    starts = torch.tensor([width - len(x) for x in ids])
    attention_mask = (torch.arange(width)[None] >= starts[:, None]).long()
    return input_ids, label_ids, attention_mask


def build(
    out_dir: str,
    seed: int = 1,
    data_seed: int = 0,
    min_accuracy: float = 0.25,
    max_accuracy: float = 0.50,
    eval_every: int = 10,
    eval_from: int = 100,
    max_steps: int = 3000,
) -> dict:
    """Train, stop inside the accuracy band, save the model to `out_dir` and return the training info."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.models.factory import get_preset, make_tiny
    from verl.utils.dataset.arith import (
        DEFAULT_NUM_TEST,
        DEFAULT_NUM_TRAIN,
        evaluate_greedy_accuracy,
        load_rows,
        write_arith_parquet,
    )

    if not 0.0 <= min_accuracy < max_accuracy <= 1.0:
        raise ValueError(f"need 0 <= --min-accuracy ({min_accuracy}) < --max-accuracy ({max_accuracy}) <= 1")
    # One thread: the float reduction order, hence the exact checkpoint, does not depend on the
    # machine's core count, and a busy machine does not stall OpenMP threads waiting on each other.
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="verl-build-arith-tiny-")
    start = time.time()
    init_dir = make_tiny("tiny", os.path.join(work, "init"), seed=seed)
    train_path, test_path = write_arith_parquet(os.path.join(work, "data"), seed=data_seed)
    train_rows, test_rows = load_rows(train_path), load_rows(test_path)

    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    model = AutoModelForCausalLM.from_pretrained(init_dir)
    torch.manual_seed(seed)
    order_rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.999), weight_decay=0.0)
    history: list[dict] = []
    step = 0
    done = False
    while not done and step < max_steps:
        order = list(range(len(train_rows)))
        order_rng.shuffle(order)
        for first in range(0, len(order) - TRAIN_BATCH_SIZE + 1, TRAIN_BATCH_SIZE):
            batch = [train_rows[i] for i in order[first : first + TRAIN_BATCH_SIZE]]
            input_ids, labels, attention_mask = _encode_sft_batch(tokenizer, batch)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            loss = model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels
            ).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step >= eval_from and step % eval_every == 0:
                accuracy = evaluate_greedy_accuracy(model, tokenizer, test_rows)
                history.append({"step": step, "heldout_greedy_accuracy": accuracy})
                print(f"step {step}: loss {loss.item():.3f}, held-out greedy accuracy {accuracy:.1%}", flush=True)
                if accuracy > max_accuracy:
                    raise RuntimeError(
                        f"held-out accuracy jumped past the band to {accuracy:.1%} at step {step}; rebuild with a "
                        f"smaller --eval-every (now {eval_every}) so an evaluation lands inside "
                        f"[{min_accuracy:.0%}, {max_accuracy:.0%}]"
                    )
                if accuracy >= min_accuracy:
                    done = True
                    break
            if step >= max_steps:
                break
    if not done:
        raise RuntimeError(f"no evaluation reached {min_accuracy:.0%} within {max_steps} steps; raise --max-steps")

    export = os.path.join(work, "export")
    model.save_pretrained(export)
    tokenizer.save_pretrained(export)
    # Measure what users will measure: the exported directory, loaded fresh.
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    accuracy = evaluate_greedy_accuracy(model, tokenizer, test_rows)

    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    shutil.copytree(export, out_dir)
    info = {
        "name": "arith-tiny",
        "heldout_greedy_accuracy": accuracy,
        "heldout_problems": len(test_rows),
        "sft_steps": step,
        "accuracy_history": history,
        "model": {"preset": "tiny", "init_seed": seed, **vars(get_preset("tiny"))},
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": {
            "task": "2-digit addition, operands 10-99, plain 'What is a+b?' prompts",
            "num_train": DEFAULT_NUM_TRAIN,
            "num_test": DEFAULT_NUM_TEST,
            "seed": data_seed,
            "order_seed": seed,
        },
        "sft": {
            "trainer": "plain single-process loop (verl.models.build_bundled)",
            "train_batch_size": TRAIN_BATCH_SIZE,
            "optimizer": "AdamW",
            "lr": LEARNING_RATE,
            "betas": [0.9, 0.999],
            "weight_decay": 0.0,
            "grad_clip": None,
            "lr_scheduler": "constant",
            "loss": "cross-entropy on answer tokens (digits + <eos>) only",
            "stop_rule": f"first evaluation (every {eval_every} steps from step {eval_from}) with held-out greedy "
            f"accuracy in [{min_accuracy}, {max_accuracy}]",
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "torch_threads": 1,
        "build_seconds": round(time.time() - start, 1),
        "reproduce": "python -m verl.models.build_bundled  (or examples/sft/build_arith_tiny.sh)",
    }
    with open(os.path.join(out_dir, "training_info.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(_readme(info))
    shutil.rmtree(work, ignore_errors=True)
    return info


def _readme(info: dict) -> str:
    return f"""# arith-tiny

A {info["parameters"]:,}-parameter Qwen2 model (hidden 128, 4 layers, 2 heads of 64, tied embeddings,
byte-level tokenizer without merges) fine-tuned on 2-digit addition by the plain SFT loop of `verl.models.build_bundled`.
It is the starting point of every quickstart and test: good enough to answer some problems, far from
perfect, so reinforcement learning has room to show learning.

- Held-out greedy accuracy: **{info["heldout_greedy_accuracy"]:.1%}** on the {info["heldout_problems"]} test problems of
  the default arithmetic task (`verl.utils.dataset.arith.ensure_arith_data()`), first integer of the
  completion against the ground truth.
- SFT: {info["sft_steps"]} steps of batch {info["sft"]["train_batch_size"]}, AdamW lr {info["sft"]["lr"]}, constant schedule, no gradient
  clipping, loss on the answer tokens only; stopped at the first evaluation inside the target accuracy
  band. Why this recipe: the module docstring of `verl/models/build_bundled.py`.
- Prompt format: `<bos><|user|>What is 37+48?<|assistant|>`; expected completion `85<eos>`.

Load it with `verl.models.bundled_model_path("arith-tiny")` and the usual
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` (offline).

Reproduce from scratch (one CPU thread; this build took {info["build_seconds"]:.0f} s on a shared machine):

```bash
python -m verl.models.build_bundled        # or: bash examples/sft/build_arith_tiny.sh
```

`training_info.json` records the settings, the accuracy at each evaluation and the library versions.
"""


def main(argv: list[str] | None = None) -> None:
    from verl.models import ASSETS_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ASSETS_DIR, "arith-tiny"), help="output model directory")
    parser.add_argument("--seed", type=int, default=1, help="model initialisation and data-order seed")
    parser.add_argument("--data-seed", type=int, default=0, help="arithmetic task seed (0 = the default task)")
    parser.add_argument("--min-accuracy", type=float, default=0.25)
    parser.add_argument("--max-accuracy", type=float, default=0.50)
    parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    parser.add_argument("--eval-from", type=int, default=100, help="first step to evaluate at")
    parser.add_argument("--max-steps", type=int, default=3000)
    args = parser.parse_args(argv)
    info = build(
        args.out,
        seed=args.seed,
        data_seed=args.data_seed,
        min_accuracy=args.min_accuracy,
        max_accuracy=args.max_accuracy,
        eval_every=args.eval_every,
        eval_from=args.eval_from,
        max_steps=args.max_steps,
    )
    print(
        f"wrote {args.out}: held-out greedy accuracy {info['heldout_greedy_accuracy']:.1%} after {info['sft_steps']} "
        f"SFT steps ({info['build_seconds']} s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
