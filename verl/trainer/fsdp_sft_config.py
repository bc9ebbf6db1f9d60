"""The FSDP SFT trainer's config (`sft_trainer.yaml`, upstream's keys and defaults): what it refuses,
how the keys upstream kept for compatibility are read, and its learning-rate schedule.

Every check runs before a model or a data file is read, and each refusal is one line naming the key,
why, and what to set instead. Keys are refused rather than accepted and left unused: a run that
silently trains something other than what its config says is worse than one that does not start.

Design decisions:
- `data.micro_batch_size` is upstream's deprecated name of `micro_batch_size_per_gpu` (upstream's
  trainer no longer reads it). Here, when set, it is used for `micro_batch_size_per_gpu` (with a
  warning; both set to different values is an error), since micro-batching never changes the loss.
- `model.strategy` `fsdp` and `fsdp2` both train with FSDP2 (this build has no FSDP1 path); the
  decoder layers are the FSDP units, as in upstream's FSDP2 path, so FSDP1's size-based
  `wrap_policy.min_num_params` must stay 0.
- The optimizer section is upstream's `optim/fsdp.yaml` merged with the SFT keys. The SFT schedule is
  `optim.lr_scheduler` (cosine, wsd, or constant, which upstream lacks); the PPO roles' schedule keys
  `lr_scheduler_type` / `warmup_style` and the trainer-filled `total_training_steps` are refused when
  changed, because this trainer would not read them. `lr_warmup_steps` > 0 overrides the ratio, and
  `min_lr_ratio` / `num_cycles` shape the decay (upstream's SFT trainer ignores all three).
- `model.use_liger` (Liger's fused GPU kernels, not in this build) is accepted with a warning, as the PPO
  roles' `use_liger`: a speed and memory knob whose loss is the same without it.
- Keys upstream reads with `.get()` without declaring them in its YAML (`model.lora_adapter_path`) are
  accepted when added with Hydra's `+`.
"""

from __future__ import annotations

import os
import warnings

from omegaconf import OmegaConf, open_dict

from verl.base_config import NPU
from verl.trainer.config.errors import did_you_mean

CONFIG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", "sft_trainer.yaml")
LR_SCHEDULERS = ("cosine", "wsd", "constant")
STRATEGIES = ("fsdp", "fsdp2")
MODEL_DTYPES = ("fp32", "float32", "bf16", "bfloat16")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
# keys upstream's trainer reads with `.get()` but its YAML does not declare (users add them with `+`)
UNDECLARED_UPSTREAM_KEYS = {"model.lora_adapter_path"}
# the stable share of wsd's post-warm-up steps (upstream's `get_wsd_schedule_with_warmup` default)
WSD_STABLE_RATIO = 0.9


def refuse_unknown_keys(config) -> None:
    """Refuse a key sft_trainer.yaml does not hold (`+data.prompt_keys=...`, a merged dotlist), naming the
    closest valid one: this trainer reads only its own keys, so an unknown one would be silently ignored."""
    known = OmegaConf.load(CONFIG_PATH)

    def walk(section, reference, prefix: str) -> None:
        for key in section:
            full = f"{prefix}{key}"
            if full in UNDECLARED_UPSTREAM_KEYS:
                continue
            if key not in reference:
                undeclared = [k.removeprefix(prefix) for k in UNDECLARED_UPSTREAM_KEYS if k.startswith(prefix)]
                hint = did_you_mean(str(key), [str(k) for k in reference] + undeclared, prefix=prefix)
                raise ValueError(
                    f"{full} is not a key of the SFT trainer (sft_trainer.yaml).{hint} Remove it; the keys are listed "
                    "in docs/sft.md"
                )
            if OmegaConf.is_dict(reference[key]) and OmegaConf.is_dict(section[key]):
                walk(section[key], reference[key], f"{full}.")

    walk(config, known, "")


