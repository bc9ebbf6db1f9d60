"""Save and load megatron model weights with megatron's dist_checkpointing (reshardable).

A dist checkpoint stores every tensor with its global shape and each rank's slice of it, so a
checkpoint written at one (tp, pp) layout loads at another: each rank reads exactly the slices
its new shards need. That is the point of using it rather than per-rank `torch.save` files.

Design decisions and limits:
- Only the model weights go through dist_checkpointing. The optimizer is a plain torch optimizer
  over local shards (see `verl.workers.actor.megatron_actor`); its state is per-rank and is saved
  by the worker beside the weights (resuming at the same layout).
- One model chunk per rank (no virtual pipeline): megatron keys each interleaved chunk separately,
  so a vpp checkpoint is tied to its chunk count; saving with vpp is refused with a clear error.
- On CPU this needs `verl.utils.megatron.cpu_compat` (enabled by `initialize_model_parallel`) and
  psutil, without which megatron's save hangs.
"""

from __future__ import annotations

import os

__all__ = ["save_megatron_checkpoint", "load_megatron_checkpoint"]


def _single_chunk(model_chunks, action: str):
    if len(model_chunks) != 1:
        raise NotImplementedError(
            f"cannot {action} a megatron checkpoint with {len(model_chunks)} virtual pipeline chunks; "
            "set actor.megatron.virtual_pipeline_model_parallel_size=null to checkpoint"
        )
    return model_chunks[0]


def _require_psutil():
    try:
        import psutil  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "megatron's dist_checkpointing needs psutil (without it a save hangs); pip install psutil"
        ) from e


def save_megatron_checkpoint(model_chunks, path: str) -> None:
    """Write this rank's shards of the model into the dist checkpoint directory `path` (collective)."""
    from megatron.core import dist_checkpointing

    _require_psutil()
    model = _single_chunk(model_chunks, "save")
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), path)


def load_megatron_checkpoint(model_chunks, path: str) -> None:
    """Fill this rank's shards from the dist checkpoint `path`, whatever layout wrote it (collective)."""
    from megatron.core import dist_checkpointing

    _require_psutil()
    model = _single_chunk(model_chunks, "load")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no megatron checkpoint directory at {path!r}")
    state = dist_checkpointing.load(model.sharded_state_dict(), path)
    # `_extra_state` entries (fp8 metadata of TransformerEngine layers) may legitimately be absent
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"megatron checkpoint {path!r} does not match the model: missing {missing}, "
            f"unexpected {result.unexpected_keys}; was it written for another architecture?"
        )
