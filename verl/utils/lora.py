"""LoRA for the actor, through peft: wrapping, merged weights for the rollout, the adapter on disk.

`actor_rollout_ref.model.lora_rank > 0` wraps the actor's HF model with peft's LoRA
(`apply_lora`) before FSDP2 shards it: every targeted linear layer `W` gains trainable `A` [r, in]
and `B` [out, r] (B starts at zero, so training starts from the base model), the base weights are
frozen and the optimizer only sees the adapters. The layer computes
`W x + scaling * B A x` with `scaling = lora_alpha / r`.

Design decisions:
- The reference policy is the same model with the adapters switched off (peft's
  `disable_adapter()`), so LoRA runs hold one copy of the base weights, not two (upstream does the
  same). The base is frozen, so this *is* the initial policy.
- The rollout engine never sees peft: `merge_lora_state` turns the streamed peft state dict
  (`base_model.model.<name>.base_layer.weight`, `...lora_A.default.weight`, ...) into plain HF
  names with `W + scaling * B @ A` per adapted layer, one layer at a time (peak memory: one full
  weight plus its two small factors), computed in at least float32.
- Checkpoints hold the whole peft model in `model/` (so a resume restores base and adapters
  exactly) plus the adapter alone in PEFT's own format in `lora_adapter/`
  (`adapter_config.json` + `adapter_model.safetensors`, what `PeftModel.from_pretrained` loads).
  The model merger uses that config's `lora_alpha`/`r` to write merged HF weights.
- Only peft's `Linear` LoRA layers are merged (what `target_modules=all-linear` or a list of
  linear layers creates); other adapted layer types (embeddings, convolutions) are refused with
  the name of the layer, rather than synced without their adapter.

The critic (`critic.model.lora_rank > 0`, upstream's FSDP critic): the value model is wrapped with
peft's TOKEN_CLS task, so its fresh value head (`score`) trains whole beside the adapters (peft's
`modules_to_save`) and gets no adapter of its own; `lora_adapter/` then holds the head's trained
copy too, and the merged weights name it `score.weight` again. It has no adapter path.

Starting from a trained adapter (`model.lora_adapter_path`, upstream's key):
- The adapter directory (`adapter_config.json` + `adapter_model.safetensors`, what peft's
  `save_pretrained` and our checkpoints' `lora_adapter/` hold) decides the LoRA layout: its `r`,
  `lora_alpha` and `target_modules` replace `lora_rank`, `lora_alpha`, `target_modules` and
  `exclude_modules` of the config (a trained adapter only fits the layout it was trained with;
  the config validator warns when a LoRA config set beside it disagrees). The path alone turns
  LoRA on, as upstream's does, so `lora_rank` may stay 0.
- Its `lora_dropout` is not used: adapters train here without dropout (fresh ones too), so the
  training forward is the function whose merged weights the rollout samples from.
- Adapter features that `W + scaling * B @ A` does not describe (DoRA, LoRA biases, extra
  trained modules, per-layer rank or alpha patterns, ...) are refused when the config is
  validated, with the field to change, rather than trained and then synced wrongly.
- Every rank checks the adapter's tensor names and shapes against its own (possibly meta-device)
  peft model before any weight is read, so a misfit adapter fails on all ranks alike with the
  layer and both shapes; only ranks holding real weights read the file (the others receive the
  weights with the base model's broadcast).
- The reference policy stays the base model with the adapters off: KL terms measure the drift
  from the base model, not from the adapter the run started with (upstream's behaviour).
- A resumed run builds the same layout from the adapter, then its checkpoint's `model/`
  replaces every weight, adapters included: the adapter's weights only matter at step 0.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping

import torch

__all__ = [
    "ADAPTER_DIR",
    "PEFT_PREFIX",
    "apply_lora",
    "build_lora_config",
    "check_adapter_dir",
    "is_peft_model",
    "lora_enabled",
    "lora_config_from_adapter",
    "lora_scalings",
    "load_adapter_weights",
    "merge_lora_state",
    "read_adapter_config",
    "save_lora_adapter",
    "scaling_from_adapter_config",
]

PEFT_PREFIX = "base_model.model."
ADAPTER_DIR = "lora_adapter"
ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# adapter_config.json fields whose non-default values make a layer compute something other than
# `W x + scaling * B A x` (or train more than A and B), so the merged rollout weights would be wrong
_UNMERGEABLE_ADAPTER_FIELDS = {
    "use_dora": "DoRA rescales the merged weight by a learned magnitude",
    "lora_bias": "LoRA biases add a trained bias to B",
    "modules_to_save": "whole modules trained beside the adapters",
    "trainable_token_indices": "trained embedding rows beside the adapters",
    "target_parameters": "adapters on raw parameters (MoE experts) instead of linear layers",
    "layer_replication": "layers duplicated by the adapter",
    "alora_invocation_tokens": "activated LoRA applies the adapter only after its invocation tokens",
    "use_qalora": "quantization-aware LoRA",
    "rank_pattern": "per-layer ranks",
    "alpha_pattern": "per-layer alphas",
}


def _plain(value):
    """OmegaConf lists/dicts as plain Python (peft validates types)."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # omegaconf is a dependency; plain values work without it
        pass
    return value


