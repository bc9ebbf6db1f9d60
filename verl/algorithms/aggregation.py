"""Loss aggregation (`actor.loss_agg_mode`, `critic.loss_agg_mode`): a per-token loss [B, R] -> scalar.

Lives in its own module because every loss (policy, value, entropy, KL) ends with it.
"""

from __future__ import annotations

import torch

from verl.algorithms._common import _unknown_name_error
from verl.utils.torch_functional import masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    r"""Reduce a per-token loss [B, R] to a scalar (`actor.loss_agg_mode`).

    With mask $m$, $n_i = \sum_t m_{i,t}$ tokens in response $i$ and $S$ the responses with
    $n_i > 0$:

    - `token-mean`: $\sum_{i,t} m_{i,t}\ell_{i,t} / \sum_{i,t} m_{i,t}$ — every token weighs the
      same (DAPO, arXiv:2503.14476).
    - `seq-mean-token-sum`: $\frac{1}{|S|}\sum_{i\in S}\sum_t m_{i,t}\ell_{i,t}$.
    - `seq-mean-token-mean`: $\frac{1}{|S|}\sum_{i\in S}\frac{1}{n_i}\sum_t m_{i,t}\ell_{i,t}$ —
      every response weighs the same (original GRPO, arXiv:2402.03300).
    - `seq-mean-token-sum-norm`: $\frac{1}{B\,L}\sum_{i,t} m_{i,t}\ell_{i,t}$ with the constant
      $L$ = `loss_scale_factor` or the padded length R — no length bias (Dr. GRPO,
      arXiv:2503.20783). Upstream verl omits the $1/B$; we keep it so the value does not grow
      with the micro-batch size.

    Fully padded responses are left out of the `seq-mean-*` means; an empty mask gives 0.

    Global normalisation (upstream's keywords, what its engine loss functions pass): when this
    [B, R] is one micro-batch of a larger batch spread over `dp_size` data-parallel ranks,
    `batch_num_tokens` (the whole batch's masked tokens) replaces the token count of `token-mean`
    and `global_batch_size` (the whole batch's sequences) replaces |S| and B of the `seq-mean-*`
    modes; the result is multiplied by `dp_size`. Summed over a rank's micro-batches and averaged
    over the ranks (what data-parallel gradient averaging does), it is the whole batch's value
    above. Left None, each falls back to this micro-batch's own count (and `dp_size` still scales).
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            return masked_mean(loss_mat, loss_mask) * dp_size
        return masked_sum(loss_mat, loss_mask) / _nonzero(batch_num_tokens) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        sequences = max(loss_mat.shape[0], 1) if global_batch_size is None else _nonzero(global_batch_size)
        return masked_sum(loss_mat, loss_mask) / (sequences * norm) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = masked_mean(loss_mat, loss_mask, axis=-1)
        non_empty = (loss_mask != 0).any(dim=-1)
        if global_batch_size is None:
            return masked_mean(seq_losses, non_empty) * dp_size
        return masked_sum(seq_losses, non_empty) / _nonzero(global_batch_size) * dp_size
    raise _unknown_name_error("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)


def _nonzero(count):
    # an empty batch sums to 0: divide it by 1 (giving 0, as the local modes do) instead of 0
    return torch.where(count != 0, count, 1) if isinstance(count, torch.Tensor) else (count or 1)
