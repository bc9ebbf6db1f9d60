"""Build `verl/assets/arith-tool-tiny`: the bundled tiny model taught to call the calculator.

    python -m verl.models.build_bundled_tool                 # one stage from arith-tiny, default flags
    python -m verl.models.build_bundled_tool --out /tmp/arith-tool-tiny

A stage: start from a model (`--init`, default the bundled `arith-tiny`, 2-digit addition) and
fine-tune it with verl's FSDP2 SFT trainer (one process, one CPU thread) on perfect calculator
transcripts of the calculator task (`verl.utils.dataset.arith_tool`: "What is 12+34*56?" -> tool
call -> `1916` -> "1916"), in the multi-turn SFT format, loss on the assistant turns only. Every
`--eval-every` steps the greedy multi-turn accuracy on the first `--eval-problems` test problems is
measured by running the real agent loop (built-in engine + calculator) and training stops at the
first evaluation inside [`--min-accuracy`, `--max-accuracy`].

The shipped model took two stages (its `training_info.json` holds both, and its README the two
commands): the defaults (15%-50%) teach the protocol but stop at ~16%, where the model still
miscopies most expressions and answers and GRPO barely moves it; a second stage from there with a
fresh data order (`--seed 2`, band 45%-85%) stops at ~50%, where GRPO improves the copying within
minutes (docs/multi_turn.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

TRAIN_BATCH_SIZE = 64
LEARNING_RATE = 1e-3
MAX_LENGTH = 160


def evaluate_tool_use(model, tokenizer, rows: list[dict], response_length: int = 160, prompt_length: int = 32) -> dict:
    """Greedy multi-turn episodes with the calculator on `rows`; returns accuracy (final answer),
    the fraction of episodes that called the tool, and the mean number of turns.

    `model` is an HF causal LM (its current weights are used) or a checkpoint directory.
    """
    import numpy as np
    import torch

    from verl.experimental.agent_loop import AgentLoopRollout
    from verl.protocol import DataProto
    from verl.tools.calculator_tool import CalculatorTool
    from verl.utils.reward_score.arith import compute_score_after_tools
    from verl.workers.config import AgentLoopConfig, MultiTurnConfig, RolloutConfig
    from verl.workers.rollout.hf_rollout import HFRollout

    # one engine per process, the weights' own dtype on CPU, the tool loop for every row (rows name none)
    config = RolloutConfig(
        name="hf",
        response_length=response_length,
        prompt_length=prompt_length,
        tensor_model_parallel_size=1,
        dtype="auto",
        multi_turn=MultiTurnConfig(enable=True),
        agent=AgentLoopConfig(default_agent_loop="tool_agent"),
    )
    engine = HFRollout(model, config=config, tokenizer=tokenizer, device="cpu")
    rollout = AgentLoopRollout(engine, config, tokenizer, tools=[CalculatorTool()])
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for r in rows
    ]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    raw = np.empty(len(rows), dtype=object)
    raw[:] = [list(r["prompt"]) for r in rows]
    batch = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"raw_prompt": raw},
        meta_info={"do_sample": False, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
    )
    out = rollout.generate_sequences(batch)
    attended = out.batch["attention_mask"][:, width:].bool()
    texts = tokenizer.batch_decode(
        [out.batch["responses"][i][attended[i]].tolist() for i in range(len(rows))], skip_special_tokens=True
    )
    scores = [compute_score_after_tools(t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, rows)]
    turns = out.non_tensor_batch["__num_turns__"].astype(float)
    return {"accuracy": float(np.mean(scores)), "tool_use": float(np.mean(turns > 2)), "num_turns": float(turns.mean())}


def _training_info(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "training_info.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _stages(info: dict) -> list[dict]:
    """The stages that built a model, first first (each stage's info names the one before it)."""
    chain = []
    while info:
        chain.append(info)
        info = info.get("previous")
    return chain[::-1]


def _plain_copy(fsdp_model):
    """A plain HF model holding the (one-rank FSDP) model's current weights, for evaluation."""
    from transformers import AutoModelForCausalLM

    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in fsdp_model.state_dict().items()}
    model = AutoModelForCausalLM.from_config(fsdp_model.config)
    model.load_state_dict(state)
    return model.eval()


