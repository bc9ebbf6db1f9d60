"""What every model merger shares: the command line, its config, and writing or checking an HF directory.

A backend (`FSDPModelMerger`, `MegatronModelMerger`) only has to say whether a directory is one of its checkpoints and
load the full state dict from it; everything after that is here.

Design decisions:
- The model class is found from the checkpoint's weight names, not from `config.architectures`. A
  critic is a `*ForTokenClassification` model built from a causal LM's config, so the config it
  saves may name the causal-LM class or no class at all. An empty (meta-device) instance of each
  candidate (`AutoModelForCausalLM`, `AutoModelForImageTextToText` for a vision-language model, then
  `AutoModelForTokenClassification`) is built from the
  config, and the first whose state-dict names equal the checkpoint's is used;
  `--is-value-model` restricts the search to token classification.
- Weights are written by that empty instance's `save_pretrained(state_dict=...)`, so tied weights
  (no `lm_head.weight` on disk when `tie_word_embeddings`), sharding of large files and the
  safetensors metadata are exactly what `from_pretrained` expects. Tied names must hold equal
  tensors in the checkpoint; a config that claims ties the weights do not have is an error rather
  than a silently different model.
- `--dtype auto` (the default) keeps the checkpoint's dtype, normally the fp32 master weights, so
  the merged model equals the trained one bit for bit. `--dtype bf16` halves the size; upstream's
  merger always writes bf16.
- The tokenizer files and generation_config.json are copied byte for byte from the checkpoint's
  `huggingface/` folder rather than re-saved through a tokenizer class, so inference sees exactly
  what training used.
- A LoRA checkpoint (peft names, `base_model.model.*`, plus the adapter in `lora_adapter/`) is
  merged: each adapted layer becomes `W + scaling * B @ A` (scaling from the adapter's
  `adapter_config.json`) under its plain HF name, so the output is an ordinary HF model; the
  adapter directory is copied beside it (`<target_dir>/lora_adapter`) for use with peft.
- A vision-language model's processor files (preprocessor_config.json, chat template, ...) are in
  `huggingface/` (the FSDP engine saves the processor there) and copied like the tokenizer's, so the
  merged directory loads with `AutoModelForImageTextToText` and `verl.utils.hf_processor`.
"""

from __future__ import annotations

import argparse
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from verl.models.factory import add_legacy_config_keys
from verl.utils.lora import (
    ADAPTER_DIR,
    PEFT_PREFIX,
    merge_lora_state,
    read_adapter_config,
    scaling_from_adapter_config,
)
from verl.utils.model import register_token_classifier

__all__ = [
    "BaseModelMerger",
    "ModelMergerConfig",
    "ModelMergerError",
    "generate_config_from_args",
    "parse_args",
    "require_checkpoint_dir",
]

BACKENDS = ("fsdp", "megatron")
DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")
# files of a HF directory that hold weights or the model config; everything else (tokenizer,
# generation config, chat template, ...) is copied from the checkpoint's huggingface/ folder
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_NOT_COPIED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


class ModelMergerError(ValueError):
    """A problem with the user's checkpoint or arguments (printed without a traceback by the CLI)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Upstream verl's `model_merger` arguments, plus `--dtype`."""
    parser = argparse.ArgumentParser(
        prog="python -m verl.model_merger",
        description="Merge a verl training checkpoint into a Hugging Face model directory, or check it against one.",
    )
    subparsers = parser.add_subparsers(dest="operation", required=True, metavar="{merge,test}")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--backend", required=True, choices=BACKENDS, help="the trainer's strategy: fsdp (fsdp, fsdp2) or megatron"
    )
    common.add_argument(
        "--local_dir",
        required=True,
        help="the role's checkpoint directory, e.g. checkpoints/PROJECT/EXPERIMENT/global_step_100/actor",
    )
    common.add_argument(
        "--hf_model_path",
        default=None,
        help="(deprecated) take config and tokenizer from this HF directory instead of LOCAL_DIR/huggingface",
    )
    common.add_argument(
        "--tie-word-embedding",
        dest="tie_word_embedding",
        action="store_true",
        help="tie the output embedding to the input embedding even if the saved config does not",
    )
    common.add_argument(
        "--is-value-model",
        dest="is_value_model",
        action="store_true",
        help="the checkpoint is a critic (value head): save it as *ForTokenClassification",
    )
    common.add_argument(
        "--use_cpu_initialization",
        action="store_true",
        help="accepted for upstream compatibility; merging always runs on the CPU",
    )
    common.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="weight dtype to write (auto: as stored in the checkpoint)"
    )

    merge = subparsers.add_parser("merge", parents=[common], help="write the merged HF model to --target_dir")
    merge.add_argument("--target_dir", default="tmp", help="output directory (created if missing)")
    merge.add_argument("--hf_upload_path", default=None, help="also upload to this Hugging Face Hub repo id")
    merge.add_argument("--private", action="store_true", help="make the uploaded Hub repo private")

    test = subparsers.add_parser("test", parents=[common], help="compare the checkpoint's weights with an HF model")
    test.add_argument("--test_hf_dir", required=True, help="the reference Hugging Face model directory")
    return parser.parse_args(argv)


