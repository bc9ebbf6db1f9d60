"""Tiled MLP: a decoder layer's MLP computed over token chunks, recomputed chunk by chunk in the backward.

A SwiGLU MLP (`down(act(gate(x)) * up(x))`) holds, for each token, three activations of the
intermediate size (gate, up and their product), usually 3-4x the hidden size; for long sequences
they are the largest activations of the layer. `TiledMLP` splits the layer's tokens into
`num_shards` chunks: the forward runs each chunk without recording a graph and keeps only its
input, the backward recomputes one chunk at a time and takes its gradients before the next, so at
most one chunk's intermediate activations exist at any time, in the forward and in the backward.
The output and the gradients equal the untiled MLP's up to the summation order of the weight
gradients (float64: ~1e-15 relative).

`apply_tiled_mlp_monkey_patch(num_shards, model_type)` is upstream's entry point: it replaces the
`forward` of the model type's MLP class in transformers (Llama, Qwen2/2.5, Qwen3), so every
instance, existing or built later, is tiled in this process. `apply_monkey_patch(use_tiled_mlp=True,
tiled_mlp_shards=...)` calls it with the model's `model_type`; the config keys are
`actor_rollout_ref.model.tiled_mlp.{enabled,num_shards}` and `critic.model.tiled_mlp`.

Design decisions:
- The MLP's parameters are inputs of the autograd function, so their gradients reach them through
  autograd (each parameter's accumulation node, FSDP2's reduce-scatter hooks included) instead of
  through per-parameter hooks. Per-chunk weight gradients are summed in float32 (float64 for
  float64 weights) and handed back once.
- The random state (CPU and device) at the forward is restored for the recomputation, so a LoRA
  adapter's dropout inside the MLP draws the same masks in the backward as in the forward.
- Chunks are over all tokens of the call ([B, S, H] flattened to [B*S, H]): the MLP acts on each
  token alone, so any split gives the same result; a packed batch (B=1) is split along its sequence.
- `remove_tiled_mlp_monkey_patch()` restores the original forwards (tests; this module's addition).
"""

from __future__ import annotations

import importlib

import torch

from verl.utils import device as dev

__all__ = ["TiledMLP", "apply_tiled_mlp_monkey_patch", "remove_tiled_mlp_monkey_patch", "tiled_mlp_forward"]

# model_type -> (module, class) of its SwiGLU MLP in transformers (upstream's table)
_MLP_CLASSES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaMLP"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2MLP"),
    "qwen2_5": ("transformers.models.qwen2.modeling_qwen2", "Qwen2MLP"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3MLP"),
}

_ORIGINAL_FORWARD = "_verl_untiled_forward"


def _swiglu(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def _rng_states(device: torch.device) -> tuple:
    cpu = torch.get_rng_state()
    accel = dev.get_torch_device().get_rng_state(device) if device.type != "cpu" else None
    return cpu, accel


def _set_rng_states(states: tuple, device: torch.device) -> None:
    cpu, accel = states
    torch.set_rng_state(cpu)
    if accel is not None:
        dev.get_torch_device().set_rng_state(accel, device)


class TiledMLP(torch.autograd.Function):
    """`fn(module, x)` over `num_shards` token chunks of `x` [..., H]; `params` are the module's
    trainable parameters (their gradients are returned by the backward)."""

    @staticmethod
    def forward(ctx, fn, module, x: torch.Tensor, num_shards: int, *params: torch.nn.Parameter):
        ctx.fn, ctx.module, ctx.num_shards, ctx.module_params = fn, module, num_shards, params
        ctx.rng = _rng_states(x.device)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            out = torch.cat([fn(module, chunk) for chunk in flat.chunk(num_shards, dim=0)], dim=0)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = [p for p, need in zip(ctx.module_params, ctx.needs_input_grad[4:], strict=True) if need]
        need_x = ctx.needs_input_grad[2]
        flat_x = x.detach().reshape(-1, x.shape[-1])
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat_x) if need_x else None
        sums = [torch.zeros_like(p, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32) for p in params]
        start = 0
        with torch.random.fork_rng(devices=[x.device] if x.device.type != "cpu" else []):
            _set_rng_states(ctx.rng, x.device)
            for chunk in flat_x.chunk(ctx.num_shards, dim=0):
                end = start + chunk.shape[0]
                chunk = chunk.detach().requires_grad_(need_x)
                with torch.enable_grad():
                    out = ctx.fn(ctx.module, chunk)
                inputs = ([chunk] if need_x else []) + params
                grads = torch.autograd.grad(out, inputs, flat_grad[start:end], allow_unused=True)
                if need_x:
                    grad_x[start:end] = grads[0]
                    grads = grads[1:]
                for total, grad in zip(sums, grads, strict=True):
                    if grad is not None:
                        total += grad
                start = end
        param_grads = iter(total.to(p.dtype) for total, p in zip(sums, params, strict=True))
        per_input = [next(param_grads) if need else None for need in ctx.needs_input_grad[4:]]
        return None, None, grad_x.view_as(x) if need_x else None, None, *per_input


def tiled_mlp_forward(module: torch.nn.Module, x: torch.Tensor, num_shards: int, fn=_swiglu) -> torch.Tensor:
    """`fn(module, x)` (default: the SwiGLU MLP) computed in `num_shards` token chunks (see the module docstring)."""
    if num_shards < 1:
        raise ValueError(f"tiled MLP num_shards={num_shards} must be at least 1 (the number of token chunks)")
    return TiledMLP.apply(fn, module, x, num_shards, *module.parameters())


def _mlp_class(model_type: str) -> type:
    module_name, class_name = _MLP_CLASSES[model_type]
    return getattr(importlib.import_module(module_name), class_name)


def apply_tiled_mlp_monkey_patch(num_shards: int = 4, model_type: str | None = None) -> list[str]:
    """Tile the MLP of `model_type` (None: every supported type) in `num_shards` token chunks; returns the
    names of the patched classes. Takes effect for existing and future instances in this process; patching
    again replaces the shard count."""
    if num_shards < 1:
        raise ValueError(f"tiled_mlp.num_shards={num_shards} must be at least 1 (the number of token chunks)")
    if model_type is not None and model_type not in _MLP_CLASSES:
        raise ValueError(
            f"TiledMLP does not support model_type='{model_type}': its MLP is tiled for {sorted(_MLP_CLASSES)} "
            "(SwiGLU MLPs with gate_proj, up_proj, down_proj); set tiled_mlp.enabled=false for this model"
        )
    patched: list[str] = []
    for mtype in [model_type] if model_type is not None else list(_MLP_CLASSES):
        try:
            cls = _mlp_class(mtype)
        except (ImportError, AttributeError):
            if model_type is not None:
                raise
            continue  # an older transformers without this model: nothing of it can be built either
        if _ORIGINAL_FORWARD not in cls.__dict__:
            setattr(cls, _ORIGINAL_FORWARD, cls.forward)

        def forward(self, x, _shards=num_shards):
            return tiled_mlp_forward(self, x, _shards)

        cls.forward = forward
        if cls.__name__ not in patched:
            patched.append(cls.__name__)
    return patched


def remove_tiled_mlp_monkey_patch() -> list[str]:
    """Restore the untiled forward of every MLP class patched in this process; returns their names."""
    restored: list[str] = []
    for mtype in _MLP_CLASSES:
        try:
            cls = _mlp_class(mtype)
        except (ImportError, AttributeError):
            continue
        original = cls.__dict__.get(_ORIGINAL_FORWARD)
        if original is not None:
            cls.forward = original
            delattr(cls, _ORIGINAL_FORWARD)
            restored.append(cls.__name__)
    return restored
