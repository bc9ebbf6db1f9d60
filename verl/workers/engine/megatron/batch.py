"""The batch API's forward and backward (`verl.workers.engine.batch_api`) on the Megatron engine.

Design decisions:
- The micro-batches go through megatron's schedule (`verl.workers.actor.megatron_actor.run_megatron_schedule`,
  the PPO actor's and the SFT trainer's): one call with all of them, so tensor, pipeline (virtual
  stages included), context and sequence parallelism run as they do for the actor.
- Megatron's local attention takes no packed sequences: each micro-batch's jagged rows are laid
  out as a right-padded [B, L] batch whose row i holds sequence i from column 0, i.e. the actor's
  layout with a one-token prompt and the rest as the "response"; each row's position ids must
  count 0, 1, ... (the model's rotary positions are its columns), anything else is refused. The
  per-token outputs over every column of a row come back as the jagged [B, j] the batch API returns.
- Log-probs and entropy come from the tensor-parallel vocabulary shards without gathering the
  logits (`vocab_parallel_log_probs_and_entropy`), whatever `use_fused_kernels` says (the same
  values); under context parallelism they are gathered back to whole rows first, so the loss
  function sees whole sequences on every context-parallel rank.
- The caller's loss function runs on the last pipeline stage, on the micro-batch's own rows (its
  jagged tensors and settings, as the FSDP engine gives it); megatron backpropagates the loss it
  returns as it is (`calculate_per_token_loss`). The other stages return no outputs, losses or
  metrics: the last stage's first tensor/context rank reports the replica's
  (`is_mp_src_rank_with_outputs`).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl.utils import device as dev
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.batch_api import has_images

__all__ = ["forward_backward_micro_batches", "padded_rows"]


def padded_rows(micro_batch: TensorDict, index: int) -> TensorDict:
    """The jagged rows of `micro_batch` as the schedule's right-padded [B, L] batch (a one-token
    prompt, the rest "responses"), with `_micro_batch` (= `index`) and `_row` to find them again."""
    ids, positions = micro_batch["input_ids"], micro_batch["position_ids"]
    if positions.dim() != 2 or has_images(micro_batch):
        raise NotImplementedError(
            "the Megatron engine's batch API takes text batches only (M-RoPE position ids or multi_modal_inputs "
            "with images here): its models get no images, as the Megatron PPO actor's do not; run vision-language "
            "batches on the FSDP engine (strategy=fsdp)"
        )
    lengths = ids.offsets().diff().cpu()
    rows, width = len(lengths), max(int(lengths.max()), 2)
    columns = torch.arange(width).expand(rows, width)
    mask = columns < lengths[:, None]
    if not torch.equal(positions.values().cpu(), columns[mask].to(positions.dtype)):
        raise tu.TensorDictError(
            "the Megatron engine's batch API needs each sequence's position_ids to count 0, 1, 2, ... (megatron's "
            "rotary positions are the token's column; its local attention takes no packed or shifted positions); "
            "give each sequence its own positions from 0"
        )
    padded_ids = torch.zeros(rows, width, dtype=ids.dtype)
    padded_ids[mask] = ids.values().cpu()
    return TensorDict(
        {
            "input_ids": padded_ids,
            "attention_mask": mask.long(),
            "position_ids": columns.clone(),
            "responses": padded_ids[:, 1:],
            "_micro_batch": torch.full((rows,), index, dtype=torch.long),
            "_row": torch.arange(rows),
        },
        batch_size=[rows],
    )


def _per_token(engine, micro_batch: dict, output: torch.Tensor, settings: dict) -> dict[str, torch.Tensor]:
    """{name: [B, L]} over every aligned column of the last stage's `output` (whole rows under
    context parallelism): position t is the log-prob of token t + 1, or the value at token t."""
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_and_entropy

    aligned = micro_batch["_aligned"]
    if engine.value_head:
        return {"values": aligned.full(output[..., 0].float())}
    temperature = settings["temperature"]
    logits = output / temperature if temperature != 1.0 else output
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(
        logits, aligned.model_labels, engine.hf_config.vocab_size, settings["calculate_entropy"]
    )
    out = {"log_probs": aligned.full(log_probs)}
    if entropy is not None:
        out["entropy"] = aligned.full(entropy)
    return out


def _jagged(per_token: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, L] -> the jagged [B, j] of each row's first `lengths[i]` columns."""
    return tu.jagged_from_rows([row[:n] for row, n in zip(per_token, lengths.tolist())])


def forward_backward_micro_batches(engine, micro_batches: list, loss_function, forward_only: bool):
    """`EngineBatchAPI._forward_backward_micro_batches` on the Megatron `engine` (see the module docstring)."""
    from verl.workers.actor.megatron_actor import run_megatron_schedule

    group = engine.get_data_parallel_group()
    padded = [padded_rows(m, i) for i, m in enumerate(micro_batches)]
    device = dev.get_device()
    if device.type != "cpu":  # the loss function meets the model's outputs on the device
        micro_batches = [m.to(device) for m in micro_batches]
    settings = [
        {
            "temperature": float(tu.get(m, "temperature", 1.0)),
            "calculate_entropy": bool(tu.get(m, "calculate_entropy", False)),
        }
        for m in micro_batches
    ]

    def loss_fn(micro_batch: dict, output: torch.Tensor):
        index = int(micro_batch["_micro_batch"][0])
        source, rows = micro_batches[index], micro_batch["_row"].tolist()
        # megatron's interleaved schedule may halve a micro-batch: the loss gets the rows it ran
        data = source if rows == list(range(source.batch_size[0])) else tu.index_select_tensor_dict(source, rows)
        lengths = micro_batch["attention_mask"].sum(-1)
        model_output = {
            key: _jagged(value, lengths)
            for key, value in _per_token(engine, micro_batch, output, settings[index]).items()
        }
        if loss_function is None:
            loss, metrics = output.new_zeros(()), {}
        else:
            loss, metrics = loss_function(model_output=model_output, data=data, dp_group=group)
        result = {"outputs": {k: v.detach() for k, v in model_output.items()}, "metrics": metrics}
        if loss_function is not None:
            result["loss"] = float(loss.detach())
        return loss, result

    results = run_megatron_schedule(engine.chunks, padded, loss_fn, forward_only)
    outputs, losses, metrics = {}, [], {}
    for result in results:  # the last stage's, in the micro-batches' order; none elsewhere
        for key, value in result["outputs"].items():
            outputs.setdefault(key, []).extend(value.unbind())
        if "loss" in result:
            losses.append(result["loss"])
        append_to_dict(metrics, result["metrics"])
    return outputs, losses, metrics
