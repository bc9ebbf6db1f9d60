"""Pre-flight checks of a PPO run's inputs: files, models and directories, before Ray starts.

`validate_ppo_config` checks the config against itself; this module checks it against the
filesystem, so a typo in a path fails in a second with exit status 2 instead of after Ray,
the TaskRunner and the workers have started (half a minute or more on a small machine):

- data files exist, are readable parquet/JSON, have rows and the columns the trainer reads
  (`data.prompt_key`, `reward_model` with a `ground_truth`, `data.reward_fn_key`), and the training
  set holds at least one batch;
- model paths exist and hold a Hugging Face `config.json`; the policy's declared architecture is a
  causal language model (a reward-model or classifier checkpoint is a common mix-up);
- images and videos (docs/multimodal.md): a vision-language policy's directory holds its processor
  files, its data holds no videos (images only here); a text-only policy's data holds no images,
  which it would never see;
- the custom reward file defines the configured function (parsed, not executed);
- the checkpoint, run and dump directories can be written (tried with a temporary file), so
  a run never trains for hours and then fails at its first save;
- what resuming would load exists: `trainer.resume_from_path`, or the step the checkpoint
  tracker names in auto mode (a tracker naming a missing directory would otherwise silently
  start from scratch and overwrite the run).

Design decisions:
- Only cheap checks: file metadata, parquet schemas, JSON; no tokenizer and no model import
  (transformers alone takes seconds to import). Checks needing the tokenizer (an over-long prompt
  with `data.truncation=error`) stay in the dataset, which the TaskRunner builds first.
- Checks are skipped where the driver's filesystem is not the cluster's: a Ray client connection
  (`ray://`), and a user dataset class (`data.custom_cls`) that may read anything.
- Hub ids (`Qwen/Qwen2.5-0.5B`) are left to the workers: they may be downloaded or cached.
- Every problem is reported at once, one line each, as `ConfigError` does.
"""

from __future__ import annotations

import ast
import json
import os
import tempfile

from verl.trainer.config.errors import ConfigError
from verl.trainer.default_data import ensure_default_data

__all__ = ["RunInputError", "check_run_inputs"]

_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_DATA_HINT = (
    'write it with a script like those in examples/data_preprocess/ (docs/howto.md, "Add a dataset", lists the columns)'
)


class RunInputError(ConfigError):
    """A run's inputs (files, models, directories) are missing or unusable; the message says which and what to do."""