def lora_enabled(model_cfg) -> bool:
    """Whether the model section asks for LoRA: a positive `lora_rank` or a `lora_adapter_path`."""
    model_cfg = model_cfg or {}
    return int(model_cfg.get("lora_rank", 0) or 0) > 0 or bool(model_cfg.get("lora_adapter_path"))


def check_adapter_dir(path: str) -> dict:
    """The adapter config of the peft LoRA adapter directory `path`, after checking that this
    project can train and merge it; ValueError saying what is wrong and what to do otherwise."""
    what = "a peft LoRA adapter directory (adapter_config.json + adapter_model.safetensors, what "
    what += "PeftModel.save_pretrained or a checkpoint's actor/lora_adapter/ holds)"
    if not os.path.isdir(path):
        raise ValueError(f"{path} does not exist or is not a directory; point it at {what}")
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not os.path.isfile(os.path.join(path, f))]
    if missing:
        hint = ""
        if ADAPTER_WEIGHTS in missing and os.path.isfile(os.path.join(path, "adapter_model.bin")):
            hint = (
                " (it has adapter_model.bin: re-save it with PeftModel.save_pretrained(..., safe_serialization=True))"
            )
        raise ValueError(f"{path} lacks {' and '.join(missing)}{hint}; point it at {what}")
    try:
        config = read_adapter_config(path)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}/{ADAPTER_CONFIG} cannot be read as JSON ({e}); point it at {what}") from e
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"{path} holds a peft_type={config.get('peft_type')!r} adapter, not a LoRA one; point it at {what}"
        )
    unmergeable = [
        f"{field}={config[field]!r} ({why})" for field, why in _UNMERGEABLE_ADAPTER_FIELDS.items() if config.get(field)
    ]
    if config.get("bias", "none") != "none":
        unmergeable.append(f"bias={config['bias']!r} (trained biases of the base layers)")
    if unmergeable:
        raise ValueError(
            f"{path} uses {', '.join(unmergeable)}: the rollout engine receives W + scaling * B @ A per layer, "
            "which does not describe that; use a plain LoRA adapter (merge this one into the base model with "
            "merge_and_unload() and train a fresh one with lora_rank > 0 instead)"
        )
    return config


def lora_config_from_adapter(path: str):
    """peft `LoraConfig` of the adapter at `path` (checked by `check_adapter_dir`), made trainable
    and without dropout (see the module docstring)."""
    from peft import LoraConfig

    check_adapter_dir(path)
    config = LoraConfig.from_pretrained(path)
    config.inference_mode = False
    config.lora_dropout = 0.0
    config.task_type = "CAUSAL_LM"
    return config


