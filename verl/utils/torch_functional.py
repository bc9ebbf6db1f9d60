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

Upstream's smaller helpers live at the end under its names: the log-prob variants
(`logprobs_from_logits_naive`, `logprobs_from_logits_v2`, the response and packed-batch forms),
`get_response_mask`, the padding and truncation of tokenizer output (`pad_sequence_to_length`,
`postprocess_data`, ...), `allgather_dict_tensors`, the decoder attention mask, and the lr schedules
re-exported from `verl.utils.optim` (one implementation). Upstream's NPU and flash-attn log-prob
kernels are not here: `logprobs_from_logits` is the chunked torch one on every device.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl.utils.device import get_device_name, is_cuda_available
from verl.utils.optim import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_wsd_schedule_with_warmup,
)
from verl.utils.remove_padding import pad_input, unpad_input

__all__ = [
    "TRUNCATIONS",
    "allgather_dict_into_dict",
    "allgather_dict_tensors",
    "broadcast_dict_tensor",
    "calculate_sum_pi_squared_from_logits",
    "check_device_is_available",
    "clip_by_value",
    "compute_grad_norm",
    "gather_from_labels",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "get_response_mask",
    "get_unpad_data",
    "get_wsd_schedule_with_warmup",
    "log_probs_from_logits_all_rmpad",
    "log_probs_from_logits_response",
    "log_probs_from_logits_response_rmpad",
    "logprobs_from_logits_naive",
    "logprobs_from_logits_v2",
    "pad_2d_list_to_length",
    "pad_sequence_to_length",
    "post_process_logits",
    "postprocess_data",
    "prepare_decoder_attention_mask",
    "remove_pad_token",
    "split_dict_tensor_into_batches",
    "tokenize_and_postprocess_data",
    "use_original_torch_compile",
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


# ----------------------------------------------------------------------------------------------
# Upstream's smaller helpers (log-prob variants, masks, padding, collectives over dicts)
# ----------------------------------------------------------------------------------------------


def gather_from_labels(data: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """`data[..., label]` per position: data [..., V], label [...] integer ids -> [...]."""
    return torch.gather(data, -1, label.long().unsqueeze(-1)).squeeze(-1)


def logprobs_from_logits_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)[labels]` in one piece, in the logits' own dtype (no upcast, no chunking):
    the plain reference; `logprobs_from_logits` is the memory-bounded one."""
    return gather_from_labels(torch.log_softmax(logits, dim=-1), labels)


def logprobs_from_logits_v2(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    r"""Log-probabilities of `labels` computed one row of the first dimension at a time.

    logits [B, ..., V], labels [B, ...] -> [B, ...] in the logits' dtype. float32/float64 use
    $z_y - \mathrm{lse}(z)$; lower precisions use a per-row `log_softmax` (the subtraction of two
    large bf16 numbers loses the small difference), as upstream.
    """
    if logits.dtype in (torch.float32, torch.float64):
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return gather_from_labels(logits, labels) - lse
    rows = [
        gather_from_labels(torch.log_softmax(row, dim=-1), row_labels)
        for row, row_labels in zip(logits, labels, strict=True)
    ]
    return torch.stack(rows)


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Clamp `x` elementwise between tensor bounds (broadcastable to `x`): max(min(x, hi), lo)."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def get_response_mask(response_id: torch.Tensor, eos_token: int | list[int] = 2, dtype=torch.int64) -> torch.Tensor:
    """Mask [B, R] of each response up to and including its first EOS token (`eos_token`: one id or a
    list of ids); everything after the first EOS is 0. A row without EOS is all 1."""
    eos = torch.as_tensor(eos_token, device=response_id.device).reshape(-1)
    is_eos = torch.isin(response_id, eos).to(torch.int64)
    eos_before = is_eos.cumsum(dim=-1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).to(dtype)


def compute_grad_norm(model: torch.nn.Module) -> float:
    """The *squared* L2 norm of the model's gradients, a Python float (upstream's name and value: take
    the square root for the norm). Parameters without a gradient are skipped."""
    total = 0.0
    for param in model.parameters():
        if param.grad is not None:
            total += torch.sum(torch.square(param.grad.detach().double())).item()
    return total


def allgather_dict_tensors(tensors, size: int, group, dim: int = 0):
    """All-gather every tensor of a dict (or TensorDict) over `group` (of `size` ranks) and concatenate
    the ranks' tensors along `dim`, rank order; returns the same kind of container."""
    is_tensordict = isinstance(tensors, TensorDict)
    source = tensors.to_dict() if is_tensordict else tensors
    output = {}
    for key in sorted(source):
        parts = [torch.empty_like(source[key]) for _ in range(size)]
        dist.all_gather(parts, source[key].contiguous(), group=group)
        output[key] = torch.cat(parts, dim=dim)
    if is_tensordict:
        return TensorDict(source=output, batch_size=tensors.batch_size[0] * size)
    return output


def broadcast_dict_tensor(tensors, src: int, group) -> None:
    """Broadcast every tensor of a dict (or TensorDict) from rank `src` over `group`, in place, in
    sorted key order (every rank must hold the same keys and shapes)."""
    for key in sorted(tensors.keys()):
        dist.broadcast(tensors[key], src=src, group=group)


def allgather_dict_into_dict(data: dict, group=None) -> dict[str, list]:
    """All-gather a dict of picklable values from every rank of `group`: {key: [rank 0's value, rank 1's,
    ...]} (a key only some ranks have lists only theirs, in rank order)."""
    if not isinstance(data, dict):
        raise TypeError(f"allgather_dict_into_dict takes a dict, got {type(data).__name__}")
    gathered = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, data, group=group)
    out: dict[str, list] = {}
    for rank_data in gathered:
        for key, value in rank_data.items():
            out.setdefault(key, []).append(value)
    return out


def split_dict_tensor_into_batches(tensors, batch_size: int) -> list:
    """Split a TensorDict into consecutive pieces of `batch_size` rows (the row count must divide)."""
    rows = tensors.batch_size[0]
    if batch_size < 1 or rows % batch_size != 0:
        raise ValueError(
            f"cannot split {rows} rows into batches of {batch_size}: the batch size must be a positive divisor "
            f"of the number of rows"
        )
    return list(tensors.split(batch_size))


def pad_2d_list_to_length(response, pad_token_id, max_length: int | None = None) -> torch.Tensor:
    """A list of lists (token ids, log-probs) -> a [N, L] tensor, each row right-padded with
    `pad_token_id` to L = the longest row, or `max_length` when that is longer."""
    longest = max(len(row) for row in response)
    length = max_length if max_length is not None and max_length > longest else longest
    return torch.tensor([list(row) + [pad_token_id] * (length - len(row)) for row in response])


def pad_sequence_to_length(
    tensors: torch.Tensor, max_seq_len: int, pad_token_id, left_pad: bool = False
) -> torch.Tensor:
    """Pad [..., L] to [..., max_seq_len] with `pad_token_id` on the right (left when `left_pad`);
    returned unchanged when already at least that long."""
    missing = max_seq_len - tensors.shape[-1]
    if missing <= 0:
        return tensors
    return torch.nn.functional.pad(tensors, (missing, 0) if left_pad else (0, missing), "constant", pad_token_id)


TRUNCATIONS = ("left", "right", "middle", "error")


def postprocess_data(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_length: int,
    pad_token_id: int,
    left_pad: bool = True,
    truncation: str = "error",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring tokenizer output [B, L] to [B, max_length]: pad (ids with `pad_token_id`, mask with 0;
    on the left when `left_pad`), or truncate by `truncation`: "left" keeps the last tokens, "right"
    the first, "middle" the first max_length//2 and the rest from the end; "error" raises."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation={truncation!r} is not one of {list(TRUNCATIONS)}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    length = input_ids.shape[-1]
    if length < max_length:
        input_ids = pad_sequence_to_length(input_ids, max_length, pad_token_id, left_pad=left_pad)
        attention_mask = pad_sequence_to_length(attention_mask, max_length, 0, left_pad=left_pad)
    elif length > max_length:
        if truncation == "error":
            raise NotImplementedError(
                f"the sequence has {length} tokens, more than max_length={max_length}; raise max_length or choose "
                "a truncation ('left', 'right', 'middle')"
            )
        if truncation == "left":
            keep = slice(length - max_length, length)
            return input_ids[:, keep], attention_mask[:, keep]
        if truncation == "right":
            return input_ids[:, :max_length], attention_mask[:, :max_length]
        head = max_length // 2
        tail = max_length - head

        def cut(t):
            return torch.cat([t[:, :head], t[:, length - tail :]], dim=-1)

        return cut(input_ids), cut(attention_mask)
    return input_ids, attention_mask


def tokenize_and_postprocess_data(
    prompt: str, tokenizer, max_length: int, pad_token_id: int, left_pad: bool = True, truncation: str = "error"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize `prompt` (no special tokens added) and `postprocess_data` it to [1, max_length]."""
    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    return postprocess_data(
        encoded["input_ids"], encoded["attention_mask"], max_length, pad_token_id, left_pad, truncation
    )


def remove_pad_token(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens (where `attention_mask` is 1) as a list of ints."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]


def log_probs_from_logits_response(input_ids: torch.Tensor, logits: torch.Tensor, response_length: int) -> torch.Tensor:
    """Log-probs [B, response_length] of the last `response_length` tokens of `input_ids` [B, L], from
    the logits [B, L, V] of `model(input_ids)` (the logits at position t predict token t + 1)."""
    return logprobs_from_logits(logits[:, -response_length - 1 : -1], input_ids[:, -response_length:])


def log_probs_from_logits_all_rmpad(
    input_ids_rmpad: torch.Tensor,
    logits_rmpad: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    seqlen: int,
    response_length: int,
) -> torch.Tensor:
    """Response log-probs [B, response_length] from a packed forward: `input_ids_rmpad` [1, T] and
    `logits_rmpad` [T, V] of the real tokens, `indices` [T] their places in the flattened [B*L] batch.
    The label of packed position t is token t + 1 (the last packed token's is a wrap-around, which
    lands on a position the response slice never reads)."""
    labels = torch.roll(input_ids_rmpad.reshape(-1), shifts=-1, dims=0)
    packed = logprobs_from_logits(logits_rmpad, labels)
    full = pad_input(packed.unsqueeze(-1), indices, batch_size, seqlen).squeeze(-1)
    return full[:, -response_length - 1 : -1]


def log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_rmpad: torch.Tensor, response_length: int
) -> torch.Tensor:
    """`log_probs_from_logits_all_rmpad` for a padded batch: `input_ids` / `attention_mask` [B, L] and
    the packed logits [T, V] of `model(unpad(input_ids))`."""
    batch_size, seqlen = input_ids.shape
    packed_ids, indices = unpad_input(input_ids, attention_mask)
    return log_probs_from_logits_all_rmpad(packed_ids, logits_rmpad, indices, batch_size, seqlen, response_length)


def post_process_logits(input_ids, logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):
    """Divide `logits` [..., V] by `temperature` *in place* (as upstream, to save memory), then keep the
    `top_k` largest (when > 0) and the smallest set reaching probability `top_p` (when in (0, 1)),
    setting the rest to -inf. `input_ids` is unused (upstream's signature)."""
    if temperature != 1.0:
        logits = logits.div_(temperature)
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.float(), dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    r"""Upstream's name for `sum_pi_squared_from_logits`: $\sum_v p_v^2$ per row of `logits` [..., V]."""
    return sum_pi_squared_from_logits(logits)


def _expand_padding_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: int) -> torch.Tensor:
    """[B, S] padding mask (1 = attend) -> additive [B, 1, tgt_len, S]: 0 to attend, dtype's min not."""
    blocked = (mask[:, None, None, :] == 0).expand(mask.shape[0], 1, tgt_len, mask.shape[1])
    return torch.zeros(blocked.shape, dtype=dtype, device=mask.device).masked_fill(blocked, torch.finfo(dtype).min)


def prepare_decoder_attention_mask(attention_mask, input_shape, inputs_embeds: torch.Tensor):
    """The additive 4-D attention mask [B, 1, T, T] of a causal decoder: 0 where query t may attend
    key s (s <= t and s not padding), the dtype's minimum elsewhere (twice the minimum, -inf in
    float terms, where both causal and padding block, as the two masks are summed). None when T is 1
    and there is no padding mask. dtype and device from `inputs_embeds`."""
    bsz, tgt_len = input_shape[0], input_shape[-1]
    dtype, device = inputs_embeds.dtype, inputs_embeds.device
    combined = None
    if tgt_len > 1:
        future = torch.ones(tgt_len, tgt_len, dtype=torch.bool, device=device).triu(1)
        causal = torch.zeros(tgt_len, tgt_len, dtype=dtype, device=device).masked_fill(future, torch.finfo(dtype).min)
        combined = causal[None, None].expand(bsz, 1, tgt_len, tgt_len)
    if attention_mask is not None:
        padding = _expand_padding_mask(attention_mask.to(device), dtype, tgt_len)
        combined = padding if combined is None else padding + combined
    return combined


def get_unpad_data(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(indices [T] of the real tokens in the flattened [B*L] batch, cu_seqlens [B+1] int32 with a
    leading 0, the longest row's length as an int): the varlen-attention inputs of a padded batch."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max().item())


@contextlib.contextmanager
def check_device_is_available():
    """Raise unless an accelerator is usable: a guard for code that must run after the device is
    initialised (upstream wraps SGLang imports in it)."""
    if not is_cuda_available():
        raise RuntimeError(
            f"this code needs an initialised accelerator, but the device is {get_device_name()!r} (no CUDA device "
            "visible, or trainer.device=cpu / VERL_DEVICE=cpu); run it on a GPU machine"
        )
    yield


@contextlib.contextmanager
def use_original_torch_compile():
    """Upstream's guard that undoes MindSpeed's (Ascend NPU) patch of `torch.compile` for its body;
    without MindSpeed, which this build never installs, `torch.compile` is the original and the
    body simply runs."""
    yield
