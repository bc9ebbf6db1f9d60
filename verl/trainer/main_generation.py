"""`python -m verl.trainer.main_generation key=value ...`: sample n responses for every prompt of a parquet file.

    python -m verl.trainer.main_generation data.path=~/data/arith/test.parquet data.n_samples=4 \\
        data.output_path=~/data/arith/test_gen.parquet model.path=./merged rollout.temperature=1.0

Each row's `data.prompt_key` chat messages are rendered and tokenised by `RLHFDataset` (the same
chat template and padding as training), `data.n_samples` responses per prompt are sampled by the
rollout engine (`rollout.name`, the built-in `HFRollout` by default), and the input table is
written to `data.output_path` with a `responses` column added: a list of n strings per row, row i
answering input row i. `python -m verl.trainer.main_eval` scores that file.

The run itself is `generate_to_parquet(GenerationJob)`; `main_generation` fills the job from
generation.yaml, `main_generation_server` (upstream's entry point on the PPO config) from
ppo_trainer.yaml. Several input files are concatenated into one table (`read_input_table`).

Design decisions:
- Where the engine runs: with `trainer.nnodes * trainer.n_gpus_per_node == 1` it runs in this
  process (on CPU, or on the one GPU), with no Ray at all. With more, a Ray worker group of that
  many `GenerationWorker`s (one per GPU, or one process per CPU bundle) each holds a full copy of
  the engine and gets an equal slice of every batch (`Dispatch.DP_COMPUTE_PROTO`): data
  parallelism only; a model too large for one device is a job for vLLM/SGLang tensor parallelism.
- Samples: every prompt is repeated n times (interleaved) before generation, so its n samples are
  independent draws with the same settings and come back adjacent. Greedy decoding with
  `n_samples > 1` is refused, as upstream does: it would write n copies of one answer.
- Responses are decoded from their valid tokens with special tokens skipped, the way the reward
  managers decode them in training, so `main_eval` scores exactly what training would reward.
  (Upstream keeps special tokens such as EOS in the text.)
- No row is ever dropped: overlong prompts follow `data.truncation` (default `error`, which names
  the row) instead of being filtered out, so the output stays aligned with the input.
- Text prompts only (as upstream's): a file whose `images` column holds images is refused, rather
  than generating from prompts whose images the model would never see.
- The input table is read and written with pyarrow, so every input column keeps its exact type;
  an existing `responses` column is replaced. The file is written to a temporary name and renamed,
  so a crash never leaves a truncated output.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

RESPONSES_COLUMN = "responses"


def main(argv: list[str] | None = None) -> None:
    from verl.trainer.tool_config import load_tool_config

    run_generation(load_tool_config("generation", argv))


def plain_section(section) -> dict:
    """A config section (DictConfig or dict) as a plain dict, interpolations resolved."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(section, resolve=True) if not isinstance(section, dict) else dict(section)


@dataclasses.dataclass
class GenerationJob:
    """Everything one generation run reads, whichever config it came from: `generation.yaml`
    (`main_generation`) or `ppo_trainer.yaml` (`main_generation_server`). Built after the entry
    point has checked its own keys; the names in messages are the config keys given here."""

    input_paths: list[str]
    """Parquet files, concatenated in order into one output table."""
    input_key: str
    """The config key naming the inputs (`data.path`, `data.train_files`), for error messages."""
    output_path: str
    model_path: str
    trust_remote_code: bool
    external_lib: str | None
    rollout: dict
    """A `RolloutConfig` section (engine, sampling, lengths, tensor parallelism)."""
    n_samples: int
    batch_size: int | None
    """Prompts per generation call before the n_samples repeat; None: every prompt in one call."""
    prompt_key: str
    truncation: str
    use_chat_template: bool
    apply_chat_template_kwargs: dict
    nnodes: int
    n_gpus_per_node: int
    device: str
    ray_init: dict
    """`ray.init` keyword arguments for the local cluster started when there is more than one engine."""


