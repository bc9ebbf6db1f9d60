"""The critic's clipped value loss, the entropy bonus and the explained-variance metric."""

from __future__ import annotations

import torch

from verl.algorithms._common import _check_shapes
from verl.algorithms.aggregation import agg_loss
from verl.utils.torch_functional import entropy_from_logits_with_chunking, masked_mean, masked_var


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **global_batch: int | float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""PPO's clipped value loss; `critic.cliprange_value`, `critic.loss_agg_mode`; `global_batch`:
    `agg_loss`'s global counts (`dp_size`, `batch_num_tokens`, `global_batch_size`), if any.

    $\hat V^{clip} = \mathrm{clip}(\hat V, V_{old} - c, V_{old} + c)$,
    $\ell = \max((\hat V - G)^2, (\hat V^{clip} - G)^2)$, loss $= \frac12\,\mathrm{agg}(\ell)$.
    Shapes: all [B, R]. Returns (scalar loss, vf_clipfrac = fraction of tokens where the clipped
    term was larger).
    """
    _check_shapes(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, loss_agg_mode, **global_batch)
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(vpreds.dtype), response_mask).detach()
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    r"""Mean token entropy $\mathrm{agg}(H(\mathrm{softmax}(z_{i,t})))$ of logits [B, R, V] -> scalar.

    Differentiable, computed chunk by chunk (bounded memory for large vocabularies). The actor
    subtracts `actor.entropy_coeff` times this from the policy loss (an entropy bonus).
    """
    return agg_loss(entropy_from_logits_with_chunking(logits), response_mask, loss_agg_mode)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    r"""How much of the returns' variance the critic explains (the `critic/vf_explained_var` metric).

    $1 - \mathrm{Var}[G - V] / (\mathrm{Var}[G] + 10^{-5})$ over valid tokens (unbiased variances;
    the $10^{-5}$ keeps constant returns finite, as upstream). 1 is a perfect critic, 0 one that
    predicts the mean, negative worse than that. Shapes: [B, R] -> scalar.
    """
    _check_shapes(values=values, returns=returns, response_mask=response_mask)
    return 1.0 - masked_var(returns - values, response_mask) / (masked_var(returns, response_mask) + 1e-5)
