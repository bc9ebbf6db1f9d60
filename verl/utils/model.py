"""Loading HF models for the actor, reference and critic, and small model helpers.

The actor and reference policies are `AutoModelForCausalLM`, or, for a vision-language config
(`verl.utils.vision.is_vision_language_config`: Qwen2-VL, Qwen2.5-VL, ...),
`AutoModelForImageTextToText` (`AutoModelForCausalLM` does not map those families), whose state-dict
names are the checkpoint's (`model.visual.*`, `model.language_model.*`, `lm_head.weight`). The critic is the same backbone with
a one-output token-classification head (`AutoModelForTokenClassification`, `num_labels=1`), as
upstream verl does: loading a causal-LM checkpoint that way keeps the backbone and initialises
the `score` head fresh, so any decoder with a `*ForTokenClassification` class can be a critic.
A family whose transformers module has none (GLM-4.5's `glm4_moe`, the Qwen2-VL family's
vision-language models) gets transformers' own generic head over its base model (`GenericForTokenClassification`, what every other family's class is),
registered with `AutoModelForTokenClassification` on first use (`register_token_classifier`).

Loading errors say which config key to fix: a path that does not exist, a checkpoint whose model
type has no causal-LM (or token-classification) class.

Sharded loading: a rank > 0 of an FSDP-sharded model passes `meta_device=True` and gets the
model's structure on the meta device without reading the checkpoint (no host copy of the weights);
rank 0's loaded weights then reach its shards by broadcast
(`verl.utils.fsdp_utils.load_full_state_from_rank0`).

Attention backend: flash-attention 2 when a CUDA device is in use and `flash_attn` is installed
(its varlen kernel serves the packed remove-padding path), SDPA otherwise (CPU included).

A config from another directory (`actor_rollout_ref.model.hf_config_path`, upstream's key):
`model_dir_with_config` gives the one directory every loader of the policy reads (FSDP and Megatron
engines, every rollout engine, vLLM and SGLang included): the weights and tokenizer files of `path`
with `config.json` and `generation_config.json` of `hf_config_path` in their place (`path`'s are
left out even where `hf_config_path` has none), and its remote-code `*.py` over `path`'s of the same
name (symbolic links, in a directory named after a hash of both). One directory rather than a
config object handed around, because vLLM, SGLang and the external engines take a path, not a config.
As upstream, the generation config follows the config directory (absent there: derived from its
config.json), and the tokenizer stays at `tokenizer_path` or `path`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile

import torch

from verl.utils.device import is_cuda_available

__all__ = [
    "LambdaLayer",
    "check_exclude_modules",
    "check_target_modules",
    "convert_weight_keys",
    "create_huggingface_actor",
    "create_huggingface_critic",
    "get_hf_auto_model_class",
    "get_huggingface_actor_config",
    "get_lora_rank_from_adapter",
    "get_model_size",
    "normalize_model_name",
    "print_model_size",
    "squeeze",
    "compute_position_id_with_mask",
    "create_random_mask",
    "enable_gradient_checkpointing",
    "extract_multi_modal_inputs",
    "get_attn_implementation",
    "get_generation_config",
    "load_causal_lm",
    "load_model_config",
    "load_valuehead_model",
    "model_dir_with_config",
    "register_token_classifier",
    "update_model_config",
]


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions [B, L] counting real tokens from 0 in each row; pad positions get 0.

    Works for left padding (prompts) and right padding (responses) alike, and gives each row's
    real tokens contiguous positions, which the packed forward relies on.
    """
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)


def get_attn_implementation() -> str:
    """'flash_attention_2' on CUDA with flash-attn installed, else 'sdpa'."""
    if is_cuda_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _default_attn_implementation(auto_cls, config) -> str:
    """`get_attn_implementation()`, or "eager" for a transformers class that does not implement it
    (gpt-oss has no sdpa path: its attention sinks join the softmax)."""
    choice = get_attn_implementation()
    flag = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}[choice]
    try:
        model_cls = auto_cls._model_mapping[type(config)]
    except KeyError:  # remote code: the model's own class decides
        return choice
    return choice if getattr(model_cls, flag, True) else "eager"


# files of `path` that `hf_config_path` always replaces (left out where it has none); its `*.py` replace
# `path`'s of the same name
_CONFIG_FILES = ("config.json", "generation_config.json")


