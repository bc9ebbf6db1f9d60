"""Tensor helpers shared by the algorithms, the actor and the critic: masked statistics, log-probs
and entropy from logits.

Design decisions:

- Masked statistics ignore padding *exactly*: a padded position contributes nothing, even when it
  holds NaN or inf (we select with `torch.where` rather than multiply by the mask, because
  `nan * 0` is NaN). An empty mask gives 0 rather than 0/0, so a micro-batch whose responses are
  all padding yields a finite loss and zero gradient instead of poisoning the step with NaN.
- Log-probs and entropy of a large vocabulary are computed in chunks of rows with a hand-written
  backward, so neither the forward nor the backward ever holds a float32 copy of the whole
  [tokens, vocab] logits: only one chunk at a time. Low-precision logits (bf16/fp16) are upcast to
  float32 per chunk; float64 stays float64 (the tests use it for exact references).
- Nothing here calls `.item()` or synchronises with the host, so the functions are safe inside a
  compiled or CUDA-graph-captured step.

Public names follow upstream verl (`verl.utils.torch_functional as verl_F`): `masked_sum`,
`masked_mean`, `masked_var`, `masked_whiten`, `entropy_from_logits`,
`entropy_from_logits_with_chunking`, `logprobs_from_logits`, and the collective statistics
`distributed_masked_mean` / `distributed_mean_max_min_std` (all-reduces over the default group,
the only functions here that synchronise) and `expand_as_nested` for jagged batches.
"""

from __future__ import annotations

import torch

__all__ = [
    "distributed_masked_mean",
    "distributed_mean_max_min_std",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "expand_as_nested",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "sum_pi_squared_from_logits",
]

# Chunks of logits rows are sized so one float32 chunk stays around this many bytes.
_DEFAULT_CHUNK_BYTES = 256 * 2**20


# ----------------------------------------------------------------------------------------------
# Masked statistics
# ----------------------------------------------------------------------------------------------


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values * mask` where the mask is non-zero and exactly 0 elsewhere (even for NaN/inf values)."""
    if mask.shape != values.shape:
        mask = mask.expand_as(values)
    return torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` over positions where `mask` is non-zero (weighted by the mask).

    values, mask: same shape (mask may be bool, int or float; a float mask acts as weights).
    axis: reduce this dimension only; None reduces everything to a scalar.
    """
    masked = _masked(values, mask)
    return masked.sum() if axis is None else masked.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    r"""Mean of `values` over the unmasked positions: $\sum_i m_i x_i / \sum_i m_i$.

    values, mask: same shape. axis: reduce this dimension only (None: all). Where the mask is empty
    the result is 0 (documented choice: no tokens contribute nothing, never NaN).
    """
    total = masked_sum(values, mask, axis)
    count = mask.to(values.dtype)
    if count.shape != values.shape:
        count = count.expand_as(values)
    count = count.sum() if axis is None else count.sum(dim=axis)
    return torch.where(count != 0, total / torch.where(count != 0, count, torch.ones_like(count)), 0.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    r"""Variance of `values` over all unmasked positions (a scalar).

    $\mathrm{Var} = \frac{n}{n-1}\cdot\frac{\sum_i m_i (x_i - \bar x)^2}{\sum_i m_i}$ with Bessel's
    correction when `unbiased`, $n = \sum_i m_i$. With fewer than two unmasked positions (where the
    unbiased variance is undefined) the result is 0, never NaN or an error.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.to(values.dtype).sum()
        var = torch.where(n > 1, var * n / torch.where(n > 1, n - 1, torch.ones_like(n)), 0.0)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    r"""Normalise `values` to zero mean and unit variance over the unmasked positions.

    $\hat x = (x - \bar x) / \sqrt{\mathrm{Var}_{unbiased}(x) + 10^{-8}}$ (mean added back when
    `shift_mean=False`), statistics from unmasked positions only. Padded positions are 0 in the
    output. Constant values (zero variance) map to 0, not NaN.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return _masked(whitened, (mask != 0).to(values.dtype))


# ----------------------------------------------------------------------------------------------
# Log-probs and entropy from logits
# ----------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision, the dtype itself for float32/float64."""
    return torch.promote_types(dtype, torch.float32)


