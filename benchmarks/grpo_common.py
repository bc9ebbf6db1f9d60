"""Shared set-up of the benchmarks that run our GRPO and TRL's `GRPOTrainer` side by side (issue #9).

`grpo_vs_trl.py` (throughput) and `time_to_accuracy.py` (learning speed) both train the bundled
`verl/assets/arith-tiny` model on the arithmetic parquet with the same hyper-parameters on both
sides; this module holds what they share so the two sides cannot drift apart:

- `GRPOSetup`: the hyper-parameters, one value per knob, handed to both sides. `add_setup_args`
  makes a flag for each whose default is read from `verl/trainer/config/arith_demo.yaml` (the bundled demo config) at run
  time, so the comparison follows our current defaults without editing this file.
- `ours_overrides` / `run_ours`: `python -m verl.trainer.main_ppo` as a subprocess with those
  values as Hydra overrides and the file logger on; its metrics.jsonl records are streamed back
  while it runs (`on_record` may stop the run early, e.g. once an accuracy threshold is reached).
- `trl_batch_args` / `make_trl_trainer`: TRL's batch knobs computed from the same batch, group size
  and mini-batch, and a `GRPOTrainer` on CPU (`use_cpu`, fp32, no vLLM, no gradient checkpointing).
- `ArithReward`: TRL's reward function, a wrapper of our `default_compute_score("arith", ...)`;
  it also counts the completion tokens TRL generated (TRL's own metrics are averaged per logging
  window, the reward function sees every completion exactly once).
- `TRLStepClock`: a `TrainerCallback` timing each optimizer step from one `on_step_end` to the next,
  with the time spent inside the callback's own `evaluate` hook left out.

How the knobs map (ours -> TRL):
- prompts per step `data.train_batch_size` x `rollout.n` completions = TRL's generation batch
  (`generation_batch_size = per_device_train_batch_size * steps_per_generation`, one process).
- prompts per optimizer step `actor.ppo_mini_batch_size` x n completions = TRL's
  `per_device_train_batch_size * gradient_accumulation_steps`. With mini-batch = batch there is
  exactly one optimizer step per generated batch on both sides. TRL's `global_step` counts
  optimizer steps; our `global_steps` counts generated batches.
- `actor.ppo_epochs` = `num_iterations`; `clip_ratio` = `epsilon`; `grad_clip` = `max_grad_norm`;
  `optim.weight_decay` = `weight_decay`; constant lr, no warm-up on both (`lr_scheduler_type`
  constant: TRL's default is a linear decay to zero); `entropy_coeff` = `entropy_coef`;
  KL: `use_kl_loss` + `kl_loss_coef` (low_var_kl) = `beta` (TRL's k3 estimator), 0 = off.
- loss aggregation: our `token-mean` over the mini-batch = TRL's `loss_type="dapo"` (sum over the
  tokens of the accumulation window divided by its token count).
- advantages: both normalise by the group's std (`scale_rewards="group"`); epsilons differ
  (ours 1e-6, TRL 1e-4), which only matters for groups with (near) zero spread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "verl", "assets", "arith-tiny")
DEMO_CONFIG = "arith_demo"  # the bundled demo config (verl/trainer/config/arith_demo.yaml) our runs start from


@dataclass
class GRPOSetup:
    """One GRPO configuration, applied to both our trainer and TRL's."""

    model: str = DEFAULT_MODEL
    batch_size: int = 32
    """Prompts per step (our data.train_batch_size)."""
    n: int = 8
    """Completions per prompt (group size: our rollout.n, TRL's num_generations)."""
    mini_batch_size: int = 32
    """Prompts per optimizer step (our actor.ppo_mini_batch_size)."""
    max_prompt_length: int = 32
    max_response_length: int = 8
    temperature: float = 1.0
    lr: float = 1e-4
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    """KL-to-reference loss coefficient; 0 turns the reference model off on both sides."""
    epochs: int = 1
    """Passes over each generated batch (our actor.ppo_epochs, TRL's num_iterations)."""
    seed: int = 1
    workers: int = 2
    """Our worker processes (trainer.n_gpus_per_node on CPU); TRL gets as many torch threads."""

    @property
    def completions_per_step(self) -> int:
        return self.batch_size * self.n


def _demo_config():
    """The demo config as main_ppo composes it, unresolved values resolved, unvalidated."""
    from omegaconf import OmegaConf

    from verl.trainer.config import compose_config

    cfg = compose_config(config_name=DEMO_CONFIG)
    OmegaConf.resolve(cfg)
    return cfg


