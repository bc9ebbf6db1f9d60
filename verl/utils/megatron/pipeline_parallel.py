"""Micro-batch iterators for megatron's pipeline schedules (upstream's `verl.utils.megatron.pipeline_parallel`).

`get_forward_backward_func()` takes `data_iterator` as one iterator, or, with an interleaved
(virtual) pipeline, one iterator per model chunk: every chunk of this rank reads the same
micro-batches in the same order. Our own actor builds its iterators in
`verl.workers.actor.megatron_actor`; these are the helpers upstream's recipes call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["compute_transformers_input_shapes", "make_batch_generator"]


def make_batch_generator(batches: Iterable, vpp_size: int) -> Iterator | list[Iterator]:
    """One iterator over `batches` (`vpp_size` <= 1), or a list of `vpp_size` independent iterators
    over the same micro-batches, one per virtual pipeline chunk. `batches` must be re-iterable (a
    list) when `vpp_size` > 1: each chunk's iterator starts from the first micro-batch."""
    if vpp_size > 1:
        return [iter(batches) for _ in range(vpp_size)]
    return iter(batches)


def compute_transformers_input_shapes(batches: Iterable[dict], meta_info: dict) -> list[torch.Size]:
    """The [tokens, 1, hidden] activation shape each micro-batch of `batches` sends between pipeline
    stages when its padding is removed: `tokens` is the number of attended positions
    (`attention_mask` ones); with `meta_info["sequence_parallel"]` it is padded up to a multiple of
    the tensor-parallel size and split over those ranks. `meta_info["hidden_size"]` is the width."""
    from megatron.core import parallel_state as mpu

    hidden = meta_info["hidden_size"]
    shapes = []
    for batch in batches:
        tokens = int(batch["attention_mask"].bool().sum())
        if meta_info["sequence_parallel"]:
            tp = mpu.get_tensor_model_parallel_world_size()
            tokens = -(-tokens // tp) * tp // tp
        shapes.append(torch.Size([tokens, 1, hidden]))
    return shapes
