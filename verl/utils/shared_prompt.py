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

import torch

__all__ = ["prompt_groups", "shared_prompt_logits"]


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, V] predicting response token 0, logits [B, kept - 1, V] predicting tokens 1..kept-1).

    `start` is the first column holding a token in any row and `kept` the number of response
    columns kept (see `verl.workers.dp_training.token_window`). The response pass always runs,
    on at least one column, so every call makes exactly two forward calls (see the module
    docstring on FSDP2).
    """
    from transformers import DynamicCache

    prompt_end = input_ids.shape[1] - response_length
    prompt_cols = slice(start, prompt_end)
    prompt_out = module(
        input_ids=input_ids[first_rows, prompt_cols],
        attention_mask=attention_mask[first_rows, prompt_cols],
        position_ids=position_ids[first_rows, prompt_cols],
        past_key_values=DynamicCache(),
        use_cache=True,
        **({"logits_to_keep": 1} if accepts_logits_to_keep else {}),
    )
    first_logits = prompt_out.logits[:, -1, :].index_select(0, inverse)
    prompt_cache = prompt_out.past_key_values
    if prompt_cache is None:
        raise RuntimeError(
            f"{type(module).__name__} returned no KV cache from the prompt pass; set "
            "actor_rollout_ref.actor.share_prompt_forward=false for this model"
        )
    # a new cache over the B rows; index_select keeps autograd (backward sums over each group)
    expanded = DynamicCache(
        ddp_cache_data=[
            (keys.index_select(0, inverse), values.index_select(0, inverse)) for keys, values, *_ in prompt_cache
        ]
    )
    # response column j's logits predict token j + 1: the last kept column needs no forward
    # (unless it is the only one: the second call must still happen, see above)
    num_cols = max(kept - 1, 1)
    response_cols = slice(prompt_end, prompt_end + num_cols)
    response_out = module(
        input_ids=input_ids[:, response_cols],
        attention_mask=attention_mask[:, start : prompt_end + num_cols],
        position_ids=position_ids[:, response_cols],
        past_key_values=expanded,
        use_cache=True,
    )
    return first_logits, response_out.logits[:, : kept - 1, :]
