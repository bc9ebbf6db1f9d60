"""FSDP2 (`torch.distributed.fsdp.fully_shard`) helpers for the actor, reference and critic.

Sharding layout: every decoder layer is its own FSDP unit (so only one layer's full parameters
exist at a time in forward and backward), plus the root module for what is left (embeddings,
final norm, head). The decoder-layer class comes from the model's `_no_split_modules`, the same
list HF uses for device maps, overridable with `fsdp_config.wrap_policy.transformer_layer_cls_to_wrap`.
Untied input embeddings get their own unit too, as upstream does, because they are large.

Precision: the optimizer holds the master weights in the dtype the model was loaded in (float32
for training). On CUDA, compute runs in bf16 and gradients are reduced in fp32
(MixedPrecisionPolicy); on CPU nothing is cast, because CPU bf16 matmuls are slow, and so that a
float64 model gives float64-exact comparisons against single-process references in tests.

Offload, two kinds:
* `fsdp_config.offload_policy=True` hands FSDP2 a `CPUOffloadPolicy`: parameters live on the host
  and are copied to the device per unit for compute; the optimizer step runs on the host.
* `param_offload` / `optimizer_offload` are manual and coarse-grained, for the hybrid engine:
  the worker moves the whole sharded model (or the optimizer state) to the host while the rollout
  engine uses the device, and back before training (`offload_fsdp_model_to_cpu`,
  `load_fsdp_model_to_device`, `offload_fsdp_optimizer`, `load_fsdp_optimizer`).

Weight sync to a rollout engine reads full parameters one at a time (`iter_full_params`): each
DTensor is all-gathered on its own, so at most one unsharded tensor exists beyond the shards, and
each shard is cast to the rollout dtype before its all-gather (bf16 moves half of fp32's bytes).

Loading (`load_full_state_from_rank0`): only rank 0 reads the checkpoint; the other ranks build
the model on the meta device, shard it, and receive rank 0's weights shard by shard
(`set_model_state_dict(..., broadcast_from_rank0=True)`), so a rank > 0 never holds a full copy
on the host (8 ranks of a 7B fp32 model held 8 x 28 GB before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from verl.utils import device as dev
from verl.utils.device import get_device, get_device_name, is_cuda_available
from verl.utils.fsdp_legacy import (
    CPUOffloadPolicy,
    FSDPModule,
    collect_lora_params,
    fsdp2_load_full_state_dict,
    fsdp_version,
    get_init_weight_context_manager,
    get_shard_placement_fn,
    init_fn,
    layered_summon_lora_params,
    load_fsdp1_model_to_device,
    offload_fsdp1_model_to_cpu,
    replace_lora_wrapper,
)

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "apply_fsdp2",
    "collect_lora_params",
    "create_device_mesh",
    "fsdp2_load_full_state_dict",
    "fsdp_version",
    "fsdp2_clip_grad_norm_",
    "get_fsdp_wrap_modules",
    "get_fsdp_wrap_policy",
    "get_full_state_dict",
    "get_init_weight_context_manager",
    "get_mixed_precision_policy",
    "get_offload_policy",
    "get_shard_placement_fn",
    "init_fn",
    "iter_full_params",
    "layered_summon_lora_params",
    "load_fsdp_model_to_device",
    "load_fsdp_model_to_gpu",
    "load_full_state_from_rank0",
    "load_fsdp_optimizer",
    "offload_fsdp_model_to_cpu",
    "offload_fsdp_optimizer",
    "replace_lora_wrapper",
    "to_torch_dtype",
]

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def _cfg_get(cfg, key, default=None):
    if cfg is None:
        return default
    value = cfg.get(key, default)
    return default if value is None else value


def to_torch_dtype(name) -> torch.dtype:
    """'bf16' | 'bfloat16' | 'fp32' | ... (or a torch.dtype) -> torch.dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def create_device_mesh(world_size: int | None = None, fsdp_size: int = -1):
    """1-D mesh over all ranks ('fsdp'); 2-D ('ddp', 'fsdp') for HSDP when 0 < fsdp_size < world."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = world_size or dist.get_world_size()
    if fsdp_size <= 0 or fsdp_size >= world_size:
        return init_device_mesh(get_device_name(), (world_size,), mesh_dim_names=("fsdp",))
    if world_size % fsdp_size != 0:
        raise ValueError(
            f"fsdp_config.fsdp_size={fsdp_size} does not divide the world size {world_size}; "
            "use a divisor of the number of ranks, or -1 to shard over all of them"
        )
    return init_device_mesh(get_device_name(), (world_size // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def get_mixed_precision_policy(mixed_precision_config=None, dtype="auto"):
    """FSDP2's mixed-precision policy of an `fsdp_config`: its `mixed_precision` section, else its `dtype`.

    `mixed_precision_config` may set `param_dtype` and `reduce_dtype` (upstream also has
    `buffer_dtype`, which FSDP2 does not use: buffers keep the model's dtype); unset ones default to
    bf16 compute + fp32 reduction on CUDA and to no casting on CPU. Without it, `dtype` (upstream's
    `fsdp_config.dtype`, default bfloat16) is the compute dtype with fp32 gradient reduction, as
    upstream's workers do; `auto` (ours) is bf16 on CUDA and no casting at all on CPU (the
    model's own dtype).
    """
    cuda = is_cuda_available()
    if mixed_precision_config is None and dtype not in (None, "auto"):
        return MixedPrecisionPolicy(
            param_dtype=to_torch_dtype(dtype), reduce_dtype=torch.float32, cast_forward_inputs=True
        )
    param_dtype = _cfg_get(mixed_precision_config, "param_dtype", torch.bfloat16 if cuda else None)
    reduce_dtype = _cfg_get(mixed_precision_config, "reduce_dtype", torch.float32 if cuda else None)
    return MixedPrecisionPolicy(
        param_dtype=None if param_dtype is None else to_torch_dtype(param_dtype),
        reduce_dtype=None if reduce_dtype is None else to_torch_dtype(reduce_dtype),
        cast_forward_inputs=True,
    )


def get_offload_policy(enabled: bool):
    """FSDP2's CPUOffloadPolicy when enabled (pinned host memory only where a GPU copies from it)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=is_cuda_available()) if enabled else OffloadPolicy()


def get_fsdp_wrap_modules(model: nn.Module, wrap_policy=None) -> list[nn.Module]:
    """The submodules that become FSDP units: decoder layers (+ untied input embeddings).

    The layer class names come from `wrap_policy.transformer_layer_cls_to_wrap` when given, else from
    `model._no_split_modules`.
    """
    names = _cfg_get(wrap_policy, "transformer_layer_cls_to_wrap", None) or getattr(model, "_no_split_modules", None)
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no `_no_split_modules`, so the decoder-layer class to shard is "
            "unknown; set fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[<DecoderLayerClassName>]"
        )
    names = {names} if isinstance(names, str) else set(names)
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    modules = []
    for module in model.modules():
        if module is model:
            continue
        if type(module).__name__ in names or (isinstance(module, nn.Embedding) and not tied):
            modules.append(module)
    if not any(type(m).__name__ in names for m in modules):
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"no submodule of {type(model).__name__} has a class in {sorted(names)}; classes present: {present}. "
            "Fix fsdp_config.wrap_policy.transformer_layer_cls_to_wrap"
        )
    return modules


