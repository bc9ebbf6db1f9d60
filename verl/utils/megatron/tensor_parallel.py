"""Log-probs and entropy from vocabulary-sharded logits, without gathering the vocabulary.

Megatron's LM head leaves each tensor-parallel rank with logits for its slice of the (padded)
vocabulary. The log-softmax needs two statistics over the whole vocabulary, the max (for
stability) and the sum of exponentials; both are all-reduced over the tp group, so the logits
are never gathered (V/tp memory per rank instead of V).

Autograd: the partial sums are combined with megatron's `reduce_from_tensor_model_parallel_region`
(all-reduce forward, identity backward), which is the exact gradient of a sum whose result is
used identically on every rank. The max is detached: it cancels out of every result.

Padded vocabulary columns (beyond the HF vocabulary) are excluded, so probabilities match the HF
model's exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_probs_and_entropy"]


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, calculate_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) [...] and (optionally) the entropy [...] of softmax over the full vocabulary.

    `logits` [..., V_local] is this rank's vocabulary slice (rank r holds columns
    [r * V_local, (r + 1) * V_local)); `labels` [...] are global token ids; `vocab_size` is the
    unpadded vocabulary size. Works at tp=1 too (plain log-softmax).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_rank = mpu.get_tensor_model_parallel_rank()
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    real_columns = (torch.arange(local_vocab, device=logits.device) + start) < vocab_size
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if not bool(real_columns.all()):
        logits = logits.masked_fill(~real_columns, float("-inf"))

    with torch.no_grad():
        shift = logits.max(dim=-1).values
        if mpu.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = logits - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_z = sum_exp.log()

    local_labels = labels - start
    owned = (local_labels >= 0) & (local_labels < local_vocab)
    picked = shifted.gather(-1, local_labels.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tensor_model_parallel_region(torch.where(owned, picked, torch.zeros_like(picked)))
    log_probs = picked - log_z
    if not calculate_entropy:
        return log_probs, None
    # H = log Z - sum_v p_v * z_v with z the shifted logits; padded columns have p = 0 (and z = -inf)
    weighted = torch.where(real_columns, exp * shifted, torch.zeros_like(shifted)).sum(dim=-1)
    entropy = log_z - reduce_from_tensor_model_parallel_region(weighted) / sum_exp
    return log_probs, entropy