def check_generation_config(config) -> None:
    """Raise ValueError for values the run cannot use, before anything is loaded."""
    data, rollout, trainer = config.data, config.rollout, config.trainer
    for key, value in (
        ("data.n_samples", data.n_samples),
        ("data.batch_size", data.batch_size),
        ("trainer.nnodes", trainer.nnodes),
        ("trainer.n_gpus_per_node", trainer.n_gpus_per_node),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be a positive integer")
    greedy = not rollout.do_sample or rollout.temperature == 0
    if greedy and data.n_samples > 1:
        raise ValueError(
            f"data.n_samples={data.n_samples} with greedy decoding (rollout.do_sample={rollout.do_sample}, "
            f"rollout.temperature={rollout.temperature}) would write {data.n_samples} copies of one response; "
            "set data.n_samples=1, or sample with rollout.do_sample=true and rollout.temperature>0"
        )
    if not str(data.path).endswith(".parquet"):
        raise ValueError(f"data.path={data.path!r} must be a .parquet file (the output copies its columns)")
    if not data.output_path:
        raise ValueError("data.output_path is not set; name the parquet file to write")


def _job_from_generation_config(config) -> GenerationJob:
    data, model, trainer = config.data, config.model, config.trainer
    return GenerationJob(
        input_paths=[str(data.path)],
        input_key="data.path",
        output_path=str(data.output_path),
        model_path=str(model.path),
        trust_remote_code=bool(model.trust_remote_code),
        external_lib=model.external_lib,
        rollout=plain_section(config.rollout),
        n_samples=data.n_samples,
        batch_size=data.batch_size,
        prompt_key=data.prompt_key,
        truncation=data.truncation,
        use_chat_template=bool(data.use_chat_template),
        apply_chat_template_kwargs=plain_section(data.apply_chat_template_kwargs),
        nnodes=trainer.nnodes,
        n_gpus_per_node=trainer.n_gpus_per_node,
        device=trainer.device,
        ray_init={"num_cpus": config.ray_init.num_cpus},
    )


def _ensure_default_data(path: str) -> None:
    """Generate the bundled arithmetic task when `path` is its (not yet written) cache file."""
    from verl.utils.dataset.arith import default_cache_dir, ensure_arith_data

    if os.path.realpath(path) == os.path.realpath(os.path.join(default_cache_dir(), "test.parquet")):
        ensure_arith_data()


def _import_external_lib(name: str | None) -> None:
    if name:
        importlib.import_module(name)


def build_rollout(model_path: str, rollout_config: dict, tokenizer):
    """The engine named by `rollout_config["name"]`, built as `cls(model_path, config=..., tokenizer=...)`
    from the typed `RolloutConfig` of the section (keys generation.yaml leaves out take its defaults)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout import get_rollout_class

    config = omega_conf_to_dataclass(rollout_config, RolloutConfig)
    return get_rollout_class(config.name)(model_path, config=config, tokenizer=tokenizer)


class GenerationWorker(Worker):
    """One engine of a data-parallel generation group (used when more than one engine is asked for)."""

    def __init__(self, model_path: str, rollout_config: dict, trust_remote_code: bool = False, external_lib=None):
        super().__init__()
        self._args = (model_path, rollout_config, trust_remote_code)
        self._external_lib = external_lib
        self.rollout = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.tokenizer import hf_tokenizer

        _import_external_lib(self._external_lib)
        model_path, rollout_config, trust_remote_code = self._args
        tokenizer = hf_tokenizer(model_path, trust_remote_code=trust_remote_code)
        self.rollout = build_rollout(model_path, rollout_config, tokenizer)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts):
        return self.rollout.generate_sequences(prompts)


def _start_worker_group(job: GenerationJob):
    """A Ray worker group of `nnodes * n_gpus_per_node` GenerationWorkers, engines loaded."""
    import ray

    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.device import is_cuda_available

    if not ray.is_initialized():
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        env_vars = {
            "PYTHONPATH": pythonpath,
            "TOKENIZERS_PARALLELISM": "true",
            "VERL_DEVICE": os.environ.get("VERL_DEVICE", "auto"),
        }
        kwargs = {k: v for k, v in job.ray_init.items() if v is not None}
        runtime_env = dict(kwargs.pop("runtime_env", None) or {})
        runtime_env["env_vars"] = {**env_vars, **(runtime_env.get("env_vars") or {})}
        kwargs.setdefault("include_dashboard", False)
        ray.init(runtime_env=runtime_env, **kwargs)
    pool = RayResourcePool([job.n_gpus_per_node] * job.nnodes, use_gpu=is_cuda_available(), max_colocate_count=1)
    worker = RayClassWithInitArgs(
        ray.remote(GenerationWorker),
        model_path=job.model_path,
        rollout_config=job.rollout,
        trust_remote_code=job.trust_remote_code,
        external_lib=job.external_lib,
    )
    group = RayWorkerGroup(pool, worker, role="generation")
    group.init_model()
    return group, pool


def _decode(tokenizer, output) -> list[str]:
    responses, mask = output.batch["responses"], output.batch["response_mask"].bool()
    return tokenizer.batch_decode([row[m].tolist() for row, m in zip(responses, mask)], skip_special_tokens=True)


def _write_parquet_atomic(table, path: str) -> None:
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_input_table(paths: list[str], input_key: str = "data.path"):
    """The parquet files' rows in order as one pyarrow table. Columns are the union of the files'
    (in order of first appearance; rows of a file without a column get nulls); a column keeps its
    exact type, or the common type pyarrow promotes to (int32 and int64 -> int64, a struct with
    more fields) when files differ. Columns whose types cannot be unified are refused by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(path) for path in paths]
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        types: dict[str, dict[str, str]] = {}
        for path, table in zip(paths, tables):
            for field in table.schema:
                types.setdefault(field.name, {})[path] = str(field.type)
        clashes = {name: by_path for name, by_path in types.items() if len(set(by_path.values())) > 1}
        raise ValueError(
            f"the files of {input_key} cannot be concatenated into one table: column types differ "
            f"({clashes or e}); convert the column to one type in every file, or generate for each file separately"
        ) from e


