"""Fused linear -> log-softmax -> gather (+ entropy): log-probs of target tokens straight from the
last hidden states and the LM head's weight, never holding the [tokens, vocab] logits.

This is what `use_fused_kernels=true` (with `fused_kernel_options.impl_backend=torch`) runs in the
actor and the reference policy, as upstream's does: the model's forward stops at the last hidden
states and `FusedLinearForPPO` computes, chunk by chunk over the tokens,

    z = (h @ W^T) / temperature        (the matmul in the weights' dtype, z upcast to float32)
    log_prob = z[label] - logsumexp(z)
    entropy  = logsumexp(z) - sum_v softmax(z)_v * z_v

Only one chunk's logits exist at a time, in the forward and in the backward, which recomputes them
instead of saving them (the unfused path keeps the whole [tokens, vocab] logits of the micro-batch
alive for the backward, in the model's dtype, plus float32 chunks). Gradients flow to the hidden
states and to the weight (accumulated in float32 over the chunks, so a tied embedding gets a
float32-accurate sum); the entropy's gradient is computed only when the entropy is used in the
loss.

Design decisions:

- Plain torch, no Triton: the chunked matmuls are where the time goes and cuBLAS runs them; what
  fusing saves is memory and the copies of the logits, which chunking already removes. A Triton
  backend (`impl_backend=triton` upstream) is refused with a clear error, not silently replaced.
- `fused_lm_head` plugs the function into an HF causal LM by replacing the LM head's forward for
  the duration of one model call, rather than patching the model class: the model's own forward
  (and FSDP2's hooks around it, which gather the sharded head weight) run unchanged, and the head
  receives exactly the positions the model would have computed logits for (`logits_to_keep`
  included). The "logits" the model returns are then [..., 2]: log-prob and entropy per position.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["FUSED_BACKENDS", "FusedLinearForPPO", "check_fused_backend", "fused_linear_for_ppo", "fused_lm_head"]

FUSED_BACKENDS = ("torch",)
"""The `fused_kernel_options.impl_backend` values this project implements."""

DEFAULT_CHUNK_SIZE = 512
"""Tokens per chunk: at a 152k vocabulary one float32 chunk of logits is about 300 MB."""


def check_fused_backend(options: dict | None) -> str:
    """The backend `fused_kernel_options` names (default `torch`), or a ValueError for one not implemented
    or for an option this implementation does not know (upstream's has `impl_backend` only)."""
    unknown = sorted(set(options or {}) - {"impl_backend"})
    if unknown:
        raise ValueError(
            f"model.fused_kernel_options has unknown option(s) {unknown}; the only option is impl_backend (torch)"
        )
    backend = (options or {}).get("impl_backend", "torch") or "torch"
    if backend not in FUSED_BACKENDS:
        raise ValueError(
            f"model.fused_kernel_options.impl_backend={backend!r} is not implemented here (only "
            f"{list(FUSED_BACKENDS)}: a chunked torch kernel that bounds memory the same way); "
            "set actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"
        )
    return backend


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, masked_ids: torch.Tensor | None = None
) -> torch.Tensor:
    # float64 stays float64 (exact references in tests); anything else is upcast to float32
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = (hidden @ weight.t()).to(dtype) / temperature
    if masked_ids is not None:
        # tokens outside the policy: probability exactly 0, a finite logit (p * z stays 0), no gradient
        logits.index_fill_(-1, masked_ids, torch.finfo(dtype).min)
    return logits