def yaml_defaults() -> dict:
    """The `GRPOSetup` fields' current values in the demo config (read, never written)."""
    cfg = _demo_config()
    actor = cfg.actor_rollout_ref.actor
    return {
        "batch_size": int(cfg.data.train_batch_size),
        "n": int(cfg.actor_rollout_ref.rollout.n),
        "mini_batch_size": int(actor.ppo_mini_batch_size),
        "max_prompt_length": int(cfg.data.max_prompt_length),
        "max_response_length": int(cfg.data.max_response_length),
        "temperature": float(cfg.actor_rollout_ref.rollout.temperature),
        "lr": float(actor.optim.lr),
        "weight_decay": float(actor.optim.weight_decay),
        "grad_clip": float(actor.grad_clip),
        "clip_ratio": float(actor.clip_ratio),
        "entropy_coeff": float(actor.entropy_coeff),
        "kl_coef": float(actor.kl_loss_coef) if actor.use_kl_loss else 0.0,
        "epochs": int(actor.ppo_epochs),
        "seed": int(cfg.data.seed),
        "workers": int(cfg.trainer.n_gpus_per_node),
    }


def yaml_test_freq() -> int:
    """`trainer.test_freq` of the demo config: steps between validations."""
    return int(_demo_config().trainer.test_freq)


def add_setup_args(parser) -> None:
    """A flag per `GRPOSetup` field, defaulting to its current value in the demo config."""
    defaults = yaml_defaults()
    helps = {
        "batch_size": "prompts per step (data.train_batch_size)",
        "n": "completions per prompt (rollout.n / num_generations)",
        "mini_batch_size": "prompts per optimizer step (actor.ppo_mini_batch_size)",
        "max_prompt_length": "prompt tokens (data.max_prompt_length)",
        "max_response_length": "completion tokens (data.max_response_length / max_completion_length)",
        "temperature": "sampling temperature",
        "lr": "learning rate (constant, no warm-up)",
        "weight_decay": "AdamW weight decay",
        "grad_clip": "gradient-norm clip",
        "clip_ratio": "PPO clip ratio (TRL epsilon)",
        "entropy_coeff": "entropy bonus coefficient",
        "kl_coef": "KL loss coefficient, 0 = no reference model (TRL beta)",
        "epochs": "passes over each batch (actor.ppo_epochs / num_iterations)",
        "seed": "data order seed",
        "workers": "our worker processes; TRL gets this many torch threads",
    }
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model directory (default: the bundled arith-tiny)")
    for name, value in defaults.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=type(value), default=value, help=f"{helps[name]} (default: {value})")


def setup_from_args(args) -> GRPOSetup:
    return GRPOSetup(**{name: getattr(args, name) for name in asdict(GRPOSetup())})