# the one-output head of a value model (`*ForTokenClassification`): trained whole beside the adapters
# (peft's TOKEN_CLS task puts it in `modules_to_save`), so it never gets an adapter of its own
VALUE_HEAD_MODULES = ("score", "classifier")


def build_lora_config(model_cfg, value_head: bool = False):
    """peft `LoraConfig` from the model section: `lora_rank`, `lora_alpha`, `target_modules`, `exclude_modules`.

    With `value_head` (the critic), peft's TOKEN_CLS task: the value head trains whole beside the
    adapters and is excluded from `target_modules` (`all-linear` would otherwise adapt it too)."""
    from peft import LoraConfig

    rank = int(model_cfg.get("lora_rank", 0) or 0)
    if rank <= 0:
        raise ValueError(f"model.lora_rank={rank}: LoRA needs a positive rank (0 trains all weights without LoRA)")
    alpha = model_cfg.get("lora_alpha", 16)
    if alpha is None or float(alpha) <= 0:
        raise ValueError(
            f"model.lora_alpha={alpha!r} must be positive (the adapter is scaled by lora_alpha / lora_rank)"
        )
    target = _plain(model_cfg.get("target_modules", "all-linear")) or "all-linear"
    exclude = _plain(model_cfg.get("exclude_modules", None))
    if value_head:
        if isinstance(exclude, str):
            raise ValueError(
                f"exclude_modules={exclude!r}: a value model's LoRA takes a list of module names (its value head "
                f"{list(VALUE_HEAD_MODULES)} is added to it)"
            )
        exclude = [*(exclude or []), *VALUE_HEAD_MODULES]
    return LoraConfig(
        task_type="TOKEN_CLS" if value_head else "CAUSAL_LM",
        r=rank,
        lora_alpha=alpha,
        target_modules=target,
        exclude_modules=exclude,
        lora_dropout=0.0,
        bias="none",
    )


def apply_lora(
    model: torch.nn.Module, model_cfg, read_adapter_weights: bool = True, value_head: bool = False
) -> torch.nn.Module:
    """Wrap an HF causal LM with LoRA adapters (peft `get_peft_model`); only the adapters train.

    With `model_cfg.lora_adapter_path` the layout comes from that adapter and, with
    `read_adapter_weights`, so do the adapters' weights (a meta-device model passes False: its
    shapes are still checked); otherwise the adapters are fresh (B = 0).

    With `value_head`, `model` is a value model (the critic, `*ForTokenClassification`): its
    adapters are fresh (the critic has no adapter path), and its value head trains whole beside
    them, as upstream's FSDP critic (peft's TOKEN_CLS task).
    """
    if value_head:
        config = build_lora_config(model_cfg, value_head=True)
        try:
            peft_model = _get_peft_model(model, config)
        except ValueError as e:
            raise ValueError(
                f"cannot apply LoRA with target_modules={config.target_modules!r} to the value model "
                f"{type(model).__name__}: {e}. Set critic.model.target_modules to all-linear or to a list of linear "
                "layer names of this model (e.g. [q_proj,k_proj,v_proj,o_proj])"
            ) from e
        _check_mergeable(peft_model)
        return peft_model

    adapter_path = model_cfg.get("lora_adapter_path")
    if adapter_path:
        from verl.utils.fs import copy_to_local

        adapter_path = copy_to_local(os.path.expanduser(str(adapter_path)))  # an hdfs:// adapter: fetched once
    config = lora_config_from_adapter(adapter_path) if adapter_path else build_lora_config(model_cfg)
    model_name = model_cfg.get("path") or getattr(model.config, "_name_or_path", "") or type(model).__name__
    try:
        peft_model = _get_peft_model(model, config)
    except ValueError as e:  # e.g. no module matched target_modules
        if adapter_path:
            raise ValueError(
                f"the LoRA adapter {adapter_path} (target_modules={config.target_modules!r}) does not fit the model "
                f"{model_name}: {e}. Use an adapter trained on this model, or change actor_rollout_ref.model.path "
                "to the model it was trained on"
            ) from e
        raise ValueError(
            f"cannot apply LoRA with target_modules={config.target_modules!r}, "
            f"exclude_modules={config.exclude_modules!r} to {type(model).__name__}: {e}. Set "
            "actor_rollout_ref.model.target_modules to all-linear or to a list of linear layer names of this model "
            "(e.g. [q_proj,k_proj,v_proj,o_proj])"
        ) from e
    _check_mergeable(peft_model)
    if adapter_path:
        load_adapter_weights(peft_model, adapter_path, model_name, read=read_adapter_weights)
    return peft_model


