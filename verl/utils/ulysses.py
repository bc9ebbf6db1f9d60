"""Ulysses sequence parallelism: the all-to-all that trades a sequence split for a head split.

Each of the `sp` ranks of a sequence-parallel group holds a slice of every sequence with all
attention heads; attention needs the whole sequence, so an all-to-all turns [.., S/sp, H, D]
into [.., S, H/sp, D] before attention and back afterwards. Its backward is the inverse
all-to-all, so gradients flow through it unchanged in value.

gloo (torch >= 2.13) implements `all_to_all_single` on CPU, so no emulation through
all-gather is needed.

Inputs and outputs (the remove-padding layout only, see `verl.utils.remove_padding`): the packed
[1, T] tokens are padded to a multiple of sp and each rank keeps one contiguous slice
(`pad_and_slice_packed`); the pad positions get ids 0, 1, ... so they form one extra sequence of
their own that no real token attends to. Per-token outputs are gathered back to [T]
(`gather_and_unpad`); every sp rank then holds the same full outputs and computes the
same loss. Its backward keeps only this rank's slice of the gradient, times `grad_scale`: summed
over the sp ranks this is the gradient of one copy of the loss, so a gradient reduction that
averages over dp x sp ranks (FSDP over the flattened mesh) needs `grad_scale=sp`.

Attention (`ulysses_attention`, installed by `patch_sdpa_attention`): transformers' decoder layers
call the function registered under the model's `attn_implementation`; we wrap "sdpa". When the
forward is called with the keyword arguments from `ulysses_forward_kwargs`, q/k/v
[B, H, S/sp, D] become [B, H/sp, S, D] by the all-to-all, attention runs over the full packed
sequence, causal within each packed sequence (boundaries from the full position ids; the mask
transformers built from the local slice is wrong for the full sequence and is ignored), and the
output goes back to [B, S/sp, H, D]. The keywords travel with the forward call (transformers
passes a model's extra keyword arguments down to the attention function), not through global
state, so a recomputation under activation checkpointing sees them too. Without them the wrapper
is the plain sdpa function.

GQA: with fewer key/value heads than sp, each key/value head is repeated (interleaved, so a query
head keeps its key/value head) until there are sp of them. Head counts that do not split evenly
are refused by `check_heads_divisible` when the model is built, naming the config key.

Limits: sdpa only (the CPU path and the GPU path without flash-attn); no sliding-window layers;
the padded (non-packed) layout is not supported, sp needs `use_remove_padding=True`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.size(scatter_dim) % world:
        raise ValueError(
            f"dimension {scatter_dim} of size {x.size(scatter_dim)} is not divisible by the "
            f"sequence-parallel size {world}; the number of attention heads must be a multiple of "
            "ulysses_sequence_parallel_size"
        )
    # Chunks along scatter_dim go to the ranks in order; received chunks are stacked in rank
    # order along gather_dim, which restores the global sequence order.
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Split `x` along `scatter_dim` across the group's ranks and concatenate what each rank
    receives along `gather_dim` (autograd-aware: the backward is the inverse all-to-all)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


# the config keys (torch-free, so the config validator can read them without importing torch)
from verl.utils.ulysses_keys import SP_KEY, reference_sp, role_sp  # noqa: E402,F401


def check_heads_divisible(config, sp_size: int) -> None:
    """Refuse a model whose attention heads cannot be split across `sp_size` ranks."""
    if sp_size <= 1:
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % sp_size or (kv_heads % sp_size and sp_size % kv_heads):
        raise ValueError(
            f"{SP_KEY}={sp_size} cannot split this model's attention heads (num_attention_heads={heads}, "
            f"num_key_value_heads={kv_heads}): Ulysses gives each sequence-parallel rank an equal share of "
            f"the heads, so num_attention_heads must be a multiple of {SP_KEY} and num_key_value_heads a "
            f"multiple or a divisor of it; choose {SP_KEY} among the common divisors, or 1"
        )


def check_attention(config, sp_size: int, key: str = SP_KEY) -> None:
    """Refuse a model whose attention the sequence-parallel forward cannot run: only the patched sdpa
    attention (`patch_sdpa_attention`) trades the sequence split for a head split. `key` names the
    setting in the error."""
    impl = getattr(config, "_attn_implementation", "sdpa")
    if sp_size > 1 and impl != "sdpa":
        raise ValueError(
            f"{key}={sp_size} supports attn_implementation='sdpa' only, the model uses {impl!r}; set {key}=1"
        )


def pad_and_slice_packed(
    input_ids: torch.Tensor, position_ids: torch.Tensor, sp_size: int, sp_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """This rank's slice of a packed batch.

    Args:
        input_ids: [1, T] packed tokens; position_ids: [1, T] global positions (restarting at 0
            for each packed sequence).

    Returns:
        (input_ids [1, T'/sp], position_ids [1, T'/sp], full padded position_ids [1, T'], pad)
        with T' = T + pad the next multiple of sp. The pad tokens are id 0 at positions 0..pad-1.
    """
    total = input_ids.size(1)
    pad = -total % sp_size
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], dim=1)
        fill = torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device)
        position_ids = torch.cat([position_ids, fill.unsqueeze(0)], dim=1)
    chunk = input_ids.size(1) // sp_size
    window = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return input_ids[:, window], position_ids[:, window], position_ids, pad


class _GatherUnpad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, pad, group, grad_scale):
        world = dist.get_world_size(group)
        ctx.dim, ctx.pad, ctx.group, ctx.grad_scale = dim, pad, group, grad_scale
        ctx.rank, ctx.local = dist.get_rank(group), x.size(dim)
        if world == 1:
            full = x
        else:
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous(), group=group)
            full = torch.cat(parts, dim=dim)
        return full.narrow(dim, 0, full.size(dim) - pad)

    @staticmethod
    def backward(ctx, grad):
        # The padded tail has no outputs downstream, hence a zero gradient there.
        if ctx.pad:
            shape = list(grad.shape)
            shape[ctx.dim] = ctx.pad
            grad = torch.cat([grad, grad.new_zeros(shape)], dim=ctx.dim)
        mine = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local)
        return mine * ctx.grad_scale, None, None, None, None


def gather_and_unpad(x: torch.Tensor, dim: int, pad: int, group=None, grad_scale: float = 1.0) -> torch.Tensor:
    """All-gather per-token outputs sliced by `pad_and_slice_packed` along `dim` and drop the
    `pad` tail: [.., T'/sp, ..] -> [.., T, ..] (autograd-aware; see the module docstring for
    `grad_scale`). `group` None: the default process group."""
    return _GatherUnpad.apply(x, dim, pad, group, grad_scale)


def ulysses_forward_kwargs(full_position_ids: torch.Tensor, group=None) -> dict:
    """Keyword arguments for the HF forward of one sp rank's slice: they switch the patched
    attention on (see `patch_sdpa_attention`). The sequence boundaries are read from the full
    position ids once here (one host sync per forward, not one per layer)."""
    starts = (full_position_ids[0] == 0).nonzero().squeeze(-1).tolist()
    if not starts or starts[0] != 0:  # a slice that begins mid-sequence still starts a segment at 0
        starts = [0, *starts]
    bounds = list(zip(starts, [*starts[1:], full_position_ids.size(1)]))
    return {"ulysses_group": group, "ulysses_bounds": bounds}


def ulysses_attention(module, query, key, value, attention_mask, *, ulysses_group, ulysses_bounds, **kwargs):
    """Attention over the full sequence with a head shard: query [B, H, S/sp, D], key/value
    [B, KV, S/sp, D] in; [B, S/sp, H, D] out (the layout HF attention functions return)."""
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{SP_KEY} > 1 does not support sliding-window attention layers")
    sp = dist.get_world_size(ulysses_group)
    kv_heads = key.size(1)
    if kv_heads < sp:
        key = key.repeat_interleave(sp // kv_heads, dim=1)
        value = value.repeat_interleave(sp // kv_heads, dim=1)
    # [B, H, S/sp, D] -> [B, H/sp, S, D]
    query, key, value = (all_to_all(t, scatter_dim=1, gather_dim=2, group=ulysses_group) for t in (query, key, value))
    if key.size(1) != query.size(1):
        key = key.repeat_interleave(query.size(1) // key.size(1), dim=1)
        value = value.repeat_interleave(query.size(1) // value.size(1), dim=1)
    # Causal attention within each packed sequence, one sdpa call per sequence: an [S, S] mask
    # over the whole packed batch would cost S^2 memory on every rank whatever sp is (measured:
    # it kept sp=2's activations at 64% of sp=1's at 4k tokens), and is_causal=True lets sdpa pick
    # its flash/efficient kernels, which save no attention matrix.
    dropout, scale = kwargs.get("dropout", 0.0), kwargs.get("scaling")
    out = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, is_causal=True, scale=scale
            )
            for s, e in ulysses_bounds
        ],
        dim=2,
    )
    # [B, H/sp, S, D] -> [B, H, S/sp, D] -> [B, S/sp, H, D]
    out = all_to_all(out, scatter_dim=2, gather_dim=1, group=ulysses_group)
    return out.transpose(1, 2).contiguous(), None


def patch_sdpa_attention() -> None:
    """Route transformers' "sdpa" attention through `ulysses_attention` when a forward carries
    `ulysses_forward_kwargs`, or (upstream's `apply_monkey_patch` convention) when the global
    sequence-parallel group has more than one rank and the layer gets `position_ids` (idempotent; the
    plain sdpa path is unchanged otherwise)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(original, "_verl_ulysses", False):
        return

    def sdpa_or_ulysses(module, query, key, value, attention_mask, **kwargs):
        group = kwargs.pop("ulysses_group", None)
        bounds = kwargs.pop("ulysses_bounds", None)
        if bounds is None and kwargs.get("position_ids") is not None:
            # upstream's `apply_monkey_patch` convention: the global group, boundaries from the gathered positions
            global_group = get_ulysses_sequence_parallel_group()
            if global_group is not None and dist.get_world_size(global_group) > 1:
                group, positions = global_group, kwargs["position_ids"]
                if positions.dim() != 2 or positions.size(0) != 1:
                    raise NotImplementedError(
                        f"Ulysses attention over the global group takes packed position ids [1, S/sp], got shape "
                        f"{tuple(positions.shape)} (multimodal rotary positions are not supported here)"
                    )
                full = all_gather_tensor(positions[0], group=group).unsqueeze(0)
                bounds = ulysses_forward_kwargs(full, group)["ulysses_bounds"]
        if bounds is None:
            return original(module, query, key, value, attention_mask, **kwargs)
        return ulysses_attention(
            module, query, key, value, attention_mask, ulysses_group=group, ulysses_bounds=bounds, **kwargs
        )

    sdpa_or_ulysses._verl_ulysses = True
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_or_ulysses


def setup(role: str, cfg: dict, model_config, use_remove_padding: bool, group, remove_padding_key=None) -> int:
    """Validate the role's Ulysses size (`role_sp`: either spelling) against the model and the group,
    install the attention patch when sp > 1, and return sp. `remove_padding_key` names the config key of
    `use_remove_padding` in errors (default `<role>.use_remove_padding`)."""
    remove_padding_key = remove_padding_key or f"{role}.use_remove_padding"
    sp, key = role_sp(cfg, role)
    if sp == 1:
        return 1
    if not use_remove_padding:
        raise ValueError(
            f"{key}={sp} needs {remove_padding_key}=True: Ulysses splits the packed "
            f"(padding-free) token sequence across ranks; set {remove_padding_key}=True or the size to 1"
        )
    if group is None or dist.get_world_size(group) != sp:
        found = None if group is None else dist.get_world_size(group)
        raise ValueError(
            f"{key}={sp} but the sequence-parallel group given has {found} ranks; the worker "
            "builds it from its dp x sp device mesh (pass ulysses_group= when building the actor/critic directly)"
        )
    if model_config is not None:
        check_heads_divisible(model_config, sp)
    check_attention(model_config, sp, key)
    patch_sdpa_attention()
    return sp


def forward_slice(module, packed_ids, packed_pos, group):
    """(the HF output for this rank's slice of the packed batch [1, T'/sp, ...], pad)."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, pos, full_pos, pad = pad_and_slice_packed(packed_ids, packed_pos, sp, rank)
    return module(input_ids=ids, position_ids=pos, use_cache=False, **ulysses_forward_kwargs(full_pos, group)), pad


def packed_forward(module, packed_ids, packed_pos, group, temperature: float, stat_fns: dict, grad_scale: float):
    """One sp rank's share of a packed causal-LM forward: (log-probs [T] of each next packed token,
    {name: fn(logits) [T]}) gathered over the group. The label of the last token of each sequence
    is the next sequence's first token, as in the sp=1 packed path (callers never read it)."""
    from verl.utils.torch_functional import logprobs_from_logits

    labels = torch.roll(packed_ids, shifts=-1, dims=1)
    local_labels = pad_and_slice_packed(labels, packed_pos, dist.get_world_size(group), dist.get_rank(group))[0][0]
    output, pad = forward_slice(module, packed_ids, packed_pos, group)
    logits = output.logits[0] / temperature
    log_probs = gather_and_unpad(logprobs_from_logits(logits, local_labels), 0, pad, group, grad_scale)
    stats = {name: gather_and_unpad(fn(logits), 0, pad, group, grad_scale) for name, fn in stat_fns.items()}
    return log_probs, stats


# ---------------------------------------------------------------------------------- upstream's API
# Upstream's module-level Ulysses functions, for actors and workers written against them (verl-recipe's
# FlowRL/GVPO/PRIME actors call `ulysses_pad_and_slice_inputs` and `gather_outputs_and_unpad` with the
# global sequence-parallel group that `set_ulysses_sequence_parallel_group` sets; the FSDP actor worker
# sets it to its own sp group when sp > 1). Same names, signatures and results as upstream's.

_ULYSSES_SEQUENCE_PARALLEL_GROUP = None


def set_ulysses_sequence_parallel_group(group) -> None:
    """Make `group` the process group the functions below use when they are given none."""
    global _ULYSSES_SEQUENCE_PARALLEL_GROUP
    _ULYSSES_SEQUENCE_PARALLEL_GROUP = group


def get_ulysses_sequence_parallel_group():
    return _ULYSSES_SEQUENCE_PARALLEL_GROUP


def get_ulysses_sequence_parallel_world_size(group=None) -> int:
    group = get_ulysses_sequence_parallel_group() if group is None else group
    return dist.get_world_size(group) if group else 1


def get_ulysses_sequence_parallel_rank(group=None) -> int:
    group = get_ulysses_sequence_parallel_group() if group is None else group
    return dist.get_rank(group) if group else 0


def validate_ulysses_config(num_heads: int, ulysses_sequence_size: int) -> None:
    if ulysses_sequence_size > 1 and num_heads % ulysses_sequence_size:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by the Ulysses sequence-parallel size ({ulysses_sequence_size})"
        )


def _pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def slice_input_tensor(x: torch.Tensor, dim: int, padding: bool = True, group=None) -> torch.Tensor:
    """This rank's contiguous 1/sp of `x` along `dim` (zero-padded first to a multiple of sp when `padding`)."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if padding and x.size(dim) % world:
        x = _pad_dim(x, dim, world - x.size(dim) % world)
    part = x.size(dim) // world
    return x.narrow(dim, rank * part, part).contiguous()


def ulysses_pad(input_ids_rmpad: torch.Tensor, position_ids_rmpad=None, sp_size: int = 1, pad_value=0):
    """`input_ids_rmpad` [1, T] (and `position_ids_rmpad` [1, T], or [C, 1, T] for mrope) padded to a multiple
    of `sp_size` with `pad_value` tokens at positions 0, 1, ...; returns (ids, position ids, pad)."""
    if position_ids_rmpad is not None and (
        position_ids_rmpad.size(-2) != 1 or position_ids_rmpad.size(-1) != input_ids_rmpad.size(-1)
    ):
        raise ValueError(
            f"ulysses_pad: position ids {tuple(position_ids_rmpad.shape)} do not match the packed ids "
            f"{tuple(input_ids_rmpad.shape)} (expected [..., 1, T])"
        )
    if sp_size <= 1:
        return input_ids_rmpad, position_ids_rmpad, 0
    pad = -input_ids_rmpad.size(1) % sp_size
    if pad:
        input_ids_rmpad = torch.nn.functional.pad(input_ids_rmpad, (0, pad), value=pad_value)
        if position_ids_rmpad is not None:
            fill = torch.arange(pad, device=position_ids_rmpad.device, dtype=position_ids_rmpad.dtype)
            fill = fill.expand(*position_ids_rmpad.shape[:-1], pad)
            position_ids_rmpad = torch.cat([position_ids_rmpad, fill], dim=-1)
    return input_ids_rmpad, position_ids_rmpad, pad


def ulysses_pad_and_slice_inputs(
    input_ids_rmpad: torch.Tensor,
    position_ids_rmpad=None,
    sp_size: int = 1,
    skip_position_ids_rmpad: bool = False,
    pad_value=0,
):
    """`ulysses_pad`, then this rank's slice (of the global sp group) of the ids and, unless
    `skip_position_ids_rmpad`, of the position ids; returns (ids, position ids, pad)."""
    input_ids_rmpad, position_ids_rmpad, pad = ulysses_pad(input_ids_rmpad, position_ids_rmpad, sp_size, pad_value)
    if sp_size <= 1:
        return input_ids_rmpad, position_ids_rmpad, pad
    input_ids_rmpad = slice_input_tensor(input_ids_rmpad, dim=1, padding=False)
    if position_ids_rmpad is not None and not skip_position_ids_rmpad:
        position_ids_rmpad = slice_input_tensor(position_ids_rmpad, dim=-1, padding=False)
    return input_ids_rmpad, position_ids_rmpad, pad


def all_to_all_tensor(local_input: torch.Tensor, scatter_dim: int, gather_dim: int, group=None, async_op=False):
    """`local_input` split along `scatter_dim` over the group's ranks, what each receives joined along
    `gather_dim` (no autograd: `SeqAllToAll` is the differentiable one). `async_op` is computed eagerly."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    out = _all_to_all(local_input.contiguous(), scatter_dim, gather_dim, group)
    return (lambda: out) if async_op else out


def all_gather_tensor(local_tensor: torch.Tensor, group=None, async_op: bool = False) -> torch.Tensor:
    """The group's tensors concatenated along dim 0, in rank order."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    parts = [torch.empty_like(local_tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local_tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class SeqAllToAll(torch.autograd.Function):
    """Upstream's differentiable all-to-all: `SeqAllToAll.apply(group, x, scatter_dim, gather_dim[, async_op])`."""

    @staticmethod
    def forward(ctx, group, local_input, scatter_dim, gather_dim, async_op=False):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(local_input.contiguous(), scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return None, _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def gather_seq_scatter_heads(x: torch.Tensor, seq_dim: int, head_dim: int, unpadded_dim_size: int = 0, group=None):
    """[.., S/sp, H, ..] -> [.., S, H/sp, ..]; the sequence cut back to `unpadded_dim_size` when given."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    if not group:
        return x
    x = SeqAllToAll.apply(group, x, head_dim, seq_dim)
    if unpadded_dim_size and unpadded_dim_size % dist.get_world_size(group):
        x = x.narrow(seq_dim, 0, unpadded_dim_size)
    return x


def gather_heads_scatter_seq(x: torch.Tensor, head_dim: int, seq_dim: int, group=None) -> torch.Tensor:
    """[.., S, H/sp, ..] -> [.., S/sp, H, ..] (the sequence zero-padded to a multiple of sp first)."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    if not group:
        return x
    world = dist.get_world_size(group)
    if x.size(seq_dim) % world:
        x = _pad_dim(x, seq_dim, world - x.size(seq_dim) % world)
    return SeqAllToAll.apply(group, x, seq_dim, head_dim, False)


class Gather(torch.autograd.Function):
    """Upstream's differentiable all-gather: `Gather.apply(group, x, gather_dim[, grad_scaler])`; the backward
    keeps this rank's slice of the gradient, times the group size when `grad_scaler`."""

    @staticmethod
    def forward(ctx, group, local_tensor, gather_dim, grad_scaler=True, async_op=False):
        world = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.local = group, gather_dim, local_tensor.size(gather_dim)
        ctx.rank, ctx.scale = dist.get_rank(group), world if grad_scaler else 1
        parts = [torch.empty_like(local_tensor) for _ in range(world)]
        dist.all_gather(parts, local_tensor.contiguous(), group=group)
        return torch.cat(parts, dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        mine = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local).contiguous()
        return None, mine * ctx.scale, None, None, None


def gather_outputs_and_unpad(
    x: torch.Tensor,
    gather_dim: int,
    unpad_dim: int | None = None,
    padding_size: int = 0,
    grad_scaler: bool = True,
    group=None,
) -> torch.Tensor:
    """Upstream's: `x` gathered over the group (default: the global sp group; none set: `x` unchanged) along
    `gather_dim`, then `padding_size` trailing entries of `unpad_dim` dropped; the backward keeps this rank's
    slice of the gradient, times the group size when `grad_scaler`."""
    group = get_ulysses_sequence_parallel_group() if group is None else group
    if group is None:
        return x
    x = Gather.apply(group, x, gather_dim, grad_scaler)
    if unpad_dim is not None:
        if not isinstance(padding_size, int):
            raise TypeError(f"gather_outputs_and_unpad: padding_size must be an int, got {padding_size!r}")
        if padding_size:
            x = x.narrow(unpad_dim, 0, x.size(unpad_dim) - padding_size)
    return x


def gather_outpus_and_unpad(*args, **kwargs):
    """Upstream's misspelt old name, refused as upstream refuses it."""
    raise RuntimeError(
        "use verl.utils.ulysses.gather_outputs_and_unpad (gather_outpus_and_unpad is its old misspelling)"
    )