def run_generation(config) -> str:
    """`main_generation`: check generation.yaml's keys, then generate and write `data.output_path`;
    returns its path."""
    check_generation_config(config)
    _ensure_default_data(os.path.expanduser(config.data.path))
    return generate_to_parquet(_job_from_generation_config(config))


def generate_to_parquet(job: GenerationJob) -> str:
    """Generate `job.n_samples` responses for every row of `job.input_paths` and write the input
    table plus a `responses` column to `job.output_path`; returns its path."""
    import pyarrow as pa
    from torch.utils.data import DataLoader

    from verl.protocol import DataProto
    from verl.trainer.preflight import _column_has_values
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.utils.device import set_device_preference
    from verl.utils.tokenizer import hf_tokenizer

    set_device_preference(job.device)
    input_paths = [os.path.expanduser(p) for p in job.input_paths]
    output_path = os.path.expanduser(job.output_path)
    for path in input_paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{job.input_key}={path!r} does not exist (cwd: {os.getcwd()})")
        if _column_has_values(path, "images"):
            raise ValueError(
                f"{job.input_key}={path!r} holds images (column 'images'): main_generation generates from text "
                "prompts only, and the images would never reach the model; drop the column, or score a vision-language "
                "model with main_ppo's validation, which generates with the images (trainer.val_only=true)"
            )
    _import_external_lib(job.external_lib)

    tokenizer = hf_tokenizer(job.model_path, trust_remote_code=job.trust_remote_code)
    dataset = RLHFDataset(
        input_paths,
        tokenizer,
        {
            "prompt_key": job.prompt_key,
            "max_prompt_length": job.rollout["prompt_length"],
            "filter_overlong_prompts": False,
            "truncation": job.truncation,
            "use_chat_template": job.use_chat_template,
            "apply_chat_template_kwargs": job.apply_chat_template_kwargs,
        },
    )
    table = read_input_table(input_paths, job.input_key)
    assert len(dataset) == table.num_rows, "RLHFDataset must keep every row when filtering is off"

    num_engines = job.nnodes * job.n_gpus_per_node
    group = pool = None
    if num_engines == 1:
        generate = build_rollout(job.model_path, job.rollout, tokenizer).generate_sequences
    else:
        group, pool = _start_worker_group(job)
        generate = group.generate_sequences

    n = job.n_samples
    meta_info = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "n": 1}
    responses: list[list[str]] = []
    num_tokens, start = 0, time.perf_counter()
    try:
        batch_size = job.batch_size or len(dataset)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)
        for batch_dict in loader:
            prompts = DataProto.from_dict(
                tensors={k: batch_dict[k] for k in ("input_ids", "attention_mask", "position_ids")},
                meta_info=dict(meta_info),
            ).repeat(repeat_times=n, interleave=True)
            output = generate(prompts)
            num_tokens += int(output.batch["response_mask"].sum())
            texts = _decode(tokenizer, output)
            responses.extend(texts[i : i + n] for i in range(0, len(texts), n))
            print(f"generated {len(responses)}/{len(dataset)} prompts x {n} samples", flush=True)
    finally:
        if group is not None:
            group.shutdown()
            pool.remove_placement_groups()
    elapsed = time.perf_counter() - start

    if RESPONSES_COLUMN in table.column_names:
        print(f"replacing the existing {RESPONSES_COLUMN!r} column of the input")
        table = table.drop_columns([RESPONSES_COLUMN])
    table = table.append_column(RESPONSES_COLUMN, pa.array(responses, type=pa.list_(pa.string())))
    _write_parquet_atomic(table, output_path)
    print(
        f"wrote {table.num_rows} rows x {n} responses ({num_tokens} tokens, {num_tokens / max(elapsed, 1e-9):.0f} "
        f"tokens/s on {num_engines} engine(s)) to {output_path}"
    )
    return output_path


if __name__ == "__main__":
    main()
