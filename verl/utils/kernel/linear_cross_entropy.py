"""`linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)`: upstream's
fused "linear + cross-entropy + entropy" entry point, returning (log-probs, entropy) of `labels` under the
logits `hidden @ weight^T / temperature` without materialising the [tokens, vocab] logits.

Upstream runs Triton kernels (GPU only); here it is `verl.utils.experimental.torch_functional.
fused_linear_for_ppo`, the chunked torch function the actor's `use_fused_kernels` runs, so it works on
any device with the same memory bound (one chunk of logits at a time, recomputed in the backward).

Return values, as upstream's: log-probs float32 (float64 for float64 inputs) of shape [num_tokens]
(`hidden` [..., H] is flattened over its leading dimensions) with `reduction="none"`, their sum or mean
(a 0-d tensor) with `"sum"` / `"mean"`; entropy always [num_tokens]. Both differentiate to `hidden`
and `weight`.

Left out: `dist_process_group` of more than one rank (upstream's vocabulary-parallel form, the weight
split over tensor-parallel ranks): a ValueError says so; a group of one rank is the plain case.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.utils.experimental.torch_functional import fused_linear_for_ppo

__all__ = ["REDUCTIONS", "linear_cross_entropy"]

REDUCTIONS = ("none", "sum", "mean")
"""How the per-token log-probs are returned: as they are, summed, or averaged over the tokens."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs, entropy) of `labels` [...] under `hidden` [..., H] @ `weight` [V, H]^T / `temperature`
    (module docstring for shapes and `reduction`)."""
    if not isinstance(reduction, str) or reduction.lower() not in REDUCTIONS:
        raise ValueError(f"Invalid reduction: {reduction!r}; linear_cross_entropy takes one of {list(REDUCTIONS)}")
    if dist_process_group is not None and dist.get_world_size(dist_process_group) > 1:
        raise ValueError(
            "linear_cross_entropy(dist_process_group=<group of "
            f"{dist.get_world_size(dist_process_group)} ranks>): the vocabulary-parallel form (LM head split over "
            "tensor-parallel ranks) is not implemented here; gather the head's weight and pass no group"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_hidden.shape[0] != flat_labels.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} holds {flat_hidden.shape[0]} tokens but labels {tuple(labels.shape)} "
            f"{flat_labels.shape[0]}: one label per token"
        )
    log_probs, entropy = fused_linear_for_ppo(flat_hidden, weight, flat_labels, float(temperature))
    reduction = reduction.lower()
    if reduction == "sum":
        log_probs = log_probs.sum()
    elif reduction == "mean":
        log_probs = log_probs.mean()
    return log_probs, entropy