def _rows_per_chunk(vocab_size: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be a positive number of rows")
        return chunk_size
    return max(1, _DEFAULT_CHUNK_BYTES // (4 * max(vocab_size, 1)))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    r"""Entropy of the categorical distribution given by `logits` [..., V] -> [...].

    $H = -\sum_v p_v \log p_v$ with $\log p = \mathrm{log\_softmax}(z)$, computed in float32 (or
    float64) in one piece. Differentiable by autograd. Holds a float32 copy of the whole tensor:
    for large vocabularies use `entropy_from_logits_with_chunking`.
    """
    z = logits.to(_compute_dtype(logits.dtype))
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, 0.0).sum(dim=-1)


def _row_blocks(logits: torch.Tensor) -> torch.Tensor:
    """View logits [..., V] as [P, Q, V] without copying.

    All rows form one block when the leading dims flatten to a view; otherwise there is one block
    per index of the first dimension, so a slice such as `logits[:, :-1]` of a [B, T, V] tensor
    (which cannot be flattened without a copy) is still read in place.
    """
    vocab = logits.shape[-1]
    try:
        return logits.view(1, -1, vocab)
    except RuntimeError:
        return logits.reshape(logits.shape[0], -1, vocab)


def _chunks(blocks: torch.Tensor, rows: int):
    """Index tuples selecting `rows` rows at a time from a [P, Q, V] tensor (or its [P, Q] outputs)."""
    for p in range(blocks.shape[0]):
        for start in range(0, blocks.shape[1], rows):
            yield p, slice(start, start + rows)


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy per row of a [P, Q, V] tensor, chunk by chunk, with the gradient
    dH/dz_v = -p_v (log p_v + H) recomputed chunk by chunk in backward."""

    @staticmethod
    def forward(ctx, blocks: torch.Tensor, rows: int) -> torch.Tensor:
        cdtype = _compute_dtype(blocks.dtype)
        out = torch.empty(blocks.shape[:-1], dtype=cdtype, device=blocks.device)
        for idx in _chunks(blocks, rows):
            logp = torch.log_softmax(blocks[idx].to(cdtype), dim=-1)
            p = logp.exp()
            out[idx] = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1)
        ctx.rows = rows
        ctx.save_for_backward(blocks, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        blocks, entropy = ctx.saved_tensors
        cdtype = entropy.dtype
        grad = torch.empty_like(blocks)
        for idx in _chunks(blocks, ctx.rows):
            logp = torch.log_softmax(blocks[idx].to(cdtype), dim=-1)
            p = logp.exp()
            g = -torch.where(p > 0, p * (logp + entropy[idx].unsqueeze(-1)), 0.0)
            grad[idx] = (g * grad_out[idx].unsqueeze(-1).to(cdtype)).to(blocks.dtype)
        return grad, None


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    r"""Entropy $H = -\sum_v p_v \log p_v$ of `logits` [..., V] -> [...], `chunk_size` rows at a time.

    Same values as `entropy_from_logits`, but memory stays bounded by one float32 chunk of
    [chunk_size, V] in forward and backward (the backward recomputes the softmax per chunk instead
    of keeping it), and the logits are read in place (no flattening copy, also for a sliced
    [B, R, V] view). `chunk_size=None` picks rows so a chunk is about 256 MiB. Result dtype is
    float32 (float64 for float64 logits).
    """
    blocks = _row_blocks(logits)
    out = _ChunkedEntropy.apply(blocks, _rows_per_chunk(logits.shape[-1], chunk_size))
    return out.reshape(logits.shape[:-1])


class _ChunkedLogProb(torch.autograd.Function):
    """log p(label) per row of a [P, Q, V] tensor, chunk by chunk; backward is onehot - softmax."""

    @staticmethod
    def forward(ctx, blocks: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
        cdtype = _compute_dtype(blocks.dtype)
        out = torch.empty(blocks.shape[:-1], dtype=cdtype, device=blocks.device)
        lse = torch.empty_like(out)
        for idx in _chunks(blocks, rows):
            z = blocks[idx].to(cdtype)
            lse[idx] = torch.logsumexp(z, dim=-1)
            out[idx] = z.gather(-1, labels[idx].unsqueeze(-1)).squeeze(-1) - lse[idx]
        ctx.rows = rows
        ctx.save_for_backward(blocks, labels, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        blocks, labels, lse = ctx.saved_tensors
        cdtype = lse.dtype
        grad = torch.empty_like(blocks)
        for idx in _chunks(blocks, ctx.rows):
            g_rows = grad_out[idx].unsqueeze(-1).to(cdtype)
            g = -torch.exp(blocks[idx].to(cdtype) - lse[idx].unsqueeze(-1)) * g_rows
            g.scatter_add_(-1, labels[idx].unsqueeze(-1), g_rows)
            grad[idx] = g.to(blocks.dtype)
        return grad, None, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    r"""Log-probability of each label: $\log p(y) = z_y - \log\sum_v e^{z_v}$.

    logits: [..., V] (any float dtype); labels: [...] integer token ids. Returns [...] in float32
    (float64 for float64 logits). The math runs in float32 at least, `chunk_size` rows at a time, and
    the hand-written backward ($\partial/\partial z = \mathbb{1}_y - p$) recomputes the softmax per
    chunk, so memory stays bounded by one float32 chunk beyond the logits and their gradient; the
    logits are read in place (no flattening copy). `chunk_size=None` picks rows so a chunk is about
    256 MiB.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the logits shape without the vocabulary "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    blocks = _row_blocks(logits)
    block_labels = labels.long().reshape(blocks.shape[:-1])
    out = _ChunkedLogProb.apply(blocks, block_labels, _rows_per_chunk(logits.shape[-1], chunk_size))
    return out.reshape(logits.shape[:-1])


# ----------------------------------------------------------------------------------------------
# Jagged batches and statistics over the data-parallel group
# ----------------------------------------------------------------------------------------------


def expand_as_nested(tensor: torch.Tensor, nested_tensor: torch.Tensor) -> torch.Tensor:
    """Broadcast one value per row (`tensor` [B]) over the rows of a jagged `nested_tensor` [B, j]:
    a nested tensor with the same offsets whose row i repeats `tensor[i]`."""
    if not nested_tensor.is_nested or nested_tensor.dim() != 2:
        raise ValueError(f"expand_as_nested needs a 2-D nested tensor, got shape {tuple(nested_tensor.shape)}")
    if tensor.dim() != 1 or tensor.shape[0] != nested_tensor.shape[0]:
        raise ValueError(
            f"expand_as_nested needs one value per row: tensor of shape {tuple(tensor.shape)} for "
            f"{nested_tensor.shape[0]} rows"
        )
    offsets = nested_tensor.offsets()
    values = torch.repeat_interleave(tensor, offsets.diff(), dim=0)
    return torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)


def distributed_masked_mean(local_tensor: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the entries where `local_mask` is 1, over every rank of the default process group
    (sum and count are all-reduced, so ranks with more valid entries weigh more)."""
    import torch.distributed as dist

    local_sum = torch.where(local_mask.bool(), local_tensor, 0).sum()
    local_count = local_mask.sum().to(local_sum.dtype)
    dist.all_reduce(local_sum, op=dist.ReduceOp.SUM)
    dist.all_reduce(local_count, op=dist.ReduceOp.SUM)
    return local_sum / local_count


def distributed_mean_max_min_std(
    local_tensor: torch.Tensor, compute_max: bool = True, compute_min: bool = True, compute_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(mean, max, min, std) of all entries on every rank of the default process group; a statistic
    not asked for is None. The std is the unbiased one (divides by the total count - 1)."""
    import torch.distributed as dist

    total = local_tensor.sum()
    count = torch.tensor(float(local_tensor.numel()), dtype=total.dtype, device=total.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    mean = total / count
    largest = smallest = std = None
    if compute_max:
        largest = local_tensor.max()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if compute_min:
        smallest = local_tensor.min()
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    if compute_std:
        squares = ((local_tensor - mean) ** 2).sum()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        std = torch.sqrt(squares / (count - 1))
    return mean, largest, smallest, std


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    r"""$\sum_v p_v^2$ of the categorical distribution given by `logits` [..., V] -> [...] (no gradient).

    Computed as $\exp(\mathrm{lse}(2z) - 2\,\mathrm{lse}(z))$, exact and stable for any logits,
    `chunk_size` rows at a time (memory bounded as in `entropy_from_logits_with_chunking`). Result
    dtype float32 (float64 for float64 logits). It is the collision probability of the
    distribution; the optimal token baseline needs it for $\|\nabla_z \log p_y\|^2 = 1 - 2p_y +
    \sum_v p_v^2$.
    """
    blocks = _row_blocks(logits)
    rows = _rows_per_chunk(logits.shape[-1], chunk_size)
    cdtype = _compute_dtype(blocks.dtype)
    out = torch.empty(blocks.shape[:-1], dtype=cdtype, device=blocks.device)
    for idx in _chunks(blocks, rows):
        z = blocks[idx].to(cdtype)
        out[idx] = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))
    return out.reshape(logits.shape[:-1])