class _FusedLinearForPPOFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, chunk_size: int, masked_ids=None):
        ctx.set_materialize_grads(False)
        num_tokens = hidden.shape[0]
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        log_probs = torch.empty(num_tokens, dtype=out_dtype, device=hidden.device)
        entropy = torch.empty(num_tokens, dtype=out_dtype, device=hidden.device)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = _chunk_logits(hidden[start:end], weight, temperature, masked_ids)
            lse = torch.logsumexp(logits, dim=-1)
            log_probs[start:end] = logits.gather(-1, labels[start:end, None]).squeeze(-1) - lse
            probs = torch.softmax(logits, dim=-1)
            entropy[start:end] = lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.chunk_size, ctx.masked_ids = temperature, chunk_size, masked_ids
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            logits = _chunk_logits(hidden[start:end], weight, ctx.temperature, ctx.masked_ids)
            probs = torch.softmax(logits, dim=-1)
            # (a masked token has p = 0, so its gradient below is 0: its logit is a constant)
            # d/dz of g_lp * log_prob + g_ent * entropy, with z the temperature-scaled logits:
            #   log_prob: onehot(label) - p;   entropy: -p * (z - sum_v p_v z_v)
            grad_logits = torch.zeros_like(logits)
            if grad_entropy is not None:
                mean_z = (probs * logits).sum(-1, keepdim=True)
                grad_logits -= grad_entropy[start:end, None].to(logits.dtype) * probs * (logits - mean_z)
            if grad_log_probs is not None:
                g = grad_log_probs[start:end, None].to(logits.dtype)
                grad_logits -= g * probs
                grad_logits.scatter_add_(-1, labels[start:end, None], g)
            grad_logits = (grad_logits / ctx.temperature).to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight += (grad_logits.t() @ hidden[start:end]).to(acc_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_for_ppo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    masked_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs [...], entropy [...]) of `labels` [...] under logits `hidden` [..., H] @ `weight`
    [V, H]^T divided by `temperature`; float32 (float64 for float64 inputs), differentiable with
    respect to `hidden` and `weight`. `masked_ids`: vocabulary ids outside the policy (a
    vision-language model's input-only markers, `verl.utils.vision.input_only_token_ids`), whose
    probability is 0 in both the log-probs and the entropy."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive: the logits are divided by it")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of tokens")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree on every dimension "
            "but the last (one label per position)"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"the LM head weight {tuple(weight.shape)} must be [vocab, {hidden.shape[-1]}]")
    lead = labels.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).long()
    masked = torch.tensor(list(masked_ids), dtype=torch.long, device=hidden.device) if masked_ids else None
    log_probs, entropy = _FusedLinearForPPOFunction.apply(
        flat_hidden, weight, flat_labels, temperature, chunk_size, masked
    )
    return log_probs.view(lead), entropy.view(lead)


class FusedLinearForPPO(torch.nn.Module):
    """`fused_linear_for_ppo` as a module (upstream's name): forward(hidden_states, vocab_weights,
    input_ids, temperature) -> (log_probs, entropy); `input_ids` are the labels (already shifted)."""

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE):
        super().__init__()
        self.chunk_size = chunk_size

    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        return fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature, self.chunk_size)


# Config attributes of models whose LM head does more than a plain matmul: the fused path would be wrong.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def fused_head_problem(hf_model: torch.nn.Module) -> str | None:
    """Why `fused_lm_head` cannot run on `hf_model`, or None when it can."""
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return f"{type(hf_model).__name__} has no linear LM head (get_output_embeddings() is {type(head).__name__})"
    if head.bias is not None:
        return f"{type(hf_model).__name__}'s LM head has a bias, which the fused log-prob does not add"
    config = getattr(hf_model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 0, 0.0, 1, 1.0):
            return (
                f"{type(hf_model).__name__} transforms its logits ({name}={value}), which the fused log-prob does not"
            )
    return None


@contextlib.contextmanager
def fused_lm_head(
    hf_model: torch.nn.Module,
    labels: torch.Tensor,
    temperature: float,
    with_entropy_grad: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    masked_ids: list[int] | None = None,
):
    """Within the block, one call of `hf_model` returns as `.logits` a float32 [..., 2] tensor:
    (log-prob of `labels`, entropy) at each position its LM head sees. `labels` must have the shape
    of those positions (e.g. [B, logits_to_keep]). Without `with_entropy_grad` the entropy is
    detached (reported, not trained: its backward is skipped). Refuses a model the fused path would
    get wrong."""
    problem = fused_head_problem(hf_model)
    if problem is not None:
        raise ValueError(f"use_fused_kernels=true cannot run: {problem}; set use_fused_kernels=false")
    head = hf_model.get_output_embeddings()

    def forward(hidden_states):
        # inside the head's call: FSDP2 has gathered its weight (the root unit's parameters)
        log_probs, entropy = fused_linear_for_ppo(
            hidden_states, head.weight, labels, temperature, chunk_size, masked_ids
        )
        return torch.stack([log_probs, entropy if with_entropy_grad else entropy.detach()], dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
