"""Helpers of upstream's legacy FSDP worker, for code that builds its models itself.

verl-recipe's FlowRL, GVPO, SPIN, PRIME and rep_exp workers carry their own copy of upstream's
legacy `fsdp_workers.py` body: they build the HF model under `get_init_weight_context_manager()`,
wrap it with FSDP1 (`FullyShardedDataParallel(..., param_init_fn=init_fn)`) or FSDP2
(`apply_fsdp2(module, fsdp_kwargs, config)` then `fsdp2_load_full_state_dict`), move it between
host and device (`offload_fsdp_model_to_cpu` / `load_fsdp_model_to_gpu`) and, with LoRA, hand
adapters to the rollout (`collect_lora_params`, `replace_lora_wrapper`). These are those names, with
upstream's signatures and behaviour; `verl.utils.fsdp_utils` re-exports them. This build's own
workers use the engine path (`verl.workers.engine.fsdp`) and none of these.

FSDP1 itself is torch's. What it refuses on a CPU-only host is `sync_module_states=True` with
modules on the CPU (it broadcasts through the device); everything here also runs on CPU with a
gloo group, which is how the tests exercise it.

LoRA collection enters FSDP1's `summon_full_params` only for FSDP1 units (for FSDP2 it has no
FSDP1 state to gather, so upstream's call there does nothing); FSDP2's DTensors are gathered one by
one with `full_tensor()`.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from verl.utils import device as dev
from verl.utils.model import check_exclude_modules, check_target_modules

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "collect_lora_params",
    "fsdp2_load_full_state_dict",
    "fsdp_version",
    "get_init_weight_context_manager",
    "get_shard_placement_fn",
    "init_fn",
    "layered_summon_lora_params",
    "load_fsdp1_model_to_device",
    "offload_fsdp1_model_to_cpu",
    "replace_lora_wrapper",
]


def fsdp_version(model) -> int:
    """1 for an FSDP1 `FullyShardedDataParallel`, 2 for a module sharded by `fully_shard`, 0 otherwise."""
    if isinstance(model, FSDP):
        return 1
    if isinstance(model, FSDPModule):
        return 2
    return 0


def init_fn(module: nn.Module) -> nn.Module:
    """FSDP1's `param_init_fn` for models built on the meta device on ranks > 0: allocate this
    module's own parameters and buffers (not its children's: FSDP calls it per module),
    uninitialised, on this rank's device. Rank 0 keeps its loaded weights; `sync_module_states=True`
    then broadcasts them."""
    if dist.get_rank() != 0:
        module = module.to_empty(device=dev.get_device(), recurse=False)
        dev.empty_cache()
    return module


def get_init_weight_context_manager(
    use_meta_tensor: bool = True, mesh=None
) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context to build the HF model in: on the CPU on the rank that loads the
    checkpoint, on the meta device (accelerate's `init_empty_weights`: parameters only, buffers stay
    real) elsewhere. The loading rank is global rank 0, or with `mesh` every rank whose coordinate on
    the mesh's last dimension is 0. `use_meta_tensor=False`: the CPU on every rank."""

    def on_cpu():
        return torch.device("cpu")  # a torch.device is a context manager setting the default device

    if not use_meta_tensor:
        return on_cpu
    loads = dist.get_rank() == 0 if mesh is None else mesh.get_coordinate()[-1] == 0
    if loads:
        return on_cpu
    from accelerate import init_empty_weights

    return init_empty_weights


def get_shard_placement_fn(fsdp_size: int):
    """FSDP2's `shard_placement_fn`: shard each parameter on its first dimension that `fsdp_size`
    divides (no padding), else on dimension 0."""
    from torch.distributed.tensor import Shard

    def shard_placement_fn(param):
        for dim, size in enumerate(param.shape):
            if size % fsdp_size == 0:
                return Shard(dim)
        return Shard(0)

    return shard_placement_fn


@torch.no_grad()
def fsdp2_load_full_state_dict(model: nn.Module, full_state: dict, device_mesh=None, cpu_offload=None) -> None:
    """Give the FSDP2-sharded `model` rank 0's full state dict, in place: rank 0's tensors are
    broadcast one at a time and each rank keeps its shard. `full_state` is read on rank 0 only
    (elsewhere the model was built on the meta device). Every buffer is broadcast from rank 0 too
    (non-persistent ones such as rotary `inv_freq` are in no state dict). With `cpu_offload` (the
    `CPUOffloadPolicy` the model was sharded with, or None) the parameters end on the host and the
    buffers on the device, as FSDP2's offload expects. `device_mesh` is accepted for upstream's
    signature; the model's own mesh is used."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = dev.get_device()
    if dist.get_rank() == 0:
        model = model.to(device=device, non_blocking=True)
    else:
        model = model.to_empty(device=device)
    offload = cpu_offload is not None
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state if dist.get_rank() == 0 else {}, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    if offload:
        model.to("cpu", non_blocking=True)
        for buffer in model.buffers():
            buffer.data = buffer.data.to(device)


def _fsdp1_handles(model: FSDP, what: str):
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    _lazy_init(model, model)
    if not model._is_root:
        raise ValueError(f"{what} moves a whole FSDP1 model: pass the root FullyShardedDataParallel, not a nested unit")
    return [handle for handle in model._all_handles if not handle._offload_params]


@torch.no_grad()
def offload_fsdp1_model_to_cpu(model: FSDP, empty_cache: bool = True) -> None:
    """Move an FSDP1 model's flat parameter shards to the host (those FSDP1 does not offload
    itself), keeping each handle's `_local_shard` pointing at the moved data."""
    for handle in _fsdp1_handles(model, "offload_fsdp_model_to_cpu"):
        handle.flat_param_to(torch.device("cpu"), non_blocking=True)
        handle.flat_param._local_shard = handle.flat_param.data
    if empty_cache:
        dev.empty_cache()