def resolve_micro_batch_size(config) -> None:
    """Use upstream's deprecated `data.micro_batch_size` for `micro_batch_size_per_gpu` when it is set."""
    data = config.data
    legacy = data.get("micro_batch_size")
    if legacy is None:
        return
    default = OmegaConf.load(CONFIG_PATH).data.micro_batch_size_per_gpu
    current = data.micro_batch_size_per_gpu
    if current not in (default, legacy):
        raise ValueError(
            f"data.micro_batch_size={legacy} and data.micro_batch_size_per_gpu={current} disagree; micro_batch_size "
            "is upstream's deprecated name of micro_batch_size_per_gpu: set only micro_batch_size_per_gpu"
        )
    if current != legacy:
        warnings.warn(
            f"data.micro_batch_size={legacy} is upstream's deprecated name of data.micro_batch_size_per_gpu; using it "
            "as micro_batch_size_per_gpu (set that key instead)",
            FutureWarning,
            stacklevel=2,
        )
    with open_dict(config):
        data.micro_batch_size_per_gpu = int(legacy)
        data.micro_batch_size = None


def check_sft_config(config) -> None:
    """Refuse, in one line each, what this trainer cannot do (raises ValueError); nothing is loaded yet."""
    refuse_unknown_keys(config)
    data, model, optim, trainer = config.data, config.model, config.optim, config.trainer
    fsdp = model.fsdp_config
    refusals = [
        (data.chat_template is not None, "data.chat_template", "a chat template from the config is not applied "
         "(upstream refuses it too); put the template in the tokenizer (tokenizer_config.json) and remove the key"),
        (bool(data.balance_dp_token), "data.balance_dp_token", "balancing tokens across data-parallel ranks is not "
         "implemented (upstream's is a TODO); set it to false"),
        (int(fsdp.wrap_policy.get("min_num_params", 0) or 0) != 0, "model.fsdp_config.wrap_policy.min_num_params",
         "FSDP1's size-based wrapping; FSDP2 shards each decoder layer, as upstream's FSDP2 path does; set it to 0"),
        (bool(fsdp.offload_params) and not bool(fsdp.cpu_offload), "model.fsdp_config.offload_params",
         "offloading parameters is part of model.fsdp_config.cpu_offload under FSDP2; set cpu_offload=true"),
        (int(optim.get("total_training_steps", -1)) != -1, "optim.total_training_steps", "the PPO trainer fills it "
         "in; the SFT trainer's length is trainer.total_training_steps (or total_epochs); leave it at -1"),
        (optim.get("lr_scheduler_type", "constant") != "constant" or optim.get("warmup_style") is not None,
         "optim.lr_scheduler_type / optim.warmup_style", "the PPO roles' schedule keys; the SFT trainer's schedule is "
         f"optim.lr_scheduler (one of {list(LR_SCHEDULERS)}); set that and leave these at constant / null"),
    ]  # fmt: skip
    for refused, key, why in refusals:
        if refused:
            raise ValueError(f"{key}={_value(config, key)}: {why}")
    if model.use_liger:  # a speed knob, as the PPO roles' `use_liger`: the loss is the same without the kernels
        warnings.warn(
            "model.use_liger=true: Liger kernels (liger-kernel's GPU Triton kernels) are not in this build; training "
            "runs the model's own layers (the same loss, without Liger's memory savings)",
            stacklevel=2,
        )
    from verl.utils.device import _VALID as DEVICES

    device = trainer.device
    if device == "npu":
        raise ValueError(f"trainer.device=npu: {NPU} are not supported by this build; set trainer.device=cuda (or cpu)")
    if device not in DEVICES:
        raise ValueError(f"trainer.device={device!r} is not one of {list(DEVICES)}")
    if model.strategy not in STRATEGIES:
        raise ValueError(f"model.strategy={model.strategy!r} is not one of {list(STRATEGIES)} (both train with FSDP2)")
    if str(fsdp.model_dtype) not in MODEL_DTYPES:
        raise ValueError(f"model.fsdp_config.model_dtype={fsdp.model_dtype!r} is not one of {list(MODEL_DTYPES)}")
    if optim.lr_scheduler not in LR_SCHEDULERS:
        raise ValueError(f"optim.lr_scheduler={optim.lr_scheduler!r} is not one of {list(LR_SCHEDULERS)}")
    ratio = float(optim.lr_warmup_steps_ratio)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"optim.lr_warmup_steps_ratio={ratio} must be in [0, 1)")
    for key in ("save_contents", "load_contents"):
        contents = list(trainer.checkpoint[key])
        unknown = [c for c in contents if c not in CHECKPOINT_CONTENTS]
        if unknown:
            raise ValueError(f"trainer.checkpoint.{key}={contents}: {unknown} not among {list(CHECKPOINT_CONTENTS)}")
        if "model" not in contents:
            raise ValueError(
                f"trainer.checkpoint.{key}={contents} lacks 'model': a checkpoint always holds the weights (add 'model')"
            )
    if trainer.default_hdfs_dir:
        from verl.utils.checkpoint.checkpoint_manager import remote_checkpoint_dir_problem

        problem = remote_checkpoint_dir_problem(str(trainer.default_hdfs_dir))
        if problem:
            raise ValueError(f"trainer.default_hdfs_dir={trainer.default_hdfs_dir!r}: {problem}")