def _local_model_dir(path: str, key: str) -> str:
    """`path` as a local directory: itself, or a hub id's snapshot in the HF cache (downloaded if needed)."""
    full = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.isdir(full):
        return full
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=str(path))
    except Exception as e:  # any hub failure: not a repository, offline, ...
        raise FileNotFoundError(
            f"{key}={path!r} is neither a local directory nor a Hugging Face hub model that could be fetched ({e}); "
            "point it at a local model directory"
        ) from e


def model_dir_with_config(path: str, hf_config_path: str | None = None, key: str = "actor_rollout_ref.model") -> str:
    """The directory to load the model at `path` from, with `hf_config_path`'s config (see the module
    docstring): `path` itself when `hf_config_path` is None. Every process on a machine gets the same
    directory; it is written once (atomically) and reused."""
    if not hf_config_path:
        return path
    weights = _local_model_dir(path, f"{key}.path")
    config_dir = _local_model_dir(hf_config_path, f"{key}.hf_config_path")
    config_file = os.path.join(config_dir, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"{key}.hf_config_path={hf_config_path!r} has no config.json; point it at the directory whose config.json "
            f"should replace the one of {key}.path, or set it to null"
        )
    from_config = [n for n in os.listdir(config_dir) if n in _CONFIG_FILES or n.endswith(".py")]
    digest = hashlib.sha256()
    for part in (weights, config_dir, *sorted(os.listdir(weights)), "|", *sorted(from_config)):
        digest.update(part.encode() + b"\0")
    for name in sorted(from_config):
        with open(os.path.join(config_dir, name), "rb") as f:
            digest.update(f.read())
    out = os.path.join(tempfile.gettempdir(), "verl-hf-config", digest.hexdigest()[:20])
    if os.path.isdir(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(out))
    for name in os.listdir(weights):
        if name not in _CONFIG_FILES and name not in from_config:
            os.symlink(os.path.join(weights, name), os.path.join(staging, name))
    for name in from_config:
        os.symlink(os.path.join(config_dir, name), os.path.join(staging, name))
    try:
        os.rename(staging, out)
    except OSError:  # another process of this machine wrote it first: the same files
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return out


def load_model_config(path: str, trust_remote_code: bool = False, override_config: dict | None = None):
    """`AutoConfig` for `path` with overrides applied; a clear error when the path is not a model."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        where = "a local directory without a config.json" if os.path.isdir(path) else "not a local directory"
        raise FileNotFoundError(
            f"model path {path!r} could not be loaded ({where}; Hugging Face said: {e}). Set the model's "
            "`path` key (e.g. actor_rollout_ref.model.path or critic.model.path) to a directory holding a "
            "Hugging Face checkpoint (config.json + weights), or to a model id that is in the local HF cache"
        ) from e
    for key, value in (override_config or {}).items():
        setattr(config, key, value)
    return config


def _auto_load(
    auto_cls,
    kind: str,
    path: str,
    config,
    torch_dtype,
    attn_implementation,
    trust_remote_code,
    meta_device=False,
    key_mapping=None,
):
    if type(config) not in auto_cls._model_mapping and not trust_remote_code:
        raise ValueError(
            f"model at {path!r} has model_type={config.model_type!r}, which has no {kind} class in transformers "
            f"(architectures: {getattr(config, 'architectures', None)}); point the model path at a decoder-only "
            "language model such as Qwen2 or Llama"
        )
    if meta_device:
        with torch.device("meta"):
            return auto_cls.from_config(
                config,
                dtype=torch_dtype,
                attn_implementation=attn_implementation or _default_attn_implementation(auto_cls, config),
                trust_remote_code=trust_remote_code,
            )
    extra = {"key_mapping": key_mapping} if key_mapping else {}
    return auto_cls.from_pretrained(
        path,
        **extra,
        config=config,
        dtype=torch_dtype,
        attn_implementation=attn_implementation or _default_attn_implementation(auto_cls, config),
        trust_remote_code=trust_remote_code,
    )


def load_causal_lm(
    path: str,
    torch_dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict | None = None,
    meta_device: bool = False,
):
    """`AutoModelForCausalLM` from `path` (`AutoModelForImageTextToText` for a vision-language config;
    weights in `torch_dtype`, on CPU); with `meta_device`, the same model on the meta device, its
    weights not read (see the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from verl.utils.vision import is_vision_language_config

    config = load_model_config(path, trust_remote_code, override_config)
    vision = is_vision_language_config(config)
    return _auto_load(
        AutoModelForImageTextToText if vision else AutoModelForCausalLM,
        "image-text-to-text" if vision else "causal-LM",
        path,
        config,
        torch_dtype,
        attn_implementation,
        trust_remote_code,
        meta_device,
    )


# model_type -> (module, base class) of the families transformers gives no `*ForTokenClassification`
_GENERIC_TOKEN_CLASSIFIERS = {
    "glm4_moe": ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoePreTrainedModel"),
    # vision-language critics: the value head over the image-text base model (vision tower + language model)
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLPreTrainedModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLPreTrainedModel"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLPreTrainedModel"),
    "qwen3_vl_moe": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoePreTrainedModel"),
}

