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

Upstream's names are here too: `vocab_parallel_entropy` and `vocab_parallel_log_probs_from_logits`
(over every column they are given, as upstream's: no vocabulary size to mask at), the
`..._response_rmpad` variant (packed tokens, unpadded without flash-attn), the tensor-parallel
parameter attributes megatron sets (`is_tensor_parallel_param`, partition dim and stride) and the
default `ModelParallelConfig` keyword sets for hand-built parallel layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import init

__all__ = [
    "get_common_default_kwargs_for_parallel_linear",
    "get_default_kwargs_for_column_parallel_linear",
    "get_default_kwargs_for_model_parallel_config",
    "get_default_kwargs_for_parallel_embedding",
    "get_default_kwargs_for_row_parallel_linear",
    "get_default_model_parallel_config",
    "get_tensor_parallel_partition_dim",
    "get_tensor_parallel_partition_stride",
    "is_tensor_parallel_param",
    "update_kwargs_with_config",
    "vocab_parallel_entropy",
    "vocab_parallel_log_probs_and_entropy",
    "vocab_parallel_log_probs_from_logits",
    "vocab_parallel_log_probs_from_logits_response_rmpad",
]


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


def _tp_sum(x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def vocab_parallel_entropy(vocab_parallel_logits: torch.Tensor) -> torch.Tensor:
    """Entropy [...] of the softmax over the whole vocabulary, from this rank's slice [..., V/tp]
    (every column counts: upstream's signature has no vocabulary size to mask padding at).
    Differentiable; the result has the logits' dtype."""
    from megatron.core import parallel_state as mpu

    logits = vocab_parallel_logits
    with torch.no_grad():
        shift = logits.max(dim=-1, keepdim=True).values
        if mpu.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = logits - shift
    exp = shifted.exp()
    sum_exp = _tp_sum(exp.sum(dim=-1))
    # H = log Z - E_p[z] with z the shifted logits
    return sum_exp.log() - _tp_sum((exp * shifted).sum(dim=-1)) / sum_exp


def vocab_parallel_log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) [...] from this rank's vocabulary slice `logits` [..., V/tp] (global token ids in
    `labels`), over every column; differentiable. Upstream's name for megatron's negated
    vocab-parallel cross-entropy."""
    from megatron.core import parallel_state as mpu

    full_vocab = logits.shape[-1] * mpu.get_tensor_model_parallel_world_size()
    log_probs, _ = vocab_parallel_log_probs_and_entropy(logits, labels, full_vocab)
    return log_probs.to(logits.dtype)


def vocab_parallel_log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_rmpad: torch.Tensor, response_length: int
) -> torch.Tensor:
    """The response tokens' log-probs [B, response_length] from packed logits.

    `logits_rmpad` [T, V/tp] are the logits of the batch's T attended tokens (`attention_mask`
    ones of `input_ids` [B, L], row-major), this rank's vocabulary slice. Position t predicts the
    next packed token (the last packed token's label wraps to the first: its log-prob is never a
    response token's), as upstream."""
    from verl.utils.remove_padding import pad_input, unpad_input

    batch_size, seqlen = input_ids.shape
    packed_ids, indices = unpad_input(input_ids, attention_mask)
    labels = torch.roll(packed_ids[0], shifts=-1, dims=0)
    log_probs = vocab_parallel_log_probs_from_logits(logits_rmpad, labels)
    full = pad_input(log_probs.unsqueeze(-1), indices, batch_size, seqlen).squeeze(-1)
    return full[:, -response_length - 1 : -1]


def is_tensor_parallel_param(param) -> bool:
    """Whether megatron split `param` over the tensor-parallel ranks (its `tensor_model_parallel` mark)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _require_tp(param, what: str) -> None:
    if not is_tensor_parallel_param(param):
        raise ValueError(
            f"{what}: the parameter (shape {tuple(param.shape)}) is not tensor-parallel (no tensor_model_parallel "
            "mark); check is_tensor_parallel_param first"
        )


def get_tensor_parallel_partition_dim(param) -> int:
    """The dimension megatron split the tensor-parallel `param` along (0: column-parallel, 1: row-parallel)."""
    _require_tp(param, "get_tensor_parallel_partition_dim")
    return param.partition_dim


def get_tensor_parallel_partition_stride(param) -> int:
    """The partition stride megatron recorded on the tensor-parallel `param`."""
    _require_tp(param, "get_tensor_parallel_partition_stride")
    return param.partition_stride


def update_kwargs_with_config(dictionary: dict, config) -> dict:
    """`dictionary` with its `config` entry set to the `ModelParallelConfig` `config` (in place; returned)."""
    dictionary["config"] = config
    return dictionary


def get_default_kwargs_for_model_parallel_config() -> dict:
    """Upstream's `ModelParallelConfig` keywords for hand-built layers: fp32 parameters initialised on
    the device, no gradient-accumulation fusion, no sequence parallelism."""
    return {
        "params_dtype": torch.float32,
        "use_cpu_initialization": False,
        "perform_initialization": True,
        "gradient_accumulation_fusion": False,
        "sequence_parallel": False,
    }


def get_default_model_parallel_config():
    """A `ModelParallelConfig` built from `get_default_kwargs_for_model_parallel_config()`."""
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(**get_default_kwargs_for_model_parallel_config())


def get_common_default_kwargs_for_parallel_linear() -> dict:
    """Keywords megatron's Column/RowParallelLinear share: xavier-normal init, stride 1, the default config."""
    return {
        "init_method": init.xavier_normal_,
        "stride": 1,
        "keep_master_weight_for_test": False,
        "config": get_default_model_parallel_config(),
    }


def get_default_kwargs_for_column_parallel_linear() -> dict:
    """`ColumnParallelLinear` keywords: the common ones, the config without async tensor-parallel all-reduce."""
    from megatron.core import ModelParallelConfig

    config_kwargs = dict(get_default_kwargs_for_model_parallel_config(), async_tensor_model_parallel_allreduce=False)
    return dict(get_common_default_kwargs_for_parallel_linear(), config=ModelParallelConfig(**config_kwargs))


def get_default_kwargs_for_row_parallel_linear() -> dict:
    """`RowParallelLinear` keywords: the common ones."""
    return get_common_default_kwargs_for_parallel_linear()


def get_default_kwargs_for_parallel_embedding() -> dict:
    """`VocabParallelEmbedding` keywords: xavier-normal init and the default config."""
    return {"init_method": init.xavier_normal_, "config": get_default_model_parallel_config()}