def build(
    out_dir: str,
    init: str | None = None,
    seed: int = 1,
    min_accuracy: float = 0.15,
    max_accuracy: float = 0.50,
    eval_every: int = 20,
    eval_from: int = 300,
    eval_problems: int = 200,
    max_steps: int = 3000,
    reproduce_flags: list[str] | None = None,
) -> dict:
    """Train, stop inside the accuracy band, save the model to `out_dir` and return the training info."""
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.models import bundled_model_path
    from verl.trainer.fsdp_sft_config import sft_config
    from verl.trainer.fsdp_sft_trainer import run_sft
    from verl.utils.dataset.arith import _write_parquet_atomic, load_rows
    from verl.utils.dataset.arith_tool import DEFAULT_NUM_TRAIN, TASK, write_arith_tool_parquet

    if not 0.0 <= min_accuracy < max_accuracy <= 1.0:
        raise ValueError(f"need 0 <= --min-accuracy ({min_accuracy}) < --max-accuracy ({max_accuracy}) <= 1")
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="verl-build-arith-tool-tiny-")
    start = time.time()
    train_path, test_path = write_arith_tool_parquet(os.path.join(work, "data"))
    eval_rows = load_rows(test_path)[:eval_problems]
    # the trainer consults the stop rule after each validation; a small validation file keeps that cheap
    val_path = os.path.join(work, "data", "val.parquet")
    _write_parquet_atomic(eval_rows[:TRAIN_BATCH_SIZE], val_path)

    config = sft_config(
        [
            f"data.train_files={train_path}",
            f"data.val_files={val_path}",
            f"data.train_batch_size={TRAIN_BATCH_SIZE}",
            f"data.micro_batch_size_per_gpu={TRAIN_BATCH_SIZE}",
            "data.multiturn.enable=true",
            "data.multiturn.messages_key=messages",
            f"data.max_length={MAX_LENGTH}",
            f"model.partial_pretrain={init or bundled_model_path('arith-tiny')}",
            f"optim.lr={LEARNING_RATE}",
            "optim.betas=[0.9,0.999]",
            "optim.weight_decay=0.0",
            "optim.lr_warmup_steps_ratio=0.0",
            "optim.lr_scheduler=constant",
            f"trainer.default_local_dir={os.path.join(work, 'checkpoints')}",
            f"trainer.total_training_steps={max_steps}",
            f"trainer.test_freq={eval_every}",
            "trainer.resume_mode=disable",
            f"trainer.seed={seed}",
            "trainer.device=cpu",
        ],
        demo=True,
    )
    history: list[dict] = []

    def in_band(trainer, step: int) -> bool:
        if step < eval_from:
            return False
        result = evaluate_tool_use(_plain_copy(trainer.model), trainer.tokenizer, eval_rows)
        history.append({"step": step, **result})
        print(f"step {step}: {result}", flush=True)
        if result["accuracy"] > max_accuracy:
            raise RuntimeError(
                f"accuracy jumped past the band to {result['accuracy']:.1%} at step {step}; rebuild with a smaller "
                f"--eval-every (now {eval_every}) so an evaluation lands inside [{min_accuracy:.0%}, {max_accuracy:.0%}]"
            )
        return result["accuracy"] >= min_accuracy

    trainer = run_sft(config, should_stop=in_band)
    steps = trainer.global_step
    dist.destroy_process_group()
    if not history or history[-1]["accuracy"] < min_accuracy:
        raise RuntimeError(f"no evaluation reached {min_accuracy:.0%} within {max_steps} steps; raise --max-steps")
    export = os.path.join(work, "checkpoints", f"global_step_{steps}", "huggingface")

    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    final = evaluate_tool_use(model, tokenizer, load_rows(test_path))

    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    shutil.copytree(export, out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # arith-tiny's, byte for byte
        source = os.path.join(bundled_model_path("arith-tiny"), name)
        if os.path.exists(source):
            shutil.copy(source, os.path.join(out_dir, name))
    info = {
        "name": "arith-tool-tiny",
        "heldout": {**final, "problems": len(load_rows(test_path)), "decoding": "greedy, calculator tool"},
        "sft_steps": steps,
        "history": history,
        "start": init or "arith-tiny",
        "previous": _training_info(init) if init else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": {"task": f"{TASK}", "num_train": DEFAULT_NUM_TRAIN, "format": "multi-turn transcripts (messages)"},
        "sft": {
            "train_batch_size": TRAIN_BATCH_SIZE,
            "optimizer": "AdamW",
            "lr": LEARNING_RATE,
            "lr_scheduler": "constant",
            "loss": "cross-entropy on the assistant turns (tool call, final answer) only",
            "stop_rule": f"first evaluation (every {eval_every} steps from step {eval_from}, first {eval_problems} "
            "test problems) with "
            f"greedy multi-turn accuracy in [{min_accuracy}, {max_accuracy}]",
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "torch_threads": 1,
        "build_seconds": round(time.time() - start, 1),
        "reproduce": " ".join(["python -m verl.models.build_bundled_tool", *(reproduce_flags or [])]),
    }
    with open(os.path.join(out_dir, "training_info.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(_readme(info))
    shutil.rmtree(work, ignore_errors=True)
    return info


def _readme(info: dict) -> str:
    h = info["heldout"]
    stages = _stages(info)
    commands, steps = [], []
    for i, stage in enumerate(stages, start=1):
        # the recorded command holds the stage's own flags; the model paths are chained here
        command = stage.get("reproduce", "python -m verl.models.build_bundled_tool")
        if i > 1:
            command += f" --init /tmp/arith-tool-tiny-stage{i - 1}"
        if i < len(stages):
            command += f" --out /tmp/arith-tool-tiny-stage{i}"
        commands.append(command)
        steps.append(str(stage["sft_steps"]))
    seconds = sum(stage["build_seconds"] for stage in stages)
    return f"""# arith-tool-tiny

The bundled `arith-tiny` model ({info["parameters"]:,} parameters) fine-tuned to use the calculator
tool on two-operation arithmetic ("What is 12+34*56?"), the multi-turn example of docs/multi_turn.md:

    <bos><|user|>What is 12+34*56?<|assistant|><tool_call>{{"name": "calculator", "arguments": {{"expression": "12+34*56"}}}}</tool_call><eos>
    <|user|><tool_response>1916</tool_response><|assistant|>1916<eos>

- Greedy multi-turn accuracy with the calculator: **{h["accuracy"]:.1%}** on the {h["problems"]} test problems
  (`verl.utils.dataset.arith_tool`), calling the tool in {h["tool_use"]:.0%} of them. Without the tool the
  task is out of reach for a model this size; the errors are miscopied expressions and answers.
- SFT in {len(stages)} stage(s) of {" + ".join(steps)} steps, batch {info["sft"]["train_batch_size"]}, AdamW lr
  {info["sft"]["lr"]}, loss on the assistant turns only; each stage stopped at its first evaluation inside
  its accuracy band (`training_info.json`: `history`, and `previous` for the stage before).

Reproduce (one CPU thread; the stages took {seconds:.0f} s in all on a shared machine):

```bash
{chr(10).join(commands)}
```
"""


def main(argv: list[str] | None = None) -> None:
    from verl.models import ASSETS_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ASSETS_DIR, "arith-tool-tiny"), help="output model directory")
    parser.add_argument("--init", default=None, help="model to fine-tune (default: the bundled arith-tiny)")
    parser.add_argument("--seed", type=int, default=1, help="data-order seed")
    parser.add_argument("--min-accuracy", type=float, default=0.15)
    parser.add_argument("--max-accuracy", type=float, default=0.50)
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    parser.add_argument("--eval-from", type=int, default=300, help="first step to evaluate at")
    parser.add_argument("--eval-problems", type=int, default=200, help="test problems per evaluation")
    parser.add_argument("--max-steps", type=int, default=3000)
    args = parser.parse_args(argv)
    info = build(
        args.out,
        init=args.init,
        seed=args.seed,
        min_accuracy=args.min_accuracy,
        max_accuracy=args.max_accuracy,
        eval_every=args.eval_every,
        eval_from=args.eval_from,
        eval_problems=args.eval_problems,
        max_steps=args.max_steps,
        reproduce_flags=[  # the flags that differ from their defaults; the model paths are chained in the README
            f"--{dest.replace('_', '-')} {value}"
            for dest, value in vars(args).items()
            if dest not in ("out", "init") and value != parser.get_default(dest)
        ],
    )
    print(
        f"wrote {args.out}: greedy accuracy with the calculator {info['heldout']['accuracy']:.1%} after "
        f"{info['sft_steps']} SFT steps ({info['build_seconds']} s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
