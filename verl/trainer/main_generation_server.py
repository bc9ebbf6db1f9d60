"""`python -m verl.trainer.main_generation_server key=value ...`: upstream's generation entry point
that reads the PPO config (ppo_trainer.yaml), for scripts written for it.

    python -m verl.trainer.main_generation_server trainer.nnodes=1 trainer.n_gpus_per_node=1 \\
        actor_rollout_ref.model.path=./merged actor_rollout_ref.rollout.name=hf \\
        actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.temperature=1.0 \\
        data.train_files="['a.parquet','b.parquet']" +data.output_path=gen.parquet

Every file of `data.train_files` is read and concatenated in order into one table; for each row,
`actor_rollout_ref.rollout.n` responses to its `data.prompt_key` chat messages are sampled, and the
table is written to `data.output_path` with a `responses` column added (a list of n strings per
row), the file `python -m verl.trainer.main_eval` scores. The generation itself is
`main_generation`'s (`generate_to_parquet`); this module only maps the PPO config onto it.

Design decisions:
- The keys read (docs/tools.md lists them) are checked here with their own errors; the rest of the
  PPO config is composed (so a misspelled key gets main_ppo's did-you-mean error) but not read,
  and `validate_ppo_config` is not run: it judges training settings (batch sizes, the actor's
  strategy) that a generation run never uses, as upstream's entry point ignores them too.
- No HTTP server: upstream starts standalone OpenAI-compatible vLLM/SGLang servers and posts chat
  completions to them. Here the engines run in this process (one engine) or in a Ray worker group
  (`trainer.nnodes * trainer.n_gpus_per_node` workers, `tensor_model_parallel_size` of them per
  engine for vllm), as in `main_generation`; the prompt is rendered with the model's chat
  template as the server would render a chat completion.
- Sampling as upstream's requests: `temperature`, `top_p` and `max_tokens = response_length`.
  `top_k` is not sent by upstream, so it is not applied here either (a value other than -1/0 is
  reported, not silently dropped); `do_sample` is not read (temperature 0 is greedy decoding,
  which with n > 1 is refused, as upstream asserts).
- The engine reads the checkpoint: a `load_format` of `dummy*` (ppo_trainer's default, for a
  trainer that syncs its weights into the engine) becomes `auto`.
- Every prompt goes to the engines in one call (upstream sends every request at once); the engine
  splits it into `max_num_seqs` chunks itself.
"""

from __future__ import annotations

import sys

from verl.trainer.main_generation import GenerationJob, generate_to_parquet, plain_section


def main(argv: list[str] | None = None) -> None:
    run_generation_server(load_config(argv))


def load_config(argv: list[str] | None = None):
    """ppo_trainer.yaml (or `--config-path/--config-name`) plus the overrides, resolved, not validated.

    A config mistake prints one message and exits with status 2, as `main_ppo` does."""
    from verl.trainer.config import ConfigError, load_ppo_config, parse_command_line

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cmd = parse_command_line(argv)
        return load_ppo_config(cmd.overrides, cmd.config_dir, config_name=cmd.config_name, validate=False)
    except ConfigError as e:
        print(f"verl: invalid configuration\n{e}", file=sys.stderr)
        raise SystemExit(2) from None


def _positive_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r} must be a positive integer")
    return value


def _train_files(data) -> list[str]:
    from omegaconf import ListConfig

    files = data.get("train_files")
    files = list(files) if isinstance(files, list | ListConfig) else [files]
    if not files or any(not isinstance(f, str) or not f for f in files):
        raise ValueError(
            f"data.train_files={files!r} must name one parquet file or a list of them, e.g. "
            "data.train_files=\"['a.parquet','b.parquet']\""
        )
    for path in files:
        if not path.endswith(".parquet"):
            raise ValueError(
                f"data.train_files: {path!r} is not a .parquet file; main_generation_server reads parquet files "
                "(the output copies their columns)"
            )
    return files


def job_from_ppo_config(config) -> GenerationJob:
    """The `GenerationJob` of a resolved PPO config; ValueError for a value the run cannot use."""
    from verl.trainer.config import ray_init_kwargs

    data, trainer = config.data, config.trainer
    model, rollout_section = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout
    output_path = data.get("output_path")
    if not output_path:
        raise ValueError(
            "data.output_path is not set; add +data.output_path=/path/to/output.parquet (the file to write)"
        )
    input_paths = _train_files(data)
    nnodes = _positive_int("trainer.nnodes", trainer.nnodes)
    n_gpus_per_node = _positive_int("trainer.n_gpus_per_node", trainer.n_gpus_per_node)
    rollout = plain_section(rollout_section)
    n = _positive_int("actor_rollout_ref.rollout.n", rollout["n"])
    temperature = rollout["temperature"]
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
        raise ValueError(f"actor_rollout_ref.rollout.temperature={temperature!r} must be a number >= 0")
    if temperature == 0 and n > 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.n={n} with temperature=0 (greedy decoding) would write {n} copies of one "
            "response; set actor_rollout_ref.rollout.n=1, or sample with a temperature > 0"
        )
    if rollout["name"] != "hf":
        tp = _positive_int(
            "actor_rollout_ref.rollout.tensor_model_parallel_size", rollout["tensor_model_parallel_size"]
        )
        if (nnodes * n_gpus_per_node) % tp:
            raise ValueError(
                f"trainer.nnodes x trainer.n_gpus_per_node = {nnodes * n_gpus_per_node} devices do not split into "
                f"engines of actor_rollout_ref.rollout.tensor_model_parallel_size={tp}; make the device count a "
                "multiple of it"
            )
    if rollout.get("top_k") not in (-1, 0, None):
        print(
            f"main_generation_server: actor_rollout_ref.rollout.top_k={rollout['top_k']} is not applied: upstream's "
            "requests carry temperature, top_p and max_tokens only (use main_generation for top-k sampling)",
            file=sys.stderr,
        )
    # what upstream's chat-completion request asks for: no top-k, greedy exactly when temperature is 0
    rollout.update(top_k=-1, do_sample=temperature > 0)
    if str(rollout.get("load_format", "auto")).startswith("dummy"):
        rollout["load_format"] = "auto"  # no trainer syncs weights into the engine here: read the checkpoint
    return GenerationJob(
        input_paths=input_paths,
        input_key="data.train_files",
        output_path=str(output_path),
        model_path=str(model.path),
        trust_remote_code=bool(model.get("trust_remote_code", False)),
        external_lib=model.get("external_lib"),
        rollout=rollout,
        n_samples=n,
        batch_size=None,
        prompt_key=data.prompt_key,
        truncation=data.truncation,
        use_chat_template=True,
        apply_chat_template_kwargs=plain_section(data.get("apply_chat_template_kwargs") or {}),
        nnodes=nnodes,
        n_gpus_per_node=n_gpus_per_node,
        device=trainer.device,
        ray_init=ray_init_kwargs(config),
    )


def run_generation_server(config) -> str:
    """Generate for a resolved PPO config and write `data.output_path`; returns its path."""
    return generate_to_parquet(job_from_ppo_config(config))


if __name__ == "__main__":
    main()
