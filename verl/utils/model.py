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
