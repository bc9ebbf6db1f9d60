"""Shared-prompt forward: each distinct prompt of a micro-batch goes through the model once.

GRPO samples `rollout.n` responses per prompt, so a micro-batch holds each prompt up to n times,
and a padded forward over [prompt + response] spends most of its tokens re-encoding the same
prompts. A causal model's states at prompt positions depend on the prompt alone, so the forward
is split in two calls of the same module:

1. prompt pass: the U distinct prompts (one representative row each) with an explicit
   `DynamicCache`, keeping only the logits of the last prompt position (they predict response
   token 0);
2. response pass: the cache's keys/values are expanded to the B rows with `index_select` by the
   group index, and the response columns run on top of them with the full [prompt + response]
   attention mask and explicit position ids. Logits of response column j predict token j + 1.
   When responses are mostly padding (short answers of varying length, GRPO's common case), the
   response pass is packed instead (`packed_response_layout`): each group's responses without
   their padding run end to end in one row on the group's own prompt cache (no expansion), with
   a 4D mask in which each token sees its group's prompt and its own response's earlier tokens.

Why this is exact: the prompt pass sees exactly the prompt columns (with their mask and positions)
each row would see in the joint forward, and the response pass attends to the same keys/values,
so outputs match the single padded forward to float rounding. Why gradients are right:
`index_select` is differentiable and its backward sums the gradients of a group's rows into the
group's prompt states, which is what the repeated prompt contributes in the joint forward. The
cache is never modified in place: `DynamicLayer.update` concatenates, and the expanded cache is a
new object.

Under FSDP2 the module runs twice before one backward: every FSDP unit all-gathers (and reduce-
scatters in backward) once per call. Ranks must therefore agree on which path a micro-batch takes;
the caller decides collectively (see `DataParallelPPOActor`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl.utils.hf_forward import ModelForward, hf_model, model_forward
from verl.utils.speed_paths import SpeedPath

__all__ = [
    "PackedResponses",
    "packed_response_layout",
    "prompt_groups",
    "recomputes_layers",
    "shared_prompt_logits",
    "speed_path",
]

SPEED_PATH = "shared_prompt_forward"


def speed_path(
    requested: bool, module: torch.nn.Module, use_remove_padding: bool, attn_implementation: str | None
) -> SpeedPath:
    """Whether an actor over `module` can take the shared-prompt path, and why not.

    Off for good: a model whose forward takes no KV cache; `use_remove_padding` with an attention
    that takes no explicit 4D mask (there the path runs only in its packed layout, see
    `packed_response_layout`). Off for the update only: gradient checkpointing (HF drops the KV
    cache of checkpointed layers in training); log-prob passes still share prompts. Per
    micro-batch the path is also skipped where it does not pay (mostly distinct prompts).
    """
    if not requested:
        return SpeedPath(SPEED_PATH, requested=False, active=False)
    forward = model_forward(module)
    if forward.cache_argument is None:
        return SpeedPath(
            SPEED_PATH,
            True,
            False,
            f"{type(module).__name__}.forward takes no KV cache argument (neither `cache` nor `past_key_values`)",
        )
    if use_remove_padding and attn_implementation not in ("sdpa", "eager"):
        return SpeedPath(
            SPEED_PATH,
            True,
            False,
            f"use_remove_padding runs it only in the packed layout, whose 4D mask needs sdpa or eager attention "
            f"(the model uses {attn_implementation!r}); set use_remove_padding=false to share prompts",
        )
    hf_module = hf_model(module)
    if recomputes_layers(hf_module):
        return SpeedPath(
            SPEED_PATH,
            True,
            False,
            "gradient checkpointing drops the KV cache in training, so updates run the plain forward "
            "(log-prob passes still share prompts); set model.enable_gradient_checkpointing=false to share in updates",
        )
    return SpeedPath(SPEED_PATH, True, True)


def recomputes_layers(hf_module: torch.nn.Module) -> bool:
    """Whether `hf_module`'s layers recompute their forward in the backward (transformers' gradient
    checkpointing, or the activation offload's own, `verl.utils.activation_offload`): such layers drop a KV
    cache in training."""
    return any(
        getattr(m, "gradient_checkpointing", False) or getattr(m, "checkpoints_activations", False)
        for m in hf_module.modules()
    )


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, prompt_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first_rows [U], inverse [B]): rows of identical prompts form a group.

    Two rows share a prompt when their first `prompt_length` columns agree in real tokens,
    attention mask and position ids (token ids under padding are ignored). `first_rows[g]` is the
    first row of group g, and `inverse[i]` the group of row i.
    """
    mask = attention_mask[:, :prompt_length].long()
    key = torch.cat([input_ids[:, :prompt_length].long() * mask, mask, position_ids[:, :prompt_length].long()], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    rows = torch.arange(len(inverse), device=inverse.device)
    first_rows = torch.full((num_groups,), len(inverse), dtype=rows.dtype, device=rows.device)
    first_rows = first_rows.scatter_reduce(0, inverse, rows, reduce="amin")
    return first_rows, inverse


def shared_prompt_logits(
    module: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    first_rows: torch.Tensor,
    inverse: torch.Tensor,
    start: int,
    kept: int,
    accepts_logits_to_keep: bool,
    attn_implementation: str | None = None,
    layout: PackedResponses | None | str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, PackedResponses | None]:
    """(first, rest, layout): the logits that predict each response token.

    `first` [B, V] predicts response token 0. With `layout` None, `rest` [B, kept - 1, V] predicts
    tokens 1..kept-1 (the padded response pass); otherwise `rest` is [U, width, V] in the packed
    layout that `layout` describes (see `packed_response_layout`). `start` is the first column
    holding a token in any row and `kept` the number of response columns kept (see
    `verl.workers.dp_training.token_window`); `attn_implementation` is the model's (the packed pass
    needs "sdpa" or "eager"). `layout` "auto" picks the cheaper layout (`packed_response_layout`);
    a given layout (from `packed_response_layout` on the same batch) or None forces that one. The
    response pass always runs, on at least one position, so every call makes exactly two forward
    calls (see the module docstring on FSDP2).
    """
    from transformers import DynamicCache

    forward = model_forward(module)
    prompt_end = input_ids.shape[1] - response_length
    prompt_cols = slice(start, prompt_end)
    prompt_out = module(
        input_ids=input_ids[first_rows, prompt_cols],
        attention_mask=attention_mask[first_rows, prompt_cols],
        position_ids=position_ids[first_rows, prompt_cols],
        use_cache=True,
        **forward.cache_kwargs(DynamicCache()),
        **({"logits_to_keep": 1} if accepts_logits_to_keep else {}),
    )
    first_logits = prompt_out.logits[:, -1, :].index_select(0, inverse)
    prompt_cache = forward.returned_cache(prompt_out)
    if prompt_cache is None:
        raise RuntimeError(
            f"{type(module).__name__} returned no KV cache from the prompt pass; set "
            "actor_rollout_ref.actor.share_prompt_forward=false for this model"
        )
    # response column j's logits predict token j + 1: the last kept column needs no forward
    # (unless it is the only one: the second call must still happen, see above)
    num_cols = max(kept - 1, 1)
    if isinstance(layout, str):
        layout = packed_response_layout(
            attention_mask[:, prompt_end:],
            inverse,
            len(first_rows),
            prompt_width=prompt_end - start,
            padded_positions=len(inverse) * num_cols,
            attn_implementation=attn_implementation,
        )
    if layout is not None:
        return (
            first_logits,
            _packed_response_pass(
                module,
                input_ids,
                position_ids,
                attention_mask[first_rows, prompt_cols],
                prompt_cache,
                prompt_end,
                layout,
                additive_mask=attn_implementation == "eager",
                forward=forward,
            ),
            layout,
        )
    # a new cache over the B rows; index_select keeps autograd (backward sums over each group)
    expanded = DynamicCache(
        ddp_cache_data=[
            (keys.index_select(0, inverse), values.index_select(0, inverse)) for keys, values, *_ in prompt_cache
        ]
    )
    response_cols = slice(prompt_end, prompt_end + num_cols)
    response_out = module(
        input_ids=input_ids[:, response_cols],
        attention_mask=attention_mask[:, start : prompt_end + num_cols],
        position_ids=position_ids[:, response_cols],
        use_cache=True,
        **forward.cache_kwargs(expanded),
    )
    return first_logits, response_out.logits[:, : kept - 1, :], None


# at most this many mask elements (bool under SDPA: bytes) for the packed response pass
PACKED_MASK_BUDGET = 1 << 25


@dataclass
class PackedResponses:
    """Where the response pass of the packed layout put each response token it predicts.

    Group g's rows are laid end to end in row g of the pass (`width` slots); token k of the N
    predicted ones is response column `col[k]` (>= 1) of row `row[k]`, predicted by the logits at
    (`group[k]`, `slot[k]`); its input token is response column `col[k] - 1` of that row.
    """

    row: torch.Tensor
    col: torch.Tensor
    group: torch.Tensor
    slot: torch.Tensor
    num_groups: int
    width: int


def packed_response_layout(
    response_attention: torch.Tensor,
    inverse: torch.Tensor,
    num_groups: int,
    prompt_width: int,
    padded_positions: int | None,
    attn_implementation: str | None,
) -> PackedResponses | None:
    """The packed layout of the response pass, or None when the padded one is cheaper or needed.

    Packed: each group's responses, without their padding, end to end in one row on top of the
    group's own (unexpanded) prompt cache, with a 4D mask that lets a token see its group's prompt
    and the earlier tokens of its own response. Only tokens that predict a response token run, so
    the pass costs the responses' real lengths instead of B x the longest (GRPO on short answers:
    mostly padding), and the prompt cache is not copied to every row. Taken when it is the cheaper
    of the two (positions run, plus the cache copy of the padded pass), its mask stays under
    `PACKED_MASK_BUDGET` elements, the attention is SDPA or eager (the two that take an explicit 4D
    mask) and every response's mask is a prefix (right padding). `padded_positions` None skips the
    cost comparison (for callers comparing with another path).
    """
    if attn_implementation not in ("sdpa", "eager"):
        return None
    mask = response_attention.bool()
    lengths = mask.sum(dim=1)
    columns = torch.arange(mask.shape[1], device=mask.device)
    if not bool((mask == (columns[None, :] < lengths[:, None])).all()):
        return None
    inputs = (lengths - 1).clamp(min=0)  # the last real token predicts nothing
    totals = torch.zeros(num_groups, dtype=inputs.dtype, device=inputs.device).index_add_(0, inverse, inputs)
    width = max(int(totals.max()), 1)
    # the padded pass also copies the prompt cache to every row (and sums it back in backward):
    # counted as a quarter of a position per copied cache position (measured on the CPU example,
    # 96 rows of 3-4 response tokens in 12 groups: 360 packed positions ran 1.2x faster than 288
    # padded ones)
    if padded_positions is not None and num_groups * width > padded_positions + len(inverse) * prompt_width // 4:
        return None
    if num_groups * width * (prompt_width + width) > PACKED_MASK_BUDGET:
        return None
    order = torch.argsort(inverse, stable=True)
    counts = inputs[order]
    first_token = torch.cumsum(counts, 0) - counts  # of each row (in `order`) among all N tokens
    group_first = torch.cumsum(totals, 0) - totals  # of each group among all N tokens
    row = torch.repeat_interleave(order, counts)
    col_in = torch.arange(len(row), device=row.device) - torch.repeat_interleave(first_token, counts)
    group = inverse[row]
    slot = torch.repeat_interleave(first_token, counts) - group_first[group] + col_in
    return PackedResponses(row=row, col=col_in + 1, group=group, slot=slot, num_groups=num_groups, width=width)


def _packed_response_pass(
    module,
    input_ids,
    position_ids,
    prompt_mask,
    prompt_cache,
    prompt_end,
    layout,
    additive_mask: bool,
    forward: ModelForward,
):
    """Logits [U, width, V] of the packed response pass (see `packed_response_layout`)."""
    from transformers import DynamicCache

    num_groups, width, device = layout.num_groups, layout.width, input_ids.device
    at = (layout.group, layout.slot)
    source = (layout.row, prompt_end + layout.col - 1)
    ids = torch.zeros((num_groups, width), dtype=input_ids.dtype, device=device).index_put(at, input_ids[source])
    positions = torch.zeros((num_groups, width), dtype=position_ids.dtype, device=device)
    positions = positions.index_put(at, position_ids[source])
    # a slot sees the slots of its own row up to itself; a padding slot sees only itself
    owner = -1 - torch.arange(width, device=device).expand(num_groups, width)
    owner = owner.index_put(at, layout.row)
    col = torch.zeros((num_groups, width), dtype=layout.col.dtype, device=device).index_put(at, layout.col)
    own = (owner[:, :, None] == owner[:, None, :]) & (col[:, None, :] <= col[:, :, None])
    prompt_part = prompt_mask.bool()[:, None, :].expand(num_groups, width, prompt_mask.shape[1])
    mask = torch.cat([prompt_part, own], dim=-1)[:, None]
    if additive_mask:  # eager attention adds the mask to the scores
        mask = torch.zeros(mask.shape, device=device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    cache = DynamicCache(ddp_cache_data=[(keys, values) for keys, values, *_ in prompt_cache])
    out = module(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **forward.cache_kwargs(cache)
    )
    return out.logits
