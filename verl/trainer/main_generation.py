"""`python -m verl.trainer.main_generation key=value ...`: sample n responses for every prompt of a parquet file.

    python -m verl.trainer.main_generation data.path=~/data/arith/test.parquet data.n_samples=4 \\
        data.output_path=~/data/arith/test_gen.parquet model.path=./merged rollout.temperature=1.0

Each row's `data.prompt_key` chat messages are rendered and tokenised by `RLHFDataset` (the same
chat template and padding as training), `data.n_samples` responses per prompt are sampled by the
rollout engine (`rollout.name`, the built-in `HFRollout` by default), and the input table is
written to `data.output_path` with a `responses` column added: a list of n strings per row, row i
answering input row i. `python -m verl.trainer.main_eval` scores that file.

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

import importlib
import os
import time

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

RESPONSES_COLUMN = "responses"


def main(argv: list[str] | None = None) -> None:
    from verl.trainer.tool_config import load_tool_config

    run_generation(load_tool_config("generation", argv))


def _plain(section) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(section, resolve=True) if not isinstance(section, dict) else dict(section)


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


def _start_worker_group(config, rollout_config: dict):
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
        ray.init(num_cpus=config.ray_init.num_cpus, include_dashboard=False, runtime_env={"env_vars": env_vars})
    trainer = config.trainer
    pool = RayResourcePool(
        [trainer.n_gpus_per_node] * trainer.nnodes, use_gpu=is_cuda_available(), max_colocate_count=1
    )
    worker = RayClassWithInitArgs(
        ray.remote(GenerationWorker),
        model_path=config.model.path,
        rollout_config=rollout_config,
        trust_remote_code=bool(config.model.trust_remote_code),
        external_lib=config.model.external_lib,
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


def run_generation(config) -> str:
    """Generate and write `data.output_path`; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    from verl.protocol import DataProto
    from verl.trainer.preflight import _column_has_values
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.utils.device import set_device_preference
    from verl.utils.tokenizer import hf_tokenizer

    check_generation_config(config)
    set_device_preference(config.trainer.device)
    data, model = config.data, config.model
    input_path = os.path.expanduser(data.path)
    output_path = os.path.expanduser(data.output_path)
    _ensure_default_data(input_path)
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"data.path={data.path!r} does not exist (cwd: {os.getcwd()})")
    if _column_has_values(input_path, "images"):
        raise ValueError(
            f"data.path={data.path!r} holds images (column 'images'): main_generation generates from text prompts "
            "only, and the images would never reach the model; drop the column, or score a vision-language model "
            "with main_ppo's validation, which generates with the images (trainer.val_only=true)"
        )
    _import_external_lib(model.external_lib)

    tokenizer = hf_tokenizer(model.path, trust_remote_code=bool(model.trust_remote_code))
    rollout_config = _plain(config.rollout)
    dataset = RLHFDataset(
        input_path,
        tokenizer,
        {
            "prompt_key": data.prompt_key,
            "max_prompt_length": rollout_config["prompt_length"],
            "filter_overlong_prompts": False,
            "truncation": data.truncation,
            "use_chat_template": data.use_chat_template,
            "apply_chat_template_kwargs": _plain(data.apply_chat_template_kwargs),
        },
    )
    table = pq.read_table(input_path)
    assert len(dataset) == table.num_rows, "RLHFDataset must keep every row when filtering is off"

    num_engines = config.trainer.nnodes * config.trainer.n_gpus_per_node
    group = pool = None
    if num_engines == 1:
        generate = build_rollout(model.path, rollout_config, tokenizer).generate_sequences
    else:
        group, pool = _start_worker_group(config, rollout_config)
        generate = group.generate_sequences

    n = data.n_samples
    meta_info = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "n": 1}
    responses: list[list[str]] = []
    num_tokens, start = 0, time.perf_counter()
    try:
        loader = DataLoader(dataset, batch_size=data.batch_size, shuffle=False, collate_fn=collate_fn)
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
        print(f"replacing the existing {RESPONSES_COLUMN!r} column of {data.path}")
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