# --------------------------------------------------------------------------------------------- ours
def ours_overrides(
    setup: GRPOSetup,
    work_dir: str,
    total_steps: int,
    test_freq: int = -1,
    val_before_train: bool = False,
) -> list[str]:
    """Hydra overrides for `main_ppo` that pin every `GRPOSetup` value; logs go to `<work_dir>/run`.

    The actor's micro-batch (a memory/speed knob with no effect on the maths) is the whole mini-batch
    of a rank (the yaml default for the default batch), as TRL's side runs its batch
    in one forward: on a model this small every extra micro-batch only adds FSDP gathers and reduces.
    """
    per_rank = max(1, setup.mini_batch_size * setup.n // setup.workers)  # main_ppo reports a bad split itself
    micro = per_rank
    return [
        f"actor_rollout_ref.model.path={setup.model}",
        f"data.train_batch_size={setup.batch_size}",
        f"data.max_prompt_length={setup.max_prompt_length}",
        f"data.max_response_length={setup.max_response_length}",
        f"data.seed={setup.seed}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={setup.mini_batch_size}",
        f"actor_rollout_ref.actor.ppo_epochs={setup.epochs}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.n={setup.n}",
        f"actor_rollout_ref.rollout.temperature={setup.temperature}",
        f"actor_rollout_ref.actor.optim.lr={setup.lr}",
        f"actor_rollout_ref.actor.optim.weight_decay={setup.weight_decay}",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "actor_rollout_ref.actor.optim.warmup_style=constant",
        f"actor_rollout_ref.actor.grad_clip={setup.grad_clip}",
        f"actor_rollout_ref.actor.clip_ratio={setup.clip_ratio}",
        f"actor_rollout_ref.actor.entropy_coeff={setup.entropy_coeff}",
        f"actor_rollout_ref.actor.use_kl_loss={'true' if setup.kl_coef > 0 else 'false'}",
        f"actor_rollout_ref.actor.kl_loss_coef={setup.kl_coef}",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "algorithm.norm_adv_by_std_in_grpo=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"trainer.n_gpus_per_node={setup.workers}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={total_steps}",
        f"trainer.val_before_train={'true' if val_before_train else 'false'}",
        f"trainer.test_freq={test_freq}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[file]",
        "trainer.progress_bar=false",
        f"trainer.run_dir={os.path.join(work_dir, 'run')}",
        f"trainer.default_local_dir={os.path.join(work_dir, 'checkpoints')}",
    ]


@dataclass
class OursResult:
    records: list[dict]
    """metrics.jsonl records ({"step", "data"}) in file order."""
    wall_s: float
    """Subprocess wall time, start-up (Ray, model load) included."""
    stopped_early: bool


def run_ours(
    setup: GRPOSetup,
    total_steps: int,
    test_freq: int = -1,
    val_before_train: bool = False,
    on_record: Callable[[dict], bool] | None = None,
    poll_s: float = 0.5,
    repo: str = REPO,
) -> OursResult:
    """Run main_ppo in a fresh subprocess with its own local Ray cluster and return its metrics.

    `on_record(record)` sees each metrics.jsonl record as it is written; returning True stops the
    run (SIGINT to the driver, which shuts its own Ray cluster down; SIGKILL to its process group
    if it has not exited 60 s later). Only the subprocess this function started is signalled.
    `repo`: the source tree whose `verl` the run imports (default: this checkout).
    """
    with tempfile.TemporaryDirectory(prefix="verl-bench-") as work:
        overrides = ours_overrides(setup, work, total_steps, test_freq, val_before_train)
        metrics_path = os.path.join(work, "run", "metrics.jsonl")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
        env.pop("RAY_ADDRESS", None)  # a private local cluster, never somebody else's
        log_path = os.path.join(work, "main_ppo.log")
        records: list[dict] = []
        stopped = False
        start = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-name={DEMO_CONFIG}", *overrides],
                cwd=work,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: we can clean up exactly what we started
            )
            offset, pending = 0, ""
            try:
                while True:
                    done = proc.poll() is not None
                    if os.path.exists(metrics_path):
                        with open(metrics_path) as f:
                            f.seek(offset)
                            chunk = f.read()
                            offset = f.tell()
                        pending += chunk
                        *lines, pending = pending.split("\n")
                        for line in lines:
                            if line.strip():
                                records.append(json.loads(line))
                                if not stopped and on_record is not None and on_record(records[-1]):
                                    stopped = True
                                    proc.send_signal(signal.SIGINT)
                    if done:
                        break
                    if stopped:
                        try:
                            proc.wait(timeout=60)
                        except subprocess.TimeoutExpired:
                            os.killpg(proc.pid, signal.SIGKILL)
                            proc.wait()
                        continue
                    time.sleep(poll_s)
            except BaseException:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                raise
        wall = time.perf_counter() - start
        if proc.returncode != 0 and not stopped:
            with open(log_path) as f:
                sys.stderr.write(f.read()[-6000:])
            raise SystemExit(f"main_ppo failed with exit status {proc.returncode} (its log tail is above)")
    return OursResult(records=records, wall_s=wall, stopped_early=stopped)


def step_records(records: list[dict]) -> list[dict]:
    """The per-step training records (those with `timing_s/step`), in step order."""
    return sorted((r for r in records if "timing_s/step" in r["data"]), key=lambda r: r["step"])


def ours_completion_tokens(record: dict, setup: GRPOSetup) -> float:
    """Completion tokens of one step: mean response length (EOS included) x completions."""
    return record["data"]["response_length/mean"] * setup.completions_per_step


# ---------------------------------------------------------------------------------------------- TRL
def trl_batch_args(batch_size: int, n: int, mini_batch_size: int, micro_batch_size: int | None = None) -> dict:
    """TRL's batch knobs for `batch_size` prompts x `n` completions per generation and
    `mini_batch_size` prompts per optimizer step, on one process.

    TRL's `per_device_train_batch_size` counts completions per forward/backward (micro-batch);
    `gradient_accumulation_steps` micro-batches make one optimizer step; `steps_per_generation`
    micro-batches consume one generated batch. So optimizer steps per generation =
    steps_per_generation / gradient_accumulation_steps = batch_size / mini_batch_size.
    `micro_batch_size` (completions) defaults to a whole mini-batch in one forward.
    """
    if batch_size % mini_batch_size:
        raise ValueError(
            f"batch_size={batch_size} is not a multiple of mini_batch_size={mini_batch_size}; each optimizer "
            "step must take a whole number of prompt groups from the batch"
        )
    per_step = mini_batch_size * n
    micro = per_step if micro_batch_size is None else micro_batch_size
    if micro <= 0 or per_step % micro:
        raise ValueError(
            f"micro_batch_size={micro} does not divide the {per_step} completions of one optimizer step "
            f"({mini_batch_size} prompts x {n}); pick a divisor of {per_step}"
        )
    return {
        "num_generations": n,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": per_step // micro,
        "steps_per_generation": batch_size * n // micro,
    }