def _get_peft_model(model: torch.nn.Module, config):
    from peft import get_peft_model

    with warnings.catch_warnings():  # peft calls a transformers method deprecated in v5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return get_peft_model(model, config)


def load_adapter_weights(peft_model, path: str, model_name: str, read: bool = True) -> None:
    """Check that the adapter file at `path` holds exactly the A and B tensors of `peft_model`, with
    their shapes (ValueError naming the layer, the adapter and the model otherwise); then, with
    `read`, copy them into the model."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors import safe_open

    expected = {
        name: tuple(t.shape) for name, t in get_peft_model_state_dict(peft_model, save_embedding_layers=False).items()
    }
    file = os.path.join(path, ADAPTER_WEIGHTS)
    with safe_open(file, framework="pt") as f:
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)

    def some(names):
        names = sorted(names)
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    fix = "Use an adapter trained on this model, or change actor_rollout_ref.model.path to the model it was trained on"
    wrong = {name for name in expected.keys() & found.keys() if expected[name] != found[name]}
    if wrong:
        name = sorted(wrong)[0]
        raise ValueError(
            f"the LoRA adapter {path} does not fit the model {model_name}: {name} has shape {list(found[name])} in "
            f"the adapter but {list(expected[name])} in the model ({len(wrong)} tensors differ). {fix}"
        )
    if found.keys() - expected.keys():
        raise ValueError(
            f"the LoRA adapter {path} holds tensors the model {model_name} has no place for: "
            f"{some(found.keys() - expected.keys())}. {fix}"
        )
    if expected.keys() - found.keys():
        raise ValueError(
            f"the LoRA adapter {path} lacks tensors the model {model_name} needs for its targeted layers: "
            f"{some(expected.keys() - found.keys())}. {fix}"
        )
    if not read:
        return
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(peft_model, load_file(file))
    assert not result.unexpected_keys, result.unexpected_keys  # the names were checked above


def is_peft_model(module: torch.nn.Module) -> bool:
    """Whether `module` is a peft model (also after FSDP2 swapped in its `FSDP<Name>` subclass)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def _lora_layers(peft_model) -> Iterator[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            yield name.removeprefix(PEFT_PREFIX), module


def _check_mergeable(peft_model) -> None:
    for name, layer in _lora_layers(peft_model):
        if ADAPTER_NAME not in getattr(layer, "lora_A", {}):
            raise NotImplementedError(
                f"LoRA layer {name} ({type(layer).__name__}) is not a linear LoRA layer; only linear layers can be "
                "merged for the rollout engine. Exclude it with actor_rollout_ref.model.exclude_modules or narrow "
                "target_modules"
            )


def lora_scalings(peft_model) -> dict[str, tuple[float, bool]]:
    """{HF module name: (scaling, fan_in_fan_out)} of every LoRA layer of `peft_model`."""
    return {
        name: (float(layer.scaling[ADAPTER_NAME]), bool(getattr(layer, "fan_in_fan_out", False)))
        for name, layer in _lora_layers(peft_model)
    }


def scaling_from_adapter_config(adapter_config: Mapping) -> float:
    """The scaling peft applies, from a saved `adapter_config.json` (rank and alpha patterns refused)."""
    if adapter_config.get("rank_pattern") or adapter_config.get("alpha_pattern"):
        raise NotImplementedError("adapter configs with rank_pattern/alpha_pattern are not supported by the merger")
    r, alpha = int(adapter_config["r"]), float(adapter_config["lora_alpha"])
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


def merge_lora_state(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    scalings: Mapping[str, tuple[float, bool]] | float,
    fan_in_fan_out: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a peft state dict as the merged model's HF state dict.

    `named_tensors` yields peft names (`base_model.model.<module>.base_layer.weight`,
    `<module>.lora_A.default.weight`, `<module>.lora_B.default.weight`, and plain
    `base_model.model.<name>` for untouched tensors), in any order. Each adapted layer comes out
    once as `<module>.weight = W + scaling * B @ A` (transposed for fan-in-fan-out layers), as soon
    as its three tensors have arrived; a module peft trains whole (`<module>.modules_to_save.default.*`,
    a value head) comes out under its own name and its untrained `original_module` copy is dropped;
    everything else passes through with the prefix removed.
    `scalings` maps module names to `(scaling, fan_in_fan_out)` (`lora_scalings`), or is one
    scaling for all layers (with `fan_in_fan_out`), as read from an adapter config.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if not name.startswith(PEFT_PREFIX):
            raise KeyError(f"{name!r} is not a peft state-dict name (expected the prefix {PEFT_PREFIX!r})")
        rest = name[len(PEFT_PREFIX) :]
        if ".original_module." in rest:  # the untrained copy of a module peft trains whole (a value head)
            continue
        if ".modules_to_save." in rest:
            module, _, leaf = rest.partition(".modules_to_save.")
            adapter, _, leaf = leaf.partition(".")
            if adapter != ADAPTER_NAME:
                raise KeyError(f"{name!r}: only the {ADAPTER_NAME!r} adapter's weights are merged")
            yield f"{module}.{leaf}", tensor
            continue
        if ".base_layer." in rest:
            module, _, leaf = rest.partition(".base_layer.")
            if leaf != "weight":  # the bias is not adapted
                yield f"{module}.{leaf}", tensor
                continue
            part = "W"
        elif ".lora_A." in rest or ".lora_B." in rest:
            kind = "A" if ".lora_A." in rest else "B"
            module, _, leaf = rest.partition(f".lora_{kind}.")
            if leaf != f"{ADAPTER_NAME}.weight":
                raise KeyError(f"{name!r}: only the {ADAPTER_NAME!r} adapter's weights are merged")
            part = kind
        else:
            yield rest, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[module]
            scaling, transpose = (
                (float(scalings), fan_in_fan_out) if isinstance(scalings, int | float) else scalings[module]
            )
            yield f"{module}.weight", _merge(parts["W"], parts["A"], parts["B"], scaling, transpose)
    if pending:
        incomplete = {module: sorted(parts) for module, parts in pending.items()}
        raise KeyError(f"LoRA layers without all of base weight W and factors A, B: {incomplete}")


def _merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, transpose: bool) -> torch.Tensor:
    dtype = torch.promote_types(weight.dtype, torch.float32)
    delta = (b.to(dtype) @ a.to(dtype)) * scaling
    if transpose:
        delta = delta.T
    return (weight.to(dtype) + delta).to(weight.dtype)


def save_lora_adapter(peft_model, path: str) -> None:
    """Write the adapter in PEFT's format to `path` (collective: every rank calls it; rank 0 writes).

    `PeftModel.from_pretrained(base_model, path)` loads it.
    """
    import torch.distributed as dist
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from verl.utils.fsdp_utils import iter_full_params

    lora = {
        name: tensor.detach().cpu().contiguous()
        for name, tensor in iter_full_params(
            peft_model, name_filter=lambda n: ".lora_" in n or ".modules_to_save." in n
        )
    }
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    state = get_peft_model_state_dict(peft_model, state_dict=lora, save_embedding_layers=False)
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_model.peft_config[ADAPTER_NAME].save_pretrained(path)


def read_adapter_config(path: str) -> dict:
    """The `adapter_config.json` in directory `path`."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        return json.load(f)