def get_fsdp_wrap_policy(module: nn.Module, config=None, is_lora: bool = False):
    """Upstream's FSDP1 auto-wrap policy for `module` (for code that wraps with FSDP1 itself; this build's
    workers shard with FSDP2 through `get_fsdp_wrap_modules`). None when `config.disable`; otherwise the
    union of: with `is_lora`, every leaf module with a trainable weight; with `config.min_num_params` > 0,
    torch's size-based policy, else the decoder-layer classes (`config.transformer_layer_cls_to_wrap`,
    else `module._no_split_modules`)."""
    import functools

    from torch.distributed.fsdp.wrap import (
        _or_policy,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    if _cfg_get(config, "disable", False):
        return None
    policies = []
    if is_lora:

        def trainable_leaf(m: nn.Module) -> bool:
            weight = getattr(m, "weight", None)
            return next(m.children(), None) is None and weight is not None and weight.requires_grad

        policies.append(functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf))
    min_num_params = _cfg_get(config, "min_num_params", 0) or 0
    names = _cfg_get(config, "transformer_layer_cls_to_wrap", None) or getattr(module, "_no_split_modules", None)
    if min_num_params > 0:
        policies.append(functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params))
    elif names:
        names = {names} if isinstance(names, str) else set(names)
        classes = {type(m) for m in module.modules() if type(m).__name__ in names}
        if len({c.__name__ for c in classes}) != len(names):
            present = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(
                f"wrap_policy.transformer_layer_cls_to_wrap={sorted(names)}: not every class is in "
                f"{type(module).__name__} (classes present: {present})"
            )
        policies.append(functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes))
    return functools.partial(_or_policy, policies=policies) if policies else None


_FULLY_SHARD_KWARGS = frozenset({"mesh", "mp_policy", "shard_placement_fn"})


