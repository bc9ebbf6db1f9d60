"""Between the trainer's padded batches and the training API's packed ones (upstream's
`verl.workers.utils.padding`).

The RL batch is left-right padded: each row is [left-padded prompt | right-padded response] of
`max_seq_len` columns, `attention_mask` marking the real tokens and `response_mask` [B, R] the
response tokens (right-aligned block of the last R columns). The training API
(`verl.workers.engine_workers.TrainingWorker`, the engines' `train_batch` / `infer_batch`) takes
each sequence at its own length instead: `input_ids` and `position_ids` as jagged nested tensors
[B, j], one row per sequence with only its real tokens, and returns per-token outputs (log-probs,
entropy, values) in the same jagged layout, where position t of a row holds the value for the
row's token t + 1 (what the model predicts there).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.utils.attention_utils import pad_input, unpad_input

__all__ = ["left_right_2_no_padding", "no_padding_2_padding"]

_REQUIRED = ("input_ids", "attention_mask", "response_mask", "position_ids")


def left_right_2_no_padding(data: TensorDict) -> TensorDict:
    """Repack a left-right padded batch as jagged sequences, in place; returns `data`.

    Needs `input_ids`, `attention_mask` [B, L], `response_mask` [B, R] and `position_ids` ([B, L],
    or [B, C, L] for M-RoPE). Afterwards `input_ids` [B, j] and `position_ids` ([B, j] or
    [B, C, j]) are jagged tensors of the real tokens, `loss_mask` is the `response_mask`, and the
    batch-wide `max_seq_len` (L), `max_response_len` (R) and `indices` (the real tokens' positions
    in the flattened [B * L] batch) let `no_padding_2_padding` put per-token outputs back.
    `attention_mask` and `response_mask` stay as they are, and so does every other per-row column:
    a vision-language batch's `multi_modal_inputs` (one dict per row, `DataProto.to_tensordict`'s
    NonTensorStack), which the engines' batch API hands to each micro-batch's forward.
    """
    present = set(data.keys())
    missing = [key for key in _REQUIRED if key not in present]
    if missing:
        raise tu.TensorDictError(
            f"left_right_2_no_padding: the batch lacks {missing}; it needs the left-right padded "
            f"{', '.join(_REQUIRED)} of an RL batch"
        )
    input_ids = data.pop("input_ids")
    attention_mask = data["attention_mask"]
    position_ids = data["position_ids"]
    if input_ids.is_nested:
        raise tu.TensorDictError("left_right_2_no_padding: input_ids is already a nested (no-padding) tensor")
    tu.assign_non_tensor_data(data, "max_seq_len", input_ids.shape[1])
    tu.assign_non_tensor_data(data, "max_response_len", data["response_mask"].shape[1])
    packed, indices, cu_seqlens, *_ = unpad_input(input_ids.unsqueeze(-1), attention_mask)
    tu.assign_non_tensor_data(data, "indices", indices)
    data["input_ids"] = torch.nested.nested_tensor_from_jagged(packed.squeeze(-1), offsets=cu_seqlens.long())
    keep = attention_mask.bool()
    rows = [position_ids[i][..., keep[i]] for i in range(keep.shape[0])]
    # M-RoPE's [B, C, j] is ragged in its last dimension, whatever the rows' lengths
    data["position_ids"] = tu.jagged_from_rows(rows, ragged_idx=position_ids.dim() - 1)
    data["loss_mask"] = data["response_mask"]
    return data


def no_padding_2_padding(nested_tensor: torch.Tensor, data: TensorDict) -> torch.Tensor:
    """A jagged per-token output [B, j] of a batch made by `left_right_2_no_padding`, as the padded
    response block [B, max_response_len]: the outputs at the positions that predict the response
    tokens (each one column left of its token), zeros where the row has padding."""
    present = set(data.keys())
    for key in ("indices", "max_seq_len", "max_response_len"):
        if key not in present:
            raise tu.TensorDictError(
                f"no_padding_2_padding: the batch lacks {key!r}; pass the TensorDict that left_right_2_no_padding made"
            )
    indices = tu.get_non_tensor_data(data, "indices", None)
    max_seq_len = tu.get_non_tensor_data(data, "max_seq_len", None)
    max_response_len = tu.get_non_tensor_data(data, "max_response_len", None)
    values = nested_tensor.values() if nested_tensor.is_nested else nested_tensor
    if values.shape[0] != indices.shape[0]:
        raise tu.TensorDictError(
            f"no_padding_2_padding: {values.shape[0]} values but the batch has {indices.shape[0]} real tokens"
        )
    full = pad_input(values.unsqueeze(-1), indices.to(values.device), nested_tensor.size(0), max_seq_len).squeeze(-1)
    return full[:, -max_response_len - 1 : -1]