def _value(config, dotted: str):
    first = dotted.split(" / ")[0]
    return OmegaConf.select(config, first)


def sft_lr_factor(optim, total_steps: int):
    """The SFT schedule's lr at a step (0 = the first step) over `optim.lr`: linear warm-up from 0 over
    `lr_warmup_steps` (when > 0) or `lr_warmup_steps_ratio * total_steps`, then `optim.lr_scheduler`."""
    from verl.utils.optim import _constant_factor, _cosine_factor, _warmup_steps, _wsd_factor

    if optim.lr_scheduler not in LR_SCHEDULERS:
        raise ValueError(f"optim.lr_scheduler={optim.lr_scheduler!r} is not one of {list(LR_SCHEDULERS)}")
    warmup = _warmup_steps(optim, total_steps, "a positive number of training steps")
    min_lr_ratio, num_cycles = float(optim.get("min_lr_ratio") or 0.0), float(optim.get("num_cycles", 0.5))
    if optim.lr_scheduler == "constant":
        return _constant_factor(warmup)
    if optim.lr_scheduler == "cosine":
        return _cosine_factor(warmup, total_steps, min_lr_ratio, num_cycles)
    return _wsd_factor(warmup, total_steps, min_lr_ratio, num_cycles, WSD_STABLE_RATIO)


DEMO_PATH = os.path.join(os.path.dirname(CONFIG_PATH), "demo", "arith_sft.yaml")


def sft_config(overrides=(), demo: bool = False):
    """sft_trainer.yaml, with the demo's settings (`+demo=arith_sft`) when `demo`, and `key=value`
    overrides merged over it: the config the command line composes, for callers that build it in Python."""
    config = OmegaConf.load(CONFIG_PATH)
    if demo:
        config = OmegaConf.merge(config, OmegaConf.load(DEMO_PATH))
    config.merge_with_dotlist(list(overrides))
    return config


DEMO_HINT = "for the bundled CPU demo (generated data, bundled tiny model) add +demo=arith_sft"


def check_sft_inputs(config) -> None:
    """The model directory and the data files exist (local paths; hub ids and hdfs:// are fetched later):
    one ValueError naming every missing one, before anything loads. Upstream's defaults point at
    `~/models/gemma-1.1-7b-it` and `~/data/gsm8k/*.parquet`, which a fresh machine does not have."""
    from verl.trainer.preflight import _model_config
    from verl.utils.fs import is_non_local

    problems: list[str] = []
    _model_config("model.partial_pretrain", str(config.model.partial_pretrain), problems)
    for key in ("train_files", "val_files"):
        files = config.data[key]
        for path in [files] if isinstance(files, str) else list(files or []):
            if not is_non_local(str(path)) and not os.path.isfile(os.path.expanduser(str(path))):
                problems.append(
                    f"data.{key}: {path!r} is not a file (working directory {os.getcwd()!r}); point it at your "
                    "parquet files (upstream's gsm8k ones come from examples/data_preprocess/gsm8k.py)"
                )
    if problems:
        raise ValueError("; ".join(problems) + f" ({DEMO_HINT})")