def _is_upstream_call(fsdp_config, third) -> bool:
    """Whether `apply_fsdp2` was called as upstream's `apply_fsdp2(model, fsdp_kwargs, config)`:
    `fully_shard`'s own keyword arguments (a dict with `mesh`, `mp_policy`, ...) then an `fsdp_config`."""
    from torch.distributed.device_mesh import DeviceMesh

    if third is not None and not isinstance(third, DeviceMesh):
        return True
    return isinstance(fsdp_config, dict) and bool(_FULLY_SHARD_KWARGS & fsdp_config.keys())


def apply_fsdp2(model: nn.Module, fsdp_config=None, device_mesh=None) -> nn.Module:
    """Shard `model` in place with `fully_shard`: each decoder layer, then the root.

    `fsdp_config` keys (upstream names): `reshard_after_forward` (default True),
    `offload_policy` (FSDP2 CPU offload), `mixed_precision` {param_dtype, reduce_dtype},
    `wrap_policy` {transformer_layer_cls_to_wrap}, `fsdp_size` (HSDP group size, -1 = all ranks).
    `fully_shard` moves each unit's parameters and buffers to the mesh's device as it shards them
    (parameters stay on the host under CPU offload).

    Upstream's form, `apply_fsdp2(model, fsdp_kwargs, config)` (what code written against its legacy
    workers calls), is accepted too: `fsdp_kwargs` are passed to every `fully_shard` as they are
    (`mesh`, `mp_policy`, `offload_policy`, `reshard_after_forward`, `shard_placement_fn`) and only
    `config.wrap_policy` is read from the config.
    """
    from torch.distributed.fsdp import fully_shard

    if _is_upstream_call(fsdp_config, device_mesh):
        kwargs, wrap_policy = dict(fsdp_config or {}), _cfg_get(device_mesh, "wrap_policy", None)
    else:
        if device_mesh is None:
            device_mesh = create_device_mesh(fsdp_size=int(_cfg_get(fsdp_config, "fsdp_size", -1)))
        offload = bool(_cfg_get(fsdp_config, "offload_policy", False))
        kwargs = {
            "mesh": device_mesh,
            "mp_policy": get_mixed_precision_policy(
                _cfg_get(fsdp_config, "mixed_precision", None), _cfg_get(fsdp_config, "dtype", "auto")
            ),
            "offload_policy": get_offload_policy(offload),
            "reshard_after_forward": bool(_cfg_get(fsdp_config, "reshard_after_forward", True)),
        }
        wrap_policy = _cfg_get(fsdp_config, "wrap_policy", None)
    if kwargs.get("offload_policy", ...) is None:
        kwargs.pop("offload_policy")  # upstream passes None for "no offload": fully_shard's default
    _tie_declared_embeddings(model)
    for module in get_fsdp_wrap_modules(model, wrap_policy):
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _tie_declared_embeddings(model: nn.Module) -> None:
    """Tie the output embedding to the input one where the config declares them tied but they are
    not: transformers 5 leaves a model built on the meta device (accelerate's `init_empty_weights`,
    upstream's ranks > 0) untied, and sharding a tied model on one rank and an untied one on another
    gives FSDP units of different sizes, whose all-gathers then mismatch."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or not hasattr(model, "get_output_embeddings"):
        return
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is not None and inputs is not None and output.weight is not inputs.weight:
        model.tie_weights()


@torch.no_grad()
def fsdp2_clip_grad_norm_(
    parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None
) -> torch.Tensor:
    """`clip_grad_norm_` for DTensor gradients: the norm is over the full (unsharded) gradient.

    Returns the total norm before clipping as a plain tensor, identical on every rank. A
    non-finite norm is returned as is (clipping then leaves NaN/inf in the gradients; the caller
    decides to skip the step).
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.tensor(0.0, device=get_device())
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    # CPU-offloaded gradients give a host tensor: move it to the compute device before any
    # cross-rank reduction, which the device's backend (NCCL) must carry out
    total = total.to(get_device())
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(grads[0].device), foreach)
    return total


