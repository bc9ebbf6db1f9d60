"""What the driver sends to a rollout worker group and how it merges the answer back.

Shared by the training rollout sources and the validator, so neither imports the other nor the
trainer: `generation_input` selects the prompt-side keys of a batch and stamps the meta the
rollout reads; `with_generation` puts the rollout's output in place of the prompt-side tensors.

A vision-language row (docs/multimodal.md) travels with its images: `multi_modal_data` (the PIL
images, what vLLM takes) and `multi_modal_inputs` (the processor's `pixel_values` /
`image_grid_thw`, what the built-in engine and the training forward take) go to the rollout beside
`raw_prompt_ids`, and its `position_ids` are (B, 4, L) instead of (B, L); every column is per row,
so the driver's repeats, reorders and splits keep them aligned with the tokens.
"""

from __future__ import annotations

from verl.protocol import DataProto

GEN_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")
GEN_NON_TENSOR_KEYS = ("raw_prompt_ids", "raw_prompt", "multi_modal_data", "multi_modal_inputs")
"""The prompt-side object columns a rollout reads (those present in the batch are sent)."""


def generation_input(batch: DataProto, tokenizer, global_steps: int, multi_turn: bool, **meta) -> DataProto:
    """The rollout's input for `batch` (one row per sample to generate), with its meta_info."""
    keys = GEN_NON_TENSOR_KEYS
    if multi_turn:
        # agent loops get every column of their row, as upstream's agent-loop rollout passes them to
        # `run(**kwargs)` (data_source, reward_model, uid, ... included); the rollout returns them unchanged
        keys = tuple(batch.non_tensor_batch)
    non_tensor_keys = [k for k in keys if k in batch.non_tensor_batch]
    gen = batch.select(batch_keys=list(GEN_BATCH_KEYS), non_tensor_batch_keys=non_tensor_keys)
    # `meta` (the caller's, e.g. a recipe's `gen_batch.meta_info` with its own `global_steps` or token ids)
    # wins over the defaults, except `n`: the driver repeats each prompt itself (rows sharing a uid), so
    # the rollout draws one sample per row
    gen.meta_info.update(
        {
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "global_steps": global_steps,
            **meta,
            "n": 1,
        }
    )
    return gen


def with_generation(batch: DataProto, gen_out: DataProto) -> DataProto:
    """The prompt batch with its generation-side tensors replaced by the rollout's output."""
    batch = DataProto(
        batch=batch.batch.clone() if batch.batch is not None else None,
        non_tensor_batch=dict(batch.non_tensor_batch),
        meta_info=dict(batch.meta_info),
    )
    for key in GEN_BATCH_KEYS:
        if batch.batch is not None and key in batch.batch:
            batch.batch.pop(key)
    return batch.union(gen_out)