@dataclass
class ModelMergerConfig:
    """What one merge or test run does (upstream's field names)."""

    operation: str
    """'merge' or 'test'."""
    backend: str
    local_dir: str
    """The role's checkpoint directory (`.../global_step_N/actor`)."""
    hf_model_config_path: str
    """Where config.json and the tokenizer files are read from."""
    target_dir: str | None = "tmp"
    hf_upload_path: str | None = None
    private: bool = False
    test_hf_dir: str | None = None
    tie_word_embedding: bool = False
    is_value_model: bool = False
    hf_model_path: str | None = None
    use_cpu_initialization: bool = False
    dtype: str = "auto"
    hf_upload: bool = field(init=False)

    def __post_init__(self):
        if self.operation not in ("merge", "test"):
            raise ModelMergerError(f"operation={self.operation!r} must be 'merge' or 'test'")
        if self.backend not in BACKENDS:
            raise ModelMergerError(f"backend={self.backend!r} must be one of {list(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ModelMergerError(f"dtype={self.dtype!r} must be one of {list(DTYPES)}")
        if self.operation == "test":
            if not self.test_hf_dir:
                raise ModelMergerError("the test operation compares against a reference model: pass --test_hf_dir")
            self.target_dir, self.hf_upload_path, self.private = None, None, False
        elif not self.target_dir:
            raise ModelMergerError("the merge operation needs --target_dir (where to write the HF model)")
        self.hf_upload = self.operation == "merge" and bool(self.hf_upload_path)


def generate_config_from_args(args: argparse.Namespace) -> ModelMergerConfig:
    local_dir = os.path.abspath(os.path.expanduser(args.local_dir))
    hf_model_path = os.path.expanduser(args.hf_model_path) if args.hf_model_path else None
    return ModelMergerConfig(
        operation=args.operation,
        backend=args.backend,
        local_dir=local_dir,
        hf_model_config_path=hf_model_path or os.path.join(local_dir, "huggingface"),
        target_dir=getattr(args, "target_dir", None),
        hf_upload_path=getattr(args, "hf_upload_path", None),
        private=getattr(args, "private", False),
        test_hf_dir=getattr(args, "test_hf_dir", None),
        tie_word_embedding=args.tie_word_embedding,
        is_value_model=args.is_value_model,
        hf_model_path=hf_model_path,
        use_cpu_initialization=args.use_cpu_initialization,
        dtype=args.dtype,
    )


def require_checkpoint_dir(local_dir: str) -> None:
    """Raise ModelMergerError unless `local_dir` exists, pointing at an interrupted save's leftovers."""
    if os.path.isdir(local_dir):
        return
    hint = ""
    if os.path.isdir(local_dir + ".tmp") or os.path.isdir(local_dir + ".old"):
        hint = (
            " A .tmp or .old directory of that name exists: the save was interrupted; use the previous "
            "global_step directory, or the .old one if a re-save crashed"
        )
    raise ModelMergerError(f"checkpoint directory {local_dir!r} does not exist.{hint}")


def _auto_classes(is_value_model: bool) -> list:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

    if is_value_model:
        return [AutoModelForTokenClassification]
    # vision-language models (Qwen2-VL, ...) have no causal-LM class: image-text-to-text holds them
    return [AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification]


def _sample(names, limit: int = 5) -> str:
    names = sorted(names)
    return str(names[:limit])[:-1] + (", ...]" if len(names) > limit else "]")


class BaseModelMerger(ABC):
    """Load a checkpoint's full state dict (the backend's job) and write or check an HF directory.

    Args:
        config: the run's `ModelMergerConfig`.
    """

    def __init__(self, config: ModelMergerConfig):
        from transformers import AutoConfig

        self.config = config
        self.check_checkpoint_layout()
        self.hf_model_config_path = config.hf_model_config_path
        if config.hf_model_path:
            print(
                "warning: --hf_model_path is deprecated: checkpoints carry their config and tokenizer in huggingface/"
            )
        if not os.path.isfile(os.path.join(self.hf_model_config_path, "config.json")):
            raise ModelMergerError(
                f"no config.json in {self.hf_model_config_path!r}: the checkpoint's huggingface/ folder (written by "
                "the checkpoint manager next to model/) holds the model config and tokenizer; restore it, or pass "
                "--hf_model_path pointing at the HF model the training started from"
            )
        self.model_config = AutoConfig.from_pretrained(self.hf_model_config_path)
        register_token_classifier(self.model_config)  # a GLM-4.5 critic's class (see verl.utils.model)
        if config.tie_word_embedding:
            self.model_config.tie_word_embeddings = True
        self.target_dtype = None if config.dtype == "auto" else _to_dtype(config.dtype)

    # --------------------------------------------------------------------------------- backend
    @abstractmethod
    def check_checkpoint_layout(self) -> None:
        """Raise ModelMergerError, saying which files are expected, unless `local_dir` is a checkpoint."""

    @abstractmethod
    def load_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state dict, on the CPU, in the checkpoint's dtype."""

    # ---------------------------------------------------------------------------------- public
    def run(self) -> None:
        if self.config.operation == "merge":
            self.merge_and_save()
        else:
            self.test()

    def merged_state_dict(self) -> tuple[dict[str, torch.Tensor], type]:
        """(the state dict in the requested dtype, the auto-model class its names belong to)."""
        state_dict = self._merge_lora(self.load_state_dict())
        if self.target_dtype is not None:
            state_dict = {k: v.to(self.target_dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        model_class = self.get_transformers_auto_model_class(state_dict)
        self._tie_shared_weights(model_class, state_dict)
        return state_dict, model_class

    def merge_and_save(self) -> str:
        """Write the HF directory to `target_dir` (and upload it if asked); returns its path."""
        state_dict, model_class = self.merged_state_dict()
        target = os.path.abspath(os.path.expanduser(self.config.target_dir))
        os.makedirs(target, exist_ok=True)
        shell = self._empty_model(model_class, self._dtype_of(state_dict))
        print(f"saving {type(shell).__name__} ({len(state_dict)} tensors) to {target}")
        shell.save_pretrained(target, state_dict=state_dict)
        add_legacy_config_keys(os.path.join(target, "config.json"))  # for engines pinned to transformers 4.x
        self._copy_tokenizer_and_generation_config(target)
        if os.path.isdir(self.lora_adapter_dir):
            shutil.copytree(self.lora_adapter_dir, os.path.join(target, ADAPTER_DIR), dirs_exist_ok=True)
        if self.config.hf_upload:
            self.upload_to_huggingface(target)
        return target

    def test(self) -> None:
        """Raise ModelMergerError listing every difference from the model in `test_hf_dir`."""
        state_dict, model_class = self.merged_state_dict()
        reference = model_class.from_pretrained(self.config.test_hf_dir, dtype=self._dtype_of(state_dict))
        expected = reference.state_dict()
        problems = []
        missing, extra = expected.keys() - state_dict.keys(), state_dict.keys() - expected.keys()
        if missing:
            problems.append(f"{len(missing)} reference tensors are not in the checkpoint: {_sample(missing)}")
        if extra:
            problems.append(f"{len(extra)} checkpoint tensors are not in the reference: {_sample(extra)}")
        for name in sorted(expected.keys() & state_dict.keys()):
            got, want = state_dict[name], expected[name]
            if got.shape != want.shape:
                problems.append(
                    f"{name}: shape {tuple(got.shape)} in the checkpoint, {tuple(want.shape)} in the reference"
                )
            elif not torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-6):
                diff = (got.double() - want.double()).abs().max().item()
                problems.append(f"{name}: values differ (max abs difference {diff:.3g})")
        if problems:
            raise ModelMergerError(
                f"checkpoint {self.config.local_dir!r} does not match {self.config.test_hf_dir!r}:\n  "
                + "\n  ".join(problems)
            )
        print(f"test passed: all {len(expected)} tensors match {self.config.test_hf_dir}")

    def upload_to_huggingface(self, folder: str) -> None:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo_id=self.config.hf_upload_path, private=self.config.private, exist_ok=True)
        api.upload_folder(folder_path=folder, repo_id=self.config.hf_upload_path, repo_type="model")
        print(f"uploaded {folder} to the Hugging Face Hub as {self.config.hf_upload_path}")

    # --------------------------------------------------------------------------------- helpers
    @property
    def lora_adapter_dir(self) -> str:
        return os.path.join(self.config.local_dir, ADAPTER_DIR)

    def _merge_lora(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A peft (LoRA) state dict merged into plain HF names; any other state dict unchanged."""
        if not any(name.startswith(PEFT_PREFIX) for name in state_dict):
            return state_dict
        if not os.path.isfile(os.path.join(self.lora_adapter_dir, "adapter_config.json")):
            raise ModelMergerError(
                f"{self.config.local_dir!r} holds a LoRA model (peft names such as "
                f"{_sample([n for n in state_dict if '.lora_' in n], 1)}) but no {ADAPTER_DIR}/adapter_config.json, "
                "which gives the adapter's scaling (lora_alpha / r); restore that directory from the checkpoint"
            )
        adapter_config = read_adapter_config(self.lora_adapter_dir)
        try:
            merged = merge_lora_state(
                state_dict.items(),
                scaling_from_adapter_config(adapter_config),
                fan_in_fan_out=bool(adapter_config.get("fan_in_fan_out", False)),
            )
            state_dict = dict(merged)
        except (KeyError, NotImplementedError) as e:
            raise ModelMergerError(f"cannot merge the LoRA adapter of {self.config.local_dir!r}: {e}") from e
        print(f"merged the LoRA adapter (r={adapter_config['r']}, lora_alpha={adapter_config['lora_alpha']})")
        return state_dict

    def get_transformers_auto_model_class(self, state_dict: dict[str, torch.Tensor]):
        """The auto class whose model, built from the config, has exactly the checkpoint's tensor names."""
        names = set(state_dict)
        tried = []
        for auto_class in _auto_classes(self.config.is_value_model):
            try:
                shell = self._empty_model(auto_class, torch.float32)
            except ValueError:  # this model type has no such head in transformers
                continue
            expected = set(shell.state_dict())
            if expected == names:
                return auto_class
            tried.append((auto_class.__name__, expected - names, names - expected))
        details = "; ".join(
            f"as {cls}: {len(missing)} missing (e.g. {_sample(missing, 3)}), {len(extra)} unexpected "
            f"(e.g. {_sample(extra, 3)})"
            for cls, missing, extra in tried
        )
        raise ModelMergerError(
            f"the {len(names)} tensors in {self.config.local_dir!r} do not fit any model built from "
            f"{os.path.join(self.hf_model_config_path, 'config.json')} (model_type={self.model_config.model_type!r}): "
            f"{details or 'transformers has neither a causal-LM nor a token-classification class for it'}. "
            "Check that huggingface/config.json belongs to this checkpoint"
        )

    def _empty_model(self, model_class, dtype: torch.dtype):
        with torch.device("meta"):
            return model_class.from_config(self.model_config, dtype=dtype)

    def _tie_shared_weights(self, model_class, state_dict: dict[str, torch.Tensor]) -> None:
        """Names sharing one parameter in the model must hold equal tensors in the checkpoint.

        They are then made one tensor again (DCP stores each name separately), so that
        `save_pretrained` writes it once, as HF checkpoints of tied models do.
        """
        shell = self._empty_model(model_class, torch.float32)
        groups: dict[int, list[str]] = {}
        for name, param in shell.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        for names in groups.values():
            first = names[0]
            for other in names[1:]:
                if not torch.equal(state_dict[first], state_dict[other]):
                    raise ModelMergerError(
                        f"the config ties {other} to {first} (tie_word_embeddings=True), but the checkpoint holds "
                        f"different tensors for them; the merged model would lose {other}. Drop "
                        "--tie-word-embedding, or fix tie_word_embeddings in huggingface/config.json"
                    )
                state_dict[other] = state_dict[first]

    @staticmethod
    def _dtype_of(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
        return next((v.dtype for v in state_dict.values() if v.is_floating_point()), torch.float32)

    def _copy_tokenizer_and_generation_config(self, target: str) -> None:
        source = self.hf_model_config_path
        if os.path.realpath(source) == os.path.realpath(target):
            # merging into the checkpoint's own huggingface/ (verl-recipe's char_count README does):
            # its tokenizer and generation config are already there
            return
        for name in sorted(os.listdir(source)):
            path = os.path.join(source, name)
            if not os.path.isfile(path) or name in _NOT_COPIED or name.endswith(_WEIGHT_SUFFIXES):
                continue
            shutil.copyfile(path, os.path.join(target, name))


def _to_dtype(name: str) -> torch.dtype:
    return {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }[name]
