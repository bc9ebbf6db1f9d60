"""Run a megatron GPTModel on the project's padded PPO batches.

The batch layout is left-padded prompts followed by right-padded responses, with position ids
counting from each row's first real token. Megatron's GPTModel derives rotary positions from
the column index (it ignores `position_ids` under RoPE) and its local attention cannot take
packed sequences, so each row is shifted left until its first real token sits in column 0
(`left_align`): positions then equal column indices, all padding trails the real tokens, and
the plain causal mask is exact for every real token. Nothing else is needed; the outputs are
mapped back to response columns afterwards (`response_columns`). Trailing columns that are
padding in every row are dropped, which also shortens the sequence.

Under context parallelism (`AlignedBatch.split_for_context_parallel`) the aligned length is padded
to a multiple of `2 * cp` (and of cp x tp under sequence parallelism: `run_megatron_schedule`
picks it), the model sees this rank's columns (`model_input_ids`, ...), and per-token results
are gathered back to the whole sequence (`full`) before `response_columns`.
"""

from __future__ import annotations

import torch

__all__ = ["AlignedBatch", "left_align", "response_columns"]


class AlignedBatch:
    """Rows shifted so their first real token is column 0: `input_ids` [B, L], `labels` [B, L]
    (the next token, the last column's is padding), and the index of each response token's
    predicting column, `response_index` [B, R]. `source_columns` [B, L] (the column of the padded
    batch each aligned column came from) and `real` [B, L] (not padding) carry other per-token data
    (recorded MoE routing, `verl.models.mcore.router_replay`) between the two layouts."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor, response_index: torch.Tensor):
        self.input_ids, self.labels, self.response_index = input_ids, labels, response_index
        self.source_columns: torch.Tensor | None = None
        self.real: torch.Tensor | None = None
        self.cp_group, self.cp_size, self.cp_rank = None, 1, 0

    @property
    def position_ids(self) -> torch.Tensor:
        length = self.input_ids.shape[1]
        return torch.arange(length, device=self.input_ids.device).expand_as(self.input_ids)

    def split_for_context_parallel(self, group, size: int, rank: int) -> AlignedBatch:
        """Give the model only this context-parallel rank's columns (the batch must come from
        `left_align(..., multiple_of=...)` with a multiple of `2 * size`)."""
        self.cp_group, self.cp_size, self.cp_rank = group, size, rank
        return self

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] over the whole sequence -> this context-parallel rank's columns (identity without one)."""
        from verl.models.mcore.context_parallel import split_sequence

        return split_sequence(tensor, 1, self.cp_size, self.cp_rank)

    @property
    def model_input_ids(self) -> torch.Tensor:
        """The input ids the model runs on: this rank's columns under context parallelism."""
        return self.local(self.input_ids)

    @property
    def model_position_ids(self) -> torch.Tensor:
        return self.local(self.position_ids)

    @property
    def model_labels(self) -> torch.Tensor:
        """Labels for the model's columns (`model_input_ids`)."""
        return self.local(self.labels)

    def full(self, per_token: torch.Tensor) -> torch.Tensor:
        """[B, L_model, ...] values at the model's columns -> [B, L, ...] over the whole sequence
        (gathered over the context-parallel ranks, with gradients; identity without them)."""
        if self.cp_size == 1:
            return per_token
        from verl.models.mcore.context_parallel import gather_sequence

        return gather_sequence(per_token, 1, self.cp_group)


def left_align(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    multiple_of: int = 1,
) -> AlignedBatch:
    """Shift each row of a [B, S] batch left to its first real token (see the module docstring);
    the aligned length is rounded up to a multiple of `multiple_of` with trailing padding.

    Raises when a row's real tokens are not contiguous or its position ids do not count from 0,
    since the aligned layout would then change the model's inputs.
    """
    batch_size, seqlen = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    first = mask.int().argmax(dim=1)
    length = max(int(lengths.max()), 2)
    length = -(-length // multiple_of) * multiple_of
    columns = torch.arange(length, device=input_ids.device)
    index = (first[:, None] + columns[None]).clamp(max=seqlen - 1)
    real = columns[None] < lengths[:, None]
    aligned_mask = torch.gather(mask, 1, index) & real
    aligned_pos = torch.gather(position_ids, 1, index)
    if not torch.equal(aligned_mask, real) or not torch.equal(aligned_pos[real], columns.expand_as(index)[real]):
        raise ValueError(
            "the megatron backend needs each row's real tokens to be contiguous with position ids 0, 1, ...; "
            "got a batch with holes in attention_mask or other position ids (multi-turn masks, mrope)"
        )
    aligned = torch.where(real, torch.gather(input_ids, 1, index), torch.zeros_like(index))
    labels = torch.roll(aligned, shifts=-1, dims=1)
    num_prompt = (seqlen - response_length) - first
    if bool((num_prompt < 1).any()):
        raise ValueError("every row needs at least one prompt token to predict its first response token from")
    response_index = (num_prompt - 1)[:, None] + torch.arange(response_length, device=input_ids.device)[None]
    batch = AlignedBatch(aligned, labels, response_index.clamp(max=length - 1))
    batch.source_columns, batch.real = index, real
    return batch


def response_columns(per_token: torch.Tensor, aligned: AlignedBatch) -> torch.Tensor:
    """[B, L_model] values at the model's columns -> [B, R] at response columns (padding columns hold
    whatever the model gave there; callers mask with response_mask)."""
    return torch.gather(aligned.full(per_token), 1, aligned.response_index)