@torch.no_grad()
def load_fsdp1_model_to_device(model: FSDP) -> None:
    """Bring an FSDP1 model's flat parameter shards back to this rank's device."""
    for handle in _fsdp1_handles(model, "load_fsdp_model_to_gpu"):
        handle.flat_param_to(dev.get_device(), non_blocking=True)
        handle.flat_param._local_shard = handle.flat_param.data


# ---------------------------------------------------------------------------------------- LoRA
def _full_cpu(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu()


def _summon(module):
    """FSDP1 units gather their full parameters; FSDP2 and plain modules need no context (their
    DTensors are gathered one by one with `full_tensor`)."""
    return FSDP.summon_full_params(module, writeback=False) if fsdp_version(module) == 1 else contextlib.nullcontext()


_LAYER_PREFIXES = (
    "_fsdp_wrapped_module.base_model.model.",
    "_fsdp_wrapped_module.base_model.model.model.",
    "_fsdp_wrapped_module.base_model.model.model.layers.",
    "_fsdp_wrapped_module.base_model.model.model.language_model.layers.",
    "base_model.model.",
    "base_model.model.model.",
    "base_model.model.model.layers.",
    "base_model.model.model.language_model.layers.",
)


_ADAPTER_ENTRY = re.compile(r"(.*\.lora_[A-Za-z_]+)\.default(\..*|)$")
"""A state-dict entry of the `default` adapter (`...q_proj.lora_A.default.weight`), split around the adapter name."""


def layered_summon_lora_params(fsdp_module) -> OrderedDict:
    """The adapters of a sharded PEFT model, gathered one FSDP unit at a time (each decoder layer,
    then the other direct children of the PEFT model's levels), as peft names them
    (`base_model.model.<...>.lora_A.weight`, adapter name `default` dropped), on the host. Only sharded
    units are read, so peak memory is one unit's full parameters.

    A unit's entries are picked by name (`lora_*.default.*`) rather than through peft's
    `get_peft_model_state_dict`: peft >= 0.18 selects entries by matching them against the whole
    model's module names, which a unit's own (relative, FSDP1-renamed) state dict never matches."""
    params = OrderedDict()
    for prefix in _LAYER_PREFIXES:
        for name, submodule in fsdp_module.named_modules():
            if not name.startswith(prefix) or "." in name[len(prefix) :]:
                continue
            if name.endswith(".model") or name.endswith(".layers") or fsdp_version(submodule) == 0:
                continue
            public = name.replace("_fsdp_wrapped_module.base_model.model.", "base_model.model.")
            with _summon(submodule):
                for key, value in submodule.state_dict().items():
                    match = _ADAPTER_ENTRY.match(key.replace("_fsdp_wrapped_module.", ""))
                    if match is not None:
                        params[f"{public}.{match.group(1)}{match.group(2)}"] = _full_cpu(value)
                if fsdp_version(submodule) == 1:
                    submodule._is_root = False  # summoning made the unit a root; the model's root is the outer one
            dev.empty_cache()
    return params


def _base_weights(peft_model) -> OrderedDict:
    """The base model's own weights under their HF names (no adapters, `.base_layer` dropped)."""
    model = peft_model.base_model.model
    on_host = next(model.parameters()).device.type == "cpu"
    model.to("cpu")
    weights = OrderedDict()
    for name, tensor in model.state_dict().items():
        if "_flat_param" in name or "lora_" in name:
            continue
        weights[name.replace("_fsdp_wrapped_module.", "").replace(".base_layer", "")] = _full_cpu(tensor)
    if not on_host:
        model.to(dev.get_device())
    return weights


def collect_lora_params(module, layered_summon: bool, base_sync_done: bool) -> OrderedDict:
    """What a LoRA actor sends its rollout: the adapters (peft's names, on the host) once the rollout
    holds the base model (`base_sync_done`), else the base model's weights under HF names. With
    `layered_summon` the adapters are gathered unit by unit (`layered_summon_lora_params`); that
    needs the base model already in the rollout."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    peft_model = getattr(module, "_fsdp_wrapped_module", module)
    if layered_summon and fsdp_version(module) > 0:
        if not base_sync_done:
            raise ValueError(
                "To use layered_summon, you must make sure base-model is preloaded in vllm, e.g. let "
                "rollout.load_format=safetensors (layered summoning sends adapters only, and the rollout "
                "has no base weights yet)"
            )
        return layered_summon_lora_params(module)
    with _summon(module):
        if base_sync_done:
            params = OrderedDict((k, _full_cpu(v)) for k, v in get_peft_model_state_dict(peft_model).items())
        else:
            params = _base_weights(peft_model)
    if fsdp_version(module) > 0:
        dev.empty_cache()
    return params


_STACKED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def replace_lora_wrapper(k: str, peft_config) -> str:
    """The name peft gives base weight `k` inside a LoRA layer: `<module>.weight` (or `.bias`)
    becomes `<module>.base_layer.weight` when the module is a LoRA target (or one of the attention
    and MLP projections), unless `peft_config.exclude_modules` excludes it; other names unchanged."""
    match = re.fullmatch(r"(.*)\.(weight|bias)", k)
    if match is None:
        return k
    module_k, kind = match.groups()
    if check_exclude_modules(peft_config, module_k):
        return k
    if module_k.endswith(_STACKED_PROJECTIONS) or check_target_modules(peft_config, module_k):
        return f"{module_k}.base_layer.{kind}"
    return k