# Qwen2-VL family checkpoints written before transformers 5 name the vision tower `visual.*` and the language
# model `model.*`; transformers converts them for its own classes only, so the generic value head maps them
_VL_KEY_MAPPING = {r"^visual": "model.visual", r"^model(?!\.(language_model|visual))": "model.language_model"}


def register_token_classifier(config) -> None:
    """Make `AutoModelForTokenClassification` build `config`'s family when transformers has no class
    for it but the family is in `_GENERIC_TOKEN_CLASSIFIERS` (then `<Family>ForTokenClassification`:
    the base model, dropout and a `score` linear, as transformers writes the others). Idempotent;
    a no-op for every other config."""
    from transformers import AutoModelForTokenClassification

    entry = _GENERIC_TOKEN_CLASSIFIERS.get(getattr(config, "model_type", None))
    if entry is None or type(config) in AutoModelForTokenClassification._model_mapping:
        return
    from transformers.modeling_layers import GenericForTokenClassification

    base = getattr(importlib.import_module(entry[0]), entry[1])
    name = base.__name__.replace("PreTrainedModel", "ForTokenClassification")
    # transformers decides whether a class's experts implementation (grouped_mm / eager) may be set by reading
    # the source of the class's module for its decorator; this class's module is ours, so it takes the base's answer
    can_set_experts = (
        base._can_set_experts_implementation() if hasattr(base, "_can_set_experts_implementation") else False
    )
    attrs = {"__module__": __name__, "_can_set_experts_implementation_cached_value": can_set_experts}
    cls = type(name, (GenericForTokenClassification, base), attrs)
    globals()[name] = cls  # importable by name, as pickling and `architectures` expect
    AutoModelForTokenClassification.register(type(config), cls, exist_ok=True)


def load_valuehead_model(
    path: str,
    torch_dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict | None = None,
    meta_device: bool = False,
):
    """Critic: the backbone at `path` with a fresh scalar head (`*ForTokenClassification`, 1 label).

    Dropout in the head is disabled: value targets are regressed, and dropout would make
    `compute_values` and `update_critic` see different functions. `meta_device` as in `load_causal_lm`.
    """
    from transformers import AutoModelForTokenClassification

    from verl.utils.vision import is_vision_language_config

    overrides = {"num_labels": 1, "classifier_dropout": 0.0, "hidden_dropout": 0.0, **(override_config or {})}
    config = load_model_config(path, trust_remote_code, overrides)
    register_token_classifier(config)
    return _auto_load(
        AutoModelForTokenClassification,
        "token-classification (value head)",
        path,
        config,
        torch_dtype,
        attn_implementation,
        trust_remote_code,
        meta_device,
        # the generic head's base model has the image-text model's names; the causal-LM checkpoint on disk
        # may still hold the older ones (`visual.*`, `model.layers.*`), which only that class converts
        key_mapping=_VL_KEY_MAPPING if is_vision_language_config(config) else None,
    )


def load_sequence_classifier(
    path: str,
    torch_dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict | None = None,
):
    """Reward model: the `*ForSequenceClassification` checkpoint at `path` with one output."""
    from transformers import AutoModelForSequenceClassification

    config = load_model_config(path, trust_remote_code, {"num_labels": 1, **(override_config or {})})
    return _auto_load(
        AutoModelForSequenceClassification,
        "sequence-classification (reward model)",
        path,
        config,
        torch_dtype,
        attn_implementation,
        trust_remote_code,
    )