class ArithReward:
    """TRL reward function: our `arith` rule on each completion, and a completion-token counter.

    TRL calls it with `prompts`, `completions` (conversational: `[{"role": "assistant", "content"}]`),
    `completion_ids` (token ids up to and including the first EOS) and every dataset column as a
    keyword argument, one list entry per completion.
    """

    __name__ = "arith"  # TRL names reward metrics after the callable

    def __init__(self):
        self.tokens_per_call: list[int] = []
        self.scores_per_call: list[float] = []

    def __call__(self, prompts, completions, completion_ids, data_source, reward_model, **kwargs) -> list[float]:
        from verl.utils.reward_score import default_compute_score

        scores = []
        for completion, source, rm in zip(completions, data_source, reward_model):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            score = default_compute_score(source, text, rm["ground_truth"])
            scores.append(float(score["score"] if isinstance(score, dict) else score))
        self.tokens_per_call.append(sum(len(ids) for ids in completion_ids))
        self.scores_per_call.append(sum(scores) / len(scores))
        return scores


def make_trl_trainer(
    setup: GRPOSetup,
    train_rows: list[dict],
    output_dir: str,
    max_steps: int,
    callbacks: list | None = None,
    micro_batch_size: int | None = None,
):
    """(trainer, reward): a CPU `GRPOTrainer` configured from `setup`, and its `ArithReward`.

    `max_steps` counts TRL optimizer steps. The model is loaded here in fp32 (the checkpoint's
    dtype), as our workers load it on CPU.
    """
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    # transformers 5 renames gradient_checkpointing to activation_checkpointing; TRL 1.x still sets it
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)

    torch.manual_seed(setup.seed)
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        use_vllm=False,
        gradient_checkpointing=False,
        beta=setup.kl_coef,
        num_iterations=setup.epochs,
        **trl_batch_args(setup.batch_size, setup.n, setup.mini_batch_size, micro_batch_size),
        max_completion_length=setup.max_response_length,
        temperature=setup.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=setup.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=setup.weight_decay,
        max_grad_norm=setup.grad_clip,
        epsilon=setup.clip_ratio,
        entropy_coef=setup.entropy_coeff,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        max_steps=max_steps,
        seed=setup.seed,
        data_seed=setup.seed,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(setup.model)
    model = AutoModelForCausalLM.from_pretrained(setup.model, dtype=torch.float32)
    # TRL (1.x) has no prompt-length limit, our dataset refuses longer prompts: check none is longer.
    too_long = [row for row in train_rows if len(_prompt_ids(tokenizer, row["prompt"])) > setup.max_prompt_length]
    if too_long:
        raise ValueError(
            f"{len(too_long)} prompts exceed max_prompt_length={setup.max_prompt_length} tokens "
            f"(e.g. {too_long[0]['prompt']!r}); raise --max-prompt-length"
        )
    columns = ("prompt", "data_source", "reward_model")
    dataset = datasets.Dataset.from_list([{key: row[key] for key in columns} for row in train_rows])
    reward = ArithReward()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    # Metrics are still logged every step (into trainer.state.log_history), just not printed.
    trainer.remove_callback(PrinterCallback)
    if trainer.model.is_gradient_checkpointing:
        raise RuntimeError("TRL turned gradient checkpointing on; the comparison needs it off on both sides")
    return trainer, reward


def _prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_step_clock_class():
    """`TRLStepClock`, defined lazily so importing this module does not import transformers."""
    from transformers import TrainerCallback

    class TRLStepClock(TrainerCallback):
        """Seconds of each optimizer step, from the previous `on_step_end` (or `on_train_begin`) to
        this one: data loading, generation, reward, loss, backward, optimizer step and TRL's own
        logging are in it; time spent in `evaluate(state, control)` (a hook for subclasses, called
        after the step is recorded) is not."""

        def __init__(self):
            self.step_seconds: list[float] = []
            self.eval_seconds = 0.0
            self._last = None

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_seconds.append(now - self._last)
            eval_start = time.perf_counter()
            self.evaluate(state, control, **kwargs)
            self._last = time.perf_counter()
            self.eval_seconds += self._last - eval_start

        def evaluate(self, state, control, **kwargs) -> None:
            """Override to evaluate after a step; its time is excluded from the step times."""

    return TRLStepClock
