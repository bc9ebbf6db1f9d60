"""Activation offload: the tensors a decoder layer saves for its backward wait in host memory.

`enable_activation_offloading(model, strategy, enable_ckpt)` (upstream's name and arguments) wraps
the forward of each layer of `model`: during a training forward (module in training mode, grad
enabled) every tensor autograd saves inside the layer is copied to the host as it is saved and
copied back to the layer's device when the backward needs it (`torch.autograd.graph.
saved_tensors_hooks`). The accelerator then holds at most the activations of the layer being
computed and of the layer whose backward runs, instead of every layer's. The config keys
`actor_rollout_ref.model.enable_activation_offload` and `critic.model.enable_activation_offload`
turn it on for the FSDP actor and critic.

What is a layer: each FSDP unit below the root (an FSDP2 `fully_shard`-ed module or an FSDP1
wrapper; an embedding alone is skipped, as its activations are small), as upstream's; for a
model without FSDP units (this project trains a small model as plain replicas) the model's
decoder layers (its `_no_split_modules` classes). Fewer than 3 layers: nothing is wrapped and a
warning says so (upstream's rule).

What is not offloaded: the layer's parameters (FSDP2's gathered weights are freed after the layer
and gathered again for its backward; a saved view of a weight is left as is, so it is not copied
per use), tensors already on the host, and everything the last layer saves (its backward comes
first, so the copy would only add time).

With `enable_ckpt` (gradient checkpointing on), transformers' checkpointing is turned off and each
layer runs under torch's reentrant checkpoint instead, whose one saved tensor per input (the
layer's input) is what gets offloaded: the reentrant form saves its inputs through autograd, where
the hooks see them, while the non-reentrant form and transformers' layer checkpointing keep them
outside. A layer marked so (`checkpoints_activations`) drops a KV cache in training, as
transformers' checkpointed layers do. The reentrant form, as upstream's, needs a layer input that requires grad (true of the
hidden states when the embedding trains or LoRA's `enable_input_require_grads` is on).

Device notes: copies go to pinned host memory with non-blocking copies on the compute stream, so
they are ordered with the kernels that produce and consume them (no side stream, no overlap
between copies and compute: simpler and safe with the caching allocator, at the price of the
copy time). On a CPU device the activations already are on the host: the hooks run and keep each
tensor as is (`OffloadStats.kept_on_host`), the result is bit-equal to the unwrapped model and no
memory is saved. The copy to host and back is exercised on CPU by tests with `copy_host_tensors`,
which copies host tensors as well; the memory saving itself only shows on an accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.utils.checkpoint

__all__ = ["ActivationOffload", "OffloadStats", "enable_activation_offloading", "offload_layers"]

logger = logging.getLogger(__name__)

_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")

MIN_LAYERS = 3
"""Fewer FSDP units (or decoder layers) than this: activation offload is not enabled (upstream's rule)."""


@dataclasses.dataclass
class OffloadStats:
    """Counts over the training forwards since the handler was built (tests and debugging)."""

    offloaded: int = 0
    """Saved tensors copied to the host."""
    offloaded_bytes: int = 0
    kept_parameters: int = 0
    """Saved tensors that are (views of) the layer's parameters, left in place."""
    kept_on_host: int = 0
    """Saved tensors already on the host (everything on a CPU device), left in place."""
    reloaded: int = 0
    """Offloaded tensors copied back for the backward."""


def _is_fsdp_unit(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return isinstance(module, FSDPModule | FSDP1)


def offload_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose saved activations are offloaded, in forward order (module docstring): the FSDP units
    below the root that are not an embedding alone, else the model's decoder layers."""
    units: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if not _is_fsdp_unit(child):
                visit(child)
                continue
            inner = getattr(child, "_fsdp_wrapped_module", child)  # FSDP1 wraps; FSDP2 is the module itself
            if not isinstance(inner, torch.nn.Embedding):
                units.append(inner)

    visit(model)
    if units:
        return units
    no_split = set()
    for module in model.modules():
        no_split.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in no_split]


class ActivationOffload:
    """The saved-tensor hooks of the wrapped layers and their `stats`; built by `enable_activation_offloading`."""

    def __init__(self, layers: list[torch.nn.Module], enable_ckpt: bool, copy_host_tensors: bool = False):
        self.layers = layers
        self.enable_ckpt = enable_ckpt
        self.copy_host_tensors = copy_host_tensors
        self.stats = OffloadStats()
        for index, layer in enumerate(layers):
            self._wrap(layer, offload=index < len(layers) - 1)

    # ------------------------------------------------------------ saved-tensor hooks
    def _pack(self, param_storages: set[int], tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in param_storages or isinstance(tensor, torch.nn.Parameter):
            self.stats.kept_parameters += 1
            return tensor
        if tensor.device.type == "cpu" and not self.copy_host_tensors:
            self.stats.kept_on_host += 1
            return tensor
        pin = tensor.device.type != "cpu"  # pinned host memory: the copies can be asynchronous
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += host.numel() * host.element_size()
        return tensor.device, host

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        self.stats.reloaded += 1
        return host.to(device, non_blocking=host.is_pinned())

    # ------------------------------------------------------------ layer wrapping
    def _wrap(self, layer: torch.nn.Module, offload: bool) -> None:
        forward = layer.forward
        checkpointed = functools.partial(_reentrant_checkpoint, forward) if self.enable_ckpt else forward
        if self.enable_ckpt:
            layer.checkpoints_activations = True  # read by the shared-prompt forward, as HF's `gradient_checkpointing`

        @functools.wraps(forward)
        def wrapped(*args, **kwargs):
            if not (layer.training and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            if not offload:
                return checkpointed(*args, **kwargs)
            # the storages of the parameters as the forward sees them (FSDP2: the gathered ones)
            param_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            pack = functools.partial(self._pack, param_storages)
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                return checkpointed(*args, **kwargs)

        layer.forward = wrapped


def _reentrant_checkpoint(forward, *args, **kwargs):
    """`forward(*args, **kwargs)` under torch's reentrant checkpoint, which takes positional arguments only.

    A KV cache in the arguments is dropped, as transformers' checkpointed layers drop it: the recomputation
    would append the layer's keys and values to it a second time."""
    for key in _CACHE_ARGUMENTS:
        if kwargs.get(key) is not None:
            kwargs[key] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    keys = tuple(kwargs)
    flat = (*args, *kwargs.values())

    def run(*inputs):
        head = len(inputs) - len(keys)
        return forward(*inputs[:head], **dict(zip(keys, inputs[head:], strict=True)))

    return torch.utils.checkpoint.checkpoint(run, *flat, use_reentrant=True)


def enable_activation_offloading(
    model: torch.nn.Module, strategy: str, enable_ckpt: bool = False, copy_host_tensors: bool = False
) -> ActivationOffload | None:
    """Offload the activations `model`'s layers save for the backward to the host (module docstring).

    `strategy`: the training strategy, `fsdp` or `fsdp2` (anything else is a ValueError, as upstream
    refuses it). `enable_ckpt`: gradient checkpointing is on for `model`; it is then done here (layer by
    layer, reentrant) instead of by transformers. `copy_host_tensors`: copy tensors already on the host too
    (CPU tests of the copy path). Returns the handler, or None when the model has fewer than 3 layers.
    Call it once per model."""
    if strategy not in ("fsdp", "fsdp2"):
        raise ValueError(
            f"activation offloading only supports fsdp strategy (fsdp or fsdp2), got strategy={strategy!r}; "
            "set model.enable_activation_offload=false for this backend"
        )
    layers = offload_layers(model)
    if len(layers) < MIN_LAYERS:
        logger.warning(
            "activation offload: found only %d layers (FSDP units or decoder layers), fewer than %d; not enabled",
            len(layers),
            MIN_LAYERS,
        )
        return None
    if enable_ckpt:
        for module in model.modules():
            # transformers >= 5 names it activation_checkpointing_disable (the old name warns)
            disable = getattr(module, "activation_checkpointing_disable", None) or getattr(
                module, "gradient_checkpointing_disable", None
            )
            if disable is not None:
                disable()
    return ActivationOffload(layers, enable_ckpt, copy_host_tensors)