def get_generation_config(path: str, trust_remote_code: bool = False):
    """The checkpoint's `GenerationConfig`, or one derived from its model config when absent."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_model_config(load_model_config(path, trust_remote_code))


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant, FSDP2-safe)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def create_random_mask(
    input_ids: torch.Tensor,
    max_ratio_of_valid_token: float,
    max_ratio_of_left_padding: float,
    min_ratio_of_valid_token: float = 0,
) -> torch.Tensor:
    """A random attention mask [B, L] (int64) for `input_ids` [B, L], for tests of padding handling.

    Each row gets `left` padding zeros, then `valid` ones, then zeros: `left` uniform in
    [0, int(L * max_ratio_of_left_padding)] and `valid` uniform in
    [max(1, int(L * min_ratio_of_valid_token)), int(L * max_ratio_of_valid_token)], drawn per row
    (left first) from numpy's global generator, so `np.random.seed` makes it repeatable.
    """
    import numpy as np

    if not 0 < max_ratio_of_valid_token <= 1.0:
        raise ValueError(f"max_ratio_of_valid_token must be in (0, 1], got {max_ratio_of_valid_token}")
    if not 0 <= max_ratio_of_left_padding < 1.0:
        raise ValueError(f"max_ratio_of_left_padding must be in [0, 1), got {max_ratio_of_left_padding}")
    if min_ratio_of_valid_token > max_ratio_of_valid_token:
        raise ValueError("min_ratio_of_valid_token must not exceed max_ratio_of_valid_token")
    batch_size, seq_len = input_ids.shape
    max_valid = int(seq_len * max_ratio_of_valid_token)
    min_valid = max(1, int(seq_len * min_ratio_of_valid_token))
    max_left = int(seq_len * max_ratio_of_left_padding)
    if max_valid < 1 or max_valid + max_left > seq_len or min_valid > max_valid:
        raise ValueError(
            f"a row of {seq_len} tokens cannot hold up to {max_left} padding tokens plus {min_valid}..{max_valid} "
            "valid ones; lower the ratios"
        )
    mask = torch.zeros_like(input_ids, dtype=torch.int64)
    for row in range(batch_size):
        left = int(np.random.randint(low=0, high=max_left + 1, dtype=np.int64))
        valid = int(np.random.randint(low=min_valid, high=max_valid + 1, dtype=np.int64))
        mask[row, left : left + valid] = 1
    return mask


def update_model_config(module_config, override_config_kwargs: dict) -> None:
    """Set attributes of an HF config from a (nested) dict, in place: a dict value updates the
    sub-config of that name (`{"text_config": {"rope_theta": 1e6}}`)."""
    for key, value in override_config_kwargs.items():
        if isinstance(value, dict):
            sub_config = getattr(module_config, key, None)
            if sub_config is None:
                raise AttributeError(f"the model config has no sub-config {key!r} to update with {value}")
            update_model_config(sub_config, value)
        else:
            setattr(module_config, key, value)


def extract_multi_modal_inputs(batch_data: list, indices: list[int] | None = None) -> dict:
    """Merge the per-sample multi-modal input dicts (`pixel_values`, `image_grid_thw`, ...) of a batch.

    `batch_data` holds one dict (or None for a text-only sample, or a NonTensorData wrapping one)
    per sample; `indices` selects samples (out-of-range ones are skipped). Each key's tensors are
    concatenated along dim 0, except when any sample has an `image_bound` key (MiniCPM-o), whose
    model takes per-sample lists: then each key maps to the list of tensors.
    """
    selected = batch_data if indices is None else [batch_data[i] for i in indices if i < len(batch_data)]
    collected: dict[str, list] = {}
    per_sample_lists = False
    for inputs in selected:
        inputs = getattr(inputs, "data", inputs) if type(inputs).__name__ == "NonTensorData" else inputs
        if inputs is None:
            continue
        per_sample_lists = per_sample_lists or "image_bound" in inputs
        for key, value in inputs.items():
            if value is not None:
                collected.setdefault(key, []).append(value)
    if per_sample_lists:
        return collected
    return {key: torch.cat(values, dim=0) for key, values in collected.items()}


# ----------------------------------------------------------------------------------------------
# Upstream's smaller model helpers (size, key conversion, LoRA module matching, model from config)
# ----------------------------------------------------------------------------------------------

_SIZE_SCALES = {"B": 1e9, "M": 1e6, "K": 1e3, "": 1.0}


def get_model_size(model: torch.nn.Module, scale: str = "auto") -> tuple[float, str]:
    """(number of parameters divided by the scale, scale): `scale` is "B", "M", "K", "" or "auto"
    (the largest unit the count exceeds)."""
    n_params = sum(p.numel() for p in model.parameters())
    if scale == "auto":
        scale = next((unit for unit, size in _SIZE_SCALES.items() if size > 1 and n_params > size), "")
    if scale not in _SIZE_SCALES:
        raise NotImplementedError(f"scale={scale!r} is not one of 'auto', {list(_SIZE_SCALES)}")
    return n_params / _SIZE_SCALES[scale], scale


def print_model_size(model: torch.nn.Module, name: str | None = None) -> None:
    """Print "<name> contains <n><scale> parameters" (name: the model's class name by default)."""
    n_params, scale = get_model_size(model, scale="auto")
    print(f"{name or type(model).__name__} contains {n_params:.2f}{scale} parameters")


def convert_weight_keys(state_dict: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Rename a state dict of a transformers model that renames checkpoint keys on load
    (`model._checkpoint_conversion_mapping`, e.g. Qwen2-VL's `model.language_model.*`) back to the
    checkpoint's names; returned unchanged for a model without such a mapping. The first reverse
    pattern that matches a key renames it."""
    import re

    mapping = getattr(model, "_checkpoint_conversion_mapping", None)
    if not mapping:
        return state_dict
    reverse = [(saved_as, re.sub(r"\(.*\)", "", original.lstrip("^"))) for original, saved_as in mapping.items()]
    converted = {}
    for key, value in state_dict.items():
        for pattern, replacement in reverse:
            key, n = re.subn(pattern, replacement, key)
            if n:
                break
        converted[key] = value
    return converted


def check_exclude_modules(config, key: str) -> bool:
    """Whether module `key` is excluded by a LoRA-style config's `exclude_modules` (PEFT's rule: a
    string is a full-match regex; a list matches the exact key or a `.<name>` suffix)."""
    import re

    exclude = getattr(config, "exclude_modules", None)
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, key) is not None
    return key in exclude or any(key.endswith(f".{name}") for name in exclude)


def _layer_index(key: str, layers_pattern) -> int | None:
    """The layer number in a module key (`model.layers.3.mlp` -> 3), after one of `layers_pattern`
    when given, else after any second-to-last dotted name."""
    import re

    if not layers_pattern:
        found = re.match(r".*\.[^.]*\.(\d+)\.", key)
        return int(found.group(1)) if found else None
    for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
        found = re.match(rf".*\.{pattern}\.(\d+)\.", key)
        if found:
            return int(found.group(1))
    return None


def check_target_modules(config, key: str) -> bool:
    """Whether module `key` is a LoRA target of `config` (PEFT's rule): `target_modules` a full-match
    regex string, or a list matching the exact key or a `.<name>` suffix; a suffix match is further
    restricted to `layers_to_transform` (an int or a list of layer numbers, found after
    `layers_pattern`) when that is set."""
    import re

    targets = config.target_modules
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{name}") for name in targets):
        return False
    layers = getattr(config, "layers_to_transform", None)
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    index = _layer_index(key, getattr(config, "layers_pattern", None))
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def normalize_model_name(name: str, pp_rank: int, vpp_rank: int | None, transformer_config, layer_name: str = "layers"):
    """A parameter name of one Megatron pipeline chunk (layer numbers local to the chunk) with its
    layer number made global: the number after `layer_name` plus the chunk's first layer (megatron's
    `get_transformer_layer_offset` for `pp_rank`, `vpp_rank`). Names outside the layers unchanged."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    parts = name.split(".")
    if layer_name not in parts:
        return name
    at = parts.index(layer_name) + 1
    if at >= len(parts) or not parts[at].isdigit():
        raise ValueError(f"parameter name {name!r} has no layer number after {layer_name!r}")
    offset = get_transformer_layer_offset(transformer_config, vp_stage=vpp_rank, pp_rank=pp_rank)
    parts[at] = str(int(parts[at]) + offset)
    return ".".join(parts)


def get_hf_auto_model_class(hf_config):
    """The transformers Auto class to build a model of `hf_config` with: for remote code, the Auto
    class its `auto_map` names for its architecture (AutoModel for an unknown one); else
    AutoModelForImageTextToText for a vision-language config, or the Auto class of the
    architecture's suffix (ForCausalLM, ForVision2Seq, ForTokenClassification,
    ForSequenceClassification), AutoModel otherwise. (`AutoModelForVision2Seq`, gone from transformers
    5, is AutoModelForImageTextToText here.)"""
    import transformers

    image_text = transformers.AutoModelForImageTextToText
    by_name = {
        "AutoModelForVision2Seq": image_text,
        "AutoModelForImageTextToText": image_text,
        "AutoModelForCausalLM": transformers.AutoModelForCausalLM,
    }
    architecture = (getattr(hf_config, "architectures", None) or [""])[0]
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if architecture:
        for auto_name, target in auto_map.items():
            if architecture in str(target):
                return by_name.get(auto_name, transformers.AutoModel)
    if type(hf_config) in image_text._model_mapping:
        return image_text
    by_suffix = {
        "ForCausalLM": transformers.AutoModelForCausalLM,
        "ForVision2Seq": image_text,
        "ForTokenClassification": transformers.AutoModelForTokenClassification,
        "ForSequenceClassification": transformers.AutoModelForSequenceClassification,
    }
    return next((cls for suffix, cls in by_suffix.items() if suffix in architecture), transformers.AutoModel)


def get_lora_rank_from_adapter(adapter_path: str | os.PathLike) -> int:
    """The LoRA rank `r` of the PEFT adapter saved in the directory `adapter_path`
    (`adapter_config.json`); FileNotFoundError or ValueError saying what is missing."""
    import json

    path = os.path.abspath(os.path.expanduser(str(adapter_path)))
    if not os.path.exists(path):
        raise FileNotFoundError(f"LoRA adapter path not found: {path}")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"adapter_config.json not found in {path}; is it a PEFT adapter directory?")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"Invalid JSON in {config_path}: {e}") from e
    if "r" not in config:
        raise ValueError(f"LoRA rank 'r' not found in {config_path}")
    try:
        return int(config["r"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"Cannot parse LoRA rank from {config_path}: r={config['r']!r}") from e


class LambdaLayer(torch.nn.Module):
    """A module whose forward is the function it wraps (to put a function in an `nn.Sequential`)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def squeeze(x: torch.Tensor) -> torch.Tensor:
    """Drop the last dimension (of size 1): a value head's [..., 1] -> [...]."""
    return torch.squeeze(x, dim=-1)


def get_huggingface_actor_config(model_name: str, override_config_kwargs: dict | None = None, trust_remote_code=False):
    """The HF config of `model_name` (a directory or hub id) with `override_config_kwargs` set on it
    (nested dicts update sub-configs, `update_model_config`)."""
    from transformers import AutoConfig

    if override_config_kwargs is not None and not isinstance(override_config_kwargs, dict):
        raise TypeError(f"override_config_kwargs must be a dict, got {type(override_config_kwargs).__name__}")
    config = AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    update_model_config(config, override_config_kwargs or {})
    return config


def create_huggingface_actor(model_name: str, override_config_kwargs=None, automodel_kwargs=None) -> torch.nn.Module:
    """A causal LM with `model_name`'s (overridden) config and *freshly initialised* weights
    (`AutoModelForCausalLM.from_config(config, **automodel_kwargs)`); `load_causal_lm` loads weights."""
    from transformers import AutoModelForCausalLM

    automodel_kwargs = dict(automodel_kwargs or {})
    config = get_huggingface_actor_config(
        model_name, override_config_kwargs, trust_remote_code=automodel_kwargs.get("trust_remote_code", False)
    )
    return AutoModelForCausalLM.from_config(config, **automodel_kwargs)


def create_huggingface_critic(model_name: str, override_config_kwargs=None, automodel_kwargs=None) -> torch.nn.Module:
    """`create_huggingface_actor` with its LM head replaced by a value head: Linear(hidden, 1) then
    a squeeze, so the model's `logits` are values [B, L] (upstream's legacy critic; the critic
    workers use `load_valuehead_model`)."""
    critic = create_huggingface_actor(model_name, override_config_kwargs, automodel_kwargs)
    dtype = (automodel_kwargs or {}).get("torch_dtype", torch.float32)
    critic.lm_head = torch.nn.Sequential(
        torch.nn.Linear(critic.config.hidden_size, 1, dtype=dtype), LambdaLayer(fn=squeeze)
    )
    return critic


def _causal_lm_output_for_ppo():
    from dataclasses import dataclass

    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclass
    class CausalLMOutputForPPO(CausalLMOutputWithPast):
        """A causal LM's output with the per-token `log_probs` and `entropy` a fused PPO head computes."""

        log_probs: torch.FloatTensor | None = None
        entropy: torch.FloatTensor | None = None

    CausalLMOutputForPPO.__module__ = __name__
    CausalLMOutputForPPO.__qualname__ = "CausalLMOutputForPPO"
    return CausalLMOutputForPPO


def __getattr__(name: str):
    # transformers is imported on first use of the output class, not when this module is imported
    if name == "CausalLMOutputForPPO":
        cls = _causal_lm_output_for_ppo()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