@torch.no_grad()
def iter_full_params(
    module: nn.Module, dtype: torch.dtype | None = None, name_filter: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every entry of `module.state_dict()`, one at a time.

    Names are the HF names (FSDP2 does not rename parameters). Each sharded tensor is all-gathered
    on the compute device only when the consumer asks for it, so peak extra memory is one full
    tensor; the consumer should drop its reference before asking for the next. Every rank must
    iterate to the end (the gathers are collectives). `dtype` casts each floating-point tensor
    (e.g. to bf16 for a rollout engine) before gathering: each rank casts its own shard, so the
    all-gather moves the rollout dtype's bytes (half of fp32's for bf16), and the values are those
    of casting the gathered tensor (a cast is elementwise). `name_filter` keeps only the names it accepts (it must accept
    the same names on every rank). A replicated parameter (`fsdp_size=1`, or a module without FSDP)
    is yielded without a copy: it shares the module's storage, so consumers copy it and never write
    to it.
    """
    from torch.distributed.tensor import DTensor

    device = get_device()
    for name, tensor in module.state_dict().items():
        if name_filter is not None and not name_filter(name):
            continue
        cast = dtype is not None and tensor.is_floating_point()
        if isinstance(tensor, DTensor):
            if _holds_full_tensor(tensor):  # replicated (fsdp_size=1): the local tensor is already whole
                tensor = tensor.to_local()
            else:
                if tensor.device != device:  # offloaded shards: gather on the device the backend supports
                    tensor = tensor.to(device)
                if cast:
                    tensor = tensor.to(dtype)  # the local shard, before the gather
                tensor = tensor.full_tensor()
        if cast:
            tensor = tensor.to(dtype)  # a no-op for a tensor cast before its gather
        yield name, tensor


def _holds_full_tensor(tensor) -> bool:
    """Whether each rank's local part of DTensor `tensor` is the whole tensor: every placement is
    Replicate or a Shard over a mesh dimension of size 1 (no Partial sums pending)."""
    mesh = tensor.device_mesh
    return all(p.is_replicate() or (p.is_shard() and mesh.size(dim) == 1) for dim, p in enumerate(tensor.placements))


def get_full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded state dict on the host: on rank 0 only (`{}` elsewhere) unless `rank0_only=False`.

    Every rank must call it (it gathers).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if rank0_only:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(module, options=options)
    return {name: tensor.cpu() for name, tensor in iter_full_params(module)}


@torch.no_grad()
def load_full_state_from_rank0(module: nn.Module, full_state_dict: dict | None, device) -> None:
    """Give every rank's `module` rank 0's weights: the sharded-loading half of
    `verl.utils.model.load_causal_lm(..., meta_device=True)`. Every rank must call it.

    `module` is wrapped already (FSDP2, or a plain replica): on rank 0 built from the checkpoint and
    on its device, `full_state_dict` its unsharded `state_dict()` taken before sharding; on ranks > 0
    built on the meta device, `full_state_dict` None. Those ranks first allocate their (sharded)
    parameters and buffers on `device`, uninitialised; then torch's
    `set_model_state_dict(..., broadcast_from_rank0=True)` broadcasts one tensor at a time and
    each rank keeps its shard, so no rank > 0 holds more than one full tensor at once. Buffers that
    are no part of a state dict (non-persistent, e.g. rotary `inv_freq`) are broadcast from rank 0
    too: on the meta device they were never computed.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    if rank != 0:
        _materialize_meta(module, device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, full_state_dict if rank == 0 else {}, options=options)
    persistent = set(module.state_dict())
    for name, buffer in module.named_buffers():
        if name not in persistent:
            dist.broadcast(buffer, src=0)


def _materialize_meta(module: nn.Module, device) -> None:
    """`module.to_empty(device)`, keeping tied parameters tied (a plain module's `to_empty` gives
    each owner of a shared meta parameter its own new one; FSDP2 keeps the tie itself)."""
    shared: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    module.to_empty(device=device)
    for names in shared.values():
        first = module.get_parameter(names[0])
        for name in names[1:]:
            if module.get_parameter(name) is not first:
                owner, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner), attr, first)


def offload_fsdp_model_to_cpu(model: nn.Module, empty_cache: bool = True) -> None:
    """Move the sharded parameters (and gradients) to the host; a no-op on a CPU device. An FSDP1
    model (upstream's legacy workers) moves its flat parameter shards."""
    if fsdp_version(model) == 1:
        offload_fsdp1_model_to_cpu(model, empty_cache)
        return
    model.to("cpu")
    if empty_cache:
        dev.empty_cache()


def load_fsdp_model_to_device(model: nn.Module) -> None:
    """Bring the sharded parameters back to this rank's device after `offload_fsdp_model_to_cpu`."""
    if fsdp_version(model) == 1:
        load_fsdp1_model_to_device(model)
        return
    model.to(get_device())


load_fsdp_model_to_gpu = load_fsdp_model_to_device
"""Upstream's name for `load_fsdp_model_to_device` (the device is this rank's accelerator, or the CPU)."""


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)


def offload_fsdp_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Move the optimizer state (Adam moments) to the host."""
    _move_optimizer_state(optimizer, "cpu")
    dev.empty_cache()


def load_fsdp_optimizer(optimizer: torch.optim.Optimizer, device=None, *, device_id=None) -> None:
    """Move the optimizer state back to `device` (default: this rank's device); `device_id` is
    upstream's keyword for it."""
    if device is not None and device_id is not None:
        raise TypeError("load_fsdp_optimizer takes `device` or upstream's `device_id`, not both")
    target = device if device is not None else device_id
    _move_optimizer_state(optimizer, get_device() if target is None else target)