def check_run_inputs(config) -> None:
    """Raise `RunInputError` listing every problem with the run's files, models and directories."""
    problems: list[str] = []
    _check_data(config, problems)
    _check_models(config, problems)
    _check_multimodal(config, problems)
    _check_reward_function(config, problems)
    _check_writable_dirs(config, problems)
    _check_resume(config, problems)
    if len(problems) == 1:
        raise RunInputError(f"cannot start: {problems[0]}", problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise RunInputError(f"cannot start ({len(problems)} problems):\n{lines}", problems)


def skip_reason(config) -> str | None:
    """Why the driver cannot check the run's paths (they live on the cluster), or None."""
    # ray_init is an open section of ray.init keywords: `address` is there only when the user passes it
    address = str(config.ray_kwargs.ray_init.get("address") or "")
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address.startswith("ray://"):
        return f"the driver reaches the cluster through Ray client ({address}); paths are checked there"
    return None


# ----------------------------------------------------------------------------------------- data


def _files(value) -> list[str]:
    if not value:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _check_data(config, problems: list[str]) -> None:
    data = config.data
    if data.custom_cls.path:
        return  # a user dataset class decides what its files look like
    ensure_default_data(config)
    prompt_key, reward_fn_key = data.prompt_key, data.reward_fn_key
    train_rows = 0
    for key in ("train_files", "val_files"):
        for path in _files(data[key]):
            rows = _check_data_file(f"data.{key}", path, prompt_key, reward_fn_key, problems)
            if key == "train_files" and rows is not None:
                train_rows += rows
    batch = data.gen_batch_size or data.train_batch_size
    limit = data.train_max_samples
    if limit is not None and limit >= 0:
        train_rows = min(train_rows, limit)
    if 0 < train_rows < batch:
        problems.append(
            f"the training set has {train_rows} prompts, fewer than one batch of data.train_batch_size={batch}, so "
            f"not a single step can run; lower data.train_batch_size to at most {train_rows} or add data"
        )


def _check_data_file(key: str, path: str, prompt_key: str, reward_fn_key: str, problems: list[str]) -> int | None:
    """Check one data file; returns its number of rows (None when it could not be read)."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        problems.append(
            f"{key}: data file {path!r} does not exist (working directory {os.getcwd()!r}); fix the path or {_DATA_HINT}"
        )
        return None
    if os.path.isdir(full):
        problems.append(f"{key}: {path!r} is a directory; list the parquet/JSON files inside it instead")
        return None
    try:
        columns, num_rows, reward_fields = _columns_and_rows(full)
    except Exception as e:  # unreadable or corrupt file: report what the reader said
        problems.append(f"{key}: data file {path!r} cannot be read ({type(e).__name__}: {e}); regenerate it")
        return None
    if num_rows == 0:
        problems.append(
            f"{key}: data file {path!r} has no rows, so there is nothing to train or validate on; regenerate it or "
            f"remove it from {key}"
        )
        return 0
    missing = []
    if prompt_key not in columns:
        missing.append(f"{prompt_key!r} (data.prompt_key: the chat messages to answer)")
    if "reward_model" not in columns:
        missing.append("'reward_model' ({'ground_truth': ...}: what the reward function compares the response with)")
    if reward_fn_key not in columns:
        missing.append(f"{reward_fn_key!r} (data.reward_fn_key: selects the reward function for each row)")
    if missing:
        problems.append(
            f"{key}: data file {path!r} has no column {' and no column '.join(missing)}; its columns are "
            f"{sorted(columns)}. Rename the columns (or set data.prompt_key / data.reward_fn_key), or {_DATA_HINT}"
        )
    elif reward_fields is not None and "ground_truth" not in reward_fields:
        problems.append(
            f"{key}: data file {path!r}: column 'reward_model' has the fields {sorted(reward_fields)} but no "
            f"'ground_truth', which the reward function receives; add it, or {_DATA_HINT}"
        )
    return num_rows


def _columns_and_rows(path: str) -> tuple[set[str], int, set[str] | None]:
    """(column names, number of rows, fields of the reward_model struct or None) without reading the data."""
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        reward_fields = None
        if "reward_model" in schema.names:
            field_type = schema.field("reward_model").type
            if pa.types.is_struct(field_type):
                reward_fields = {field_type.field(i).name for i in range(field_type.num_fields)}
        return set(schema.names), pq.read_metadata(path).num_rows, reward_fields
    from verl.utils.dataset.files import read_rows

    rows = read_rows(path)
    columns = set().union(*(row.keys() for row in rows[:100])) if rows else set()
    reward = next((row.get("reward_model") for row in rows[:1]), None)
    return columns, len(rows), set(reward) if isinstance(reward, dict) else None


# --------------------------------------------------------------------------------------- models


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id (`org/name`)."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") != 1 or os.path.exists(os.path.expanduser(path))


def _model_config(key: str, path: str | None, problems: list[str]) -> dict | None:
    """The parsed config.json of a local model directory (None for hub ids and after a reported problem)."""
    if not path or not _looks_local(str(path)):
        return None
    full = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(full):
        problems.append(
            f"{key}={path} does not exist (working directory {os.getcwd()!r}); point it at a Hugging Face model "
            "directory (config.json + weights + tokenizer files) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
        return None
    config_file = os.path.join(full, "config.json")
    if not os.path.isfile(config_file):
        what = "a file" if os.path.isfile(full) else f"a directory without a config.json (it holds {_listing(full)})"
        problems.append(
            f"{key}={path} is {what}, not a Hugging Face model directory; point it at the directory that "
            "holds config.json, the weights and the tokenizer files"
        )
        return None
    try:
        with open(config_file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        problems.append(f"{key}={path}: its config.json cannot be read ({e}); re-download or re-export the model")
        return None


def _listing(path: str) -> str:
    names = sorted(os.listdir(path))
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"


def _check_causal_lm(key: str, path: str, model_config: dict, problems: list[str]) -> None:
    architectures = model_config.get("architectures") or []
    if architectures and not any(a.endswith(_CAUSAL_LM_SUFFIXES) for a in architectures):
        problems.append(
            f"{key}={path} holds a {', '.join(architectures)} (model_type {model_config.get('model_type')!r}), which "
            "is not a causal language model, so it cannot generate responses; point it at a decoder-only "
            "generative checkpoint (its config.json lists an architecture ending in ForCausalLM), e.g. the base or "
            "instruct model rather than a reward model or classifier"
        )


def _check_models(config, problems: list[str]) -> None:
    from verl.trainer.config import need_critic

    model = config.actor_rollout_ref.model
    remote_code = bool(model.trust_remote_code) or bool(model.external_lib)
    if model.get("hf_config_path"):
        # the config of that directory replaces path's (which then needs no config.json of its own)
        key, config_path = "actor_rollout_ref.model.hf_config_path", model.hf_config_path
        full = os.path.expanduser(str(model.path))
        if _looks_local(str(model.path)) and not os.path.isdir(full):
            problems.append(
                f"actor_rollout_ref.model.path={model.path} is not a directory; point it at the directory that holds "
                "the weights (hf_config_path gives only the config)"
            )
    else:
        key, config_path = "actor_rollout_ref.model.path", model.path
    policy = _model_config(key, config_path, problems)
    if policy is not None and not remote_code:
        _check_causal_lm(key, config_path, policy, problems)
    tokenizer_path = model.tokenizer_path
    tokenizer_missing = tokenizer_path and not os.path.exists(os.path.expanduser(str(tokenizer_path)))
    if tokenizer_missing and _looks_local(str(tokenizer_path)):
        problems.append(
            f"actor_rollout_ref.model.tokenizer_path={tokenizer_path} does not exist; point it at a directory "
            "with tokenizer files, or set it to null to use the model's own tokenizer"
        )
    if need_critic(config) and config.critic.model.path != model.path:
        _model_config("critic.model.path", config.critic.model.path, problems)
    if config.reward_model.enable:
        _model_config("reward_model.model.path", config.reward_model.model.path, problems)


# ---------------------------------------------------------------------------------- multi-modal


def _check_multimodal(config, problems: list[str]) -> None:
    """Images and videos against the policy (local directories and data files only; a hub id's
    processor is checked by the TaskRunner when it loads it)."""
    from verl.trainer.config.validate_multimodal import is_vision_language

    model = config.actor_rollout_ref.model
    path = model.get("hf_config_path") or model.path
    if not path or not _looks_local(str(path)):
        return
    policy = _model_config("actor_rollout_ref.model.path", path, [])  # a missing one is reported already
    if policy is None:
        return
    vision = is_vision_language(policy)
    weights_dir = os.path.expanduser(str(model.path))
    processor_files = ("preprocessor_config.json", "processor_config.json")
    if (
        vision
        and os.path.isdir(weights_dir)
        and not any(os.path.isfile(os.path.join(weights_dir, f)) for f in processor_files)
    ):
        problems.append(
            f"actor_rollout_ref.model.path={model.path} is a vision-language model without processor files "
            "(preprocessor_config.json); copy them from the model it was trained from, so that images can be turned "
            "into the model's inputs"
        )
    data = config.data
    if data.custom_cls.path:
        return
    image_key, video_key = data.get("image_key", "images"), data.get("video_key", "videos")
    audio_key = data.get("audio_key", "audios")
    for key in ("train_files", "val_files"):
        for file in _files(data[key]):
            if _column_has_values(file, audio_key):
                problems.append(
                    f"data.{key}: {file!r} holds audio (column {audio_key!r}, data.audio_key); audio is not "
                    f"supported here (no audio model or processor path): drop the {audio_key!r} column"
                )
            if vision and _column_has_values(file, video_key):
                problems.append(
                    f"data.{key}: {file!r} holds videos (column {video_key!r}, data.video_key); videos are not "
                    "supported here (transformers' video processor needs torchvision, which this build does not "
                    f"install): train on images only (drop the {video_key!r} column)"
                )
            elif not vision and _column_has_values(file, image_key):
                problems.append(
                    f"data.{key}: {file!r} holds images (column {image_key!r}, data.image_key) but "
                    f"actor_rollout_ref.model.path={model.path} is a text-only model, which would never see them; "
                    "train a vision-language model (e.g. Qwen2.5-VL) or drop the column"
                )


def _column_has_values(path: str, column: str) -> bool:
    """Whether a parquet/JSON data file has `column` with at least one non-empty entry (False when it
    cannot be read: the data check reports that)."""
    full = os.path.abspath(os.path.expanduser(path))
    try:
        if full.endswith(".parquet"):
            import pyarrow.parquet as pq

            if column not in pq.read_schema(full).names:
                return False
            values = pq.read_table(full, columns=[column]).column(0).to_pylist()
        else:
            from verl.utils.dataset.files import read_rows

            values = [row.get(column) for row in read_rows(full)]
    except Exception:  # an unreadable file is the data check's problem to report
        return False
    return any(v is not None and (not hasattr(v, "__len__") or len(v) > 0) for v in values)


# ------------------------------------------------------------------------------ reward function


def _check_reward_function(config, problems: list[str]) -> None:
    """The reward file parses and defines the function (read with `ast`: none of its code runs here)."""
    section = config.custom_reward_function
    path, name = section.path, section.name or "compute_score"
    if not path or not os.path.isfile(os.path.expanduser(str(path))):
        return  # a missing file is a config error (validate_ppo_config)
    try:
        with open(os.path.expanduser(str(path)), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=str(path))
    except SyntaxError as e:
        problems.append(
            f"custom_reward_function.path={path} is not valid Python (line {e.lineno}: {e.msg}); fix the file"
        )
        return
    defined = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [alias.asname or alias.name.split(".")[0] for alias in node.names]
            if "*" in names:
                return  # a star import may define anything: leave it to the loader
            defined.update(names)
        elif not isinstance(node, ast.Expr):
            return  # names bound in if/try/with blocks: leave it to the loader
    if name not in defined:
        functions = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
        problems.append(
            f"custom_reward_function.name={name!r} is not defined in custom_reward_function.path={path}; the file "
            f"defines the functions {functions}. Set custom_reward_function.name to one of them"
        )


# ---------------------------------------------------------------------------------- directories


def _unwritable_reason(path: str) -> str | None:
    """Why files cannot be created under `path` (which may not exist yet), or None. Tried, not guessed:
    permissions, read-only mounts and a file in the way all show up, for root as well."""
    current = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    if not os.path.isdir(current):
        return f"{current} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=current):
            pass
    except OSError as e:
        return f"cannot create files in {current}: {e.strerror or e}"
    return None


def _check_writable_dirs(config, problems: list[str]) -> None:
    trainer = config.trainer
    dirs = []
    if trainer.save_freq > 0:
        dirs.append(
            ("trainer.default_local_dir", trainer.default_local_dir, "checkpoints", "or set trainer.save_freq=-1")
        )
    if trainer.run_dir:
        dirs.append(("trainer.run_dir", trainer.run_dir, "the resolved config and metrics", ""))
    for key in ("rollout_data_dir", "validation_data_dir"):
        if trainer[key]:
            dirs.append((f"trainer.{key}", trainer[key], "generation dumps", f"or set trainer.{key}=null"))
    for key, path, what, alternative in dirs:
        reason = _unwritable_reason(str(path))
        if reason:
            problems.append(
                f"{key}={path} is not writable ({reason}), so {what} could not be saved; point it at a writable "
                f"directory {alternative}".rstrip()
            )


# --------------------------------------------------------------------------------------- resume


def _check_resume(config, problems: list[str]) -> None:
    trainer = config.trainer
    mode = trainer.resume_mode
    if mode == "resume_path" and trainer.resume_from_path:
        path = str(trainer.resume_from_path)
        full = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(full):
            problems.append(
                f"trainer.resume_from_path={path} does not exist; point it at a global_step_N directory of an "
                "earlier run (trainer.default_local_dir/global_step_N)"
            )
        elif not os.path.isfile(os.path.join(full, "data.pt")):
            problems.append(
                f"trainer.resume_from_path={path} is not a complete checkpoint (it has no data.pt, which is written "
                "last; the save was interrupted); resume from the step named in latest_checkpointed_iteration.txt"
            )
        return
    if mode != "auto":
        return
    from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

    root = os.path.abspath(os.path.expanduser(str(trainer.default_local_dir)))
    tracker = get_checkpoint_tracker_filename(root)
    if not os.path.isfile(tracker):
        return
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        problems.append(
            f"the checkpoint tracker {tracker} holds {text[:40]!r} instead of a step number; write the step of the "
            "last complete global_step_N directory into it, or set trainer.resume_mode=disable to start from scratch"
        )
        return
    step_dir = os.path.join(root, f"global_step_{text}")
    if not os.path.isdir(step_dir):
        problems.append(
            f"the checkpoint tracker {tracker} names step {text}, but {step_dir} does not exist, so resuming would "
            "silently start from scratch and overwrite this run's checkpoints; restore that directory, point the "
            "tracker at an existing global_step_N, or set trainer.resume_mode=disable to start from scratch"
        )
