"""Data-parallel training plumbing shared by the PPO actor and critic (no Ray, no loss math).

Loss normalisation across micro-batches and ranks (the one subtle part). A mini-batch's loss is
defined as `agg_loss` over *all* the samples of the mini-batch on *all* data-parallel ranks, so
the gradient does not depend on how the mini-batch is cut into micro-batches (fixed size or token
budget) nor on how samples are spread over ranks. Each micro-batch's aggregated loss is
multiplied by

    scale = n_micro / n_global * dp_size

where `n` counts what the aggregation mode averages over: valid tokens for `token-mean`,
non-empty responses for `seq-mean-token-sum` / `seq-mean-token-mean`, responses for
`seq-mean-token-sum-norm` (see `verl.algorithms.aggregation.agg_loss`). `n_global` is summed
over the ranks by one collective per mini-batch, together with the other counts the ranks agree
on (`PPOActor._agree_over_ranks`), and `dp_size` undoes the averaging of gradients over ranks
(FSDP's, or `average_replica_gradients` for a module marked with `replicate_over_ranks`).
Upstream verl weights micro-batches by sample count, which makes token-mean depend on the split;
here dynamic and fixed micro-batches give the same gradients (a test checks it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from verl.algorithms.aggregation import LOSS_AGG_MODES
from verl.utils.seqlen_balancing import get_reverse_idx, rearrange_micro_batches

__all__ = [
    "MULTI_MODAL_ROW",
    "append_to_dict",
    "average_gradients",
    "average_replica_gradients",
    "clip_grad_norm",
    "config_to_dict",
    "dp_group_and_size",
    "loss_normaliser",
    "metrics_to_host",
    "micro_batch_weight",
    "model_position_ids",
    "multi_modal_kwargs",
    "replicate_over_ranks",
    "response_mask_of",
    "rows_multi_modal_kwargs",
    "split_micro_batches",
    "step_if_finite",
    "with_multi_modal_rows",
]


def config_to_dict(config) -> dict:
    """A plain dict from an OmegaConf DictConfig, a dataclass or a mapping."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:  # omegaconf is a dependency; plain dicts work without it
        pass
    if isinstance(config, Mapping):
        return {k: (config_to_dict(v) if isinstance(v, Mapping) else v) for k, v in config.items()}
    raise TypeError(f"expected a DictConfig, dataclass or dict config, got {type(config).__name__}")


def append_to_dict(metrics: dict[str, list], data: dict) -> None:
    """Append each value of `data` to the list under the same key in `metrics`."""
    for key, value in data.items():
        metrics.setdefault(key, []).append(value)


def response_mask_of(batch) -> torch.Tensor:
    """`response_mask` [B, R] when the batch has it, else the response part of `attention_mask`."""
    if "response_mask" in batch:
        return batch["response_mask"]
    return batch["attention_mask"][:, -batch["responses"].shape[-1] :]


def token_window(attention_mask: torch.Tensor, response_length: int) -> tuple[int, int, int]:
    """(start, end, kept): the columns [start, end) of a micro-batch that hold any token.

    Prompts are left-padded and responses right-padded, so a micro-batch usually begins and ends
    with columns that are padding in every row (prompts shorter than `data.max_prompt_length`,
    responses that stopped before `max_response_length`). A causal model's outputs at the other
    positions do not depend on such columns (no row attends to them; positions come from
    `position_ids`), so the forward pass skips them: on the bundled arithmetic task that is ~40%
    of the tokens. `kept` = end - (seqlen - response_length) is the number of response columns
    left (at least 1); outputs for the `response_length - kept` dropped ones are padding.
    """
    seqlen = attention_mask.shape[-1]
    occupied = attention_mask.bool().any(dim=0)
    if not bool(occupied.any()):
        return 0, seqlen, response_length
    start = int(occupied.int().argmax())
    end = seqlen - int(occupied.flip(0).int().argmax())
    response_start = seqlen - response_length
    end = max(end, response_start + 1)
    start = min(start, response_start - 1) if response_start > 0 else 0
    return start, end, end - response_start


def pad_response_columns(values: torch.Tensor, response_length: int) -> torch.Tensor:
    """Right-pad [B, kept] per-response-token outputs with zeros back to [B, response_length]."""
    missing = response_length - values.shape[-1]
    return torch.nn.functional.pad(values, (0, missing)) if missing > 0 else values


def loss_normaliser(response_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """What `agg_loss(..., loss_agg_mode)` divides by, as a float64 scalar tensor."""
    if loss_agg_mode == "token-mean":
        n = (response_mask != 0).sum()
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        n = (response_mask != 0).any(dim=-1).sum()
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        n = torch.tensor(response_mask.shape[0], device=response_mask.device)
    else:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {list(LOSS_AGG_MODES)}")
    return n.to(torch.float64)


def micro_batch_weight(
    response_mask: torch.Tensor, loss_agg_mode: str, normaliser: float, dp_size: int, loss: torch.Tensor
) -> torch.Tensor:
    """The factor of one micro-batch's aggregated loss: `n_micro / normaliser * dp_size` (see the
    module docstring), as a 0-d tensor in `loss`'s dtype and device, so that nothing waits for the
    device; 0 when the whole mini-batch has nothing to normalise by."""
    if normaliser == 0:
        return loss.new_zeros(())
    weight = loss_normaliser(response_mask, loss_agg_mode) / normaliser * dp_size
    return weight.to(device=loss.device, dtype=loss.dtype)


@dataclasses.dataclass(frozen=True)
class _Replicas:
    group: object  # the process group (None: the default group)
    size: int


_REPLICAS_ATTR = "_verl_replicas"


def replicate_over_ranks(module: torch.nn.Module, group=None) -> torch.nn.Module:
    """Mark a plain (not FSDP) `module` as one full replica per rank of `group` (default: all ranks).

    Data-parallel training without FSDP: every rank holds the whole model and trains on its own
    samples, and `clip_grad_norm` averages the gradients over the ranks with one all-reduce of
    one flat buffer before clipping (`average_replica_gradients`). For models whose whole training
    state fits every rank, this skips FSDP2's per-layer hooks, per-layer collectives and DTensor
    dispatch (see `verl.workers.engine.fsdp.transformer_impl.REPLICATE_BELOW_PARAMS`). Nothing about the module
    changes: parameter names, `state_dict()` and the optimizer are those of the plain model.
    Returns `module`.
    """
    size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    object.__setattr__(module, _REPLICAS_ATTR, _Replicas(group, size))
    return module


@torch.no_grad()
def average_replica_gradients(module: torch.nn.Module) -> None:
    """Average the gradients of a `replicate_over_ranks` module over its ranks (a no-op otherwise),
    with `average_gradients`."""
    replicas = getattr(module, _REPLICAS_ATTR, None)
    if replicas is None or replicas.size <= 1:
        return
    average_gradients([p for p in module.parameters() if p.requires_grad], replicas.group, replicas.size)


GRAD_BUCKET_BYTES = 64 << 20


def average_gradients(params, group, size: int, bucket_bytes: int = GRAD_BUCKET_BYTES) -> None:
    """Average the gradients of `params` over the `size` ranks of `group`, in place.

    One all-reduce per bucket: the gradients are packed per dtype into flat buffers of at most
    `bucket_bytes` (a larger tensor is a bucket of its own), so a model costs a few collectives
    instead of one per tensor, and never a second full copy of its gradients. A parameter without
    a gradient on this rank counts as zero (its `.grad` is then set), so ranks whose forward passes
    touched different parameters still send buffers of the same layout. Every rank must pass the
    same parameters in the same order.
    """
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in params:
        by_dtype.setdefault(param.dtype, []).append(param)
    for dtype, same_dtype in by_dtype.items():
        limit = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        bucket: list[torch.nn.Parameter] = []
        numel = 0
        for param in same_dtype:
            if bucket and numel + param.numel() > limit:
                _average_bucket(bucket, group, size)
                bucket, numel = [], 0
            bucket.append(param)
            numel += param.numel()
        _average_bucket(bucket, group, size)


def _average_bucket(params, group, size: int) -> None:
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    for param, chunk in zip(params, flat.split([p.numel() for p in params])):
        if param.grad is None:
            param.grad = chunk.view_as(param).clone()
        else:
            param.grad.copy_(chunk.view_as(param))


def dp_group_and_size(module: torch.nn.Module):
    """(process group, size) over which gradients of `module` are averaged.

    FSDP2 modules average over their whole device mesh (both dimensions under HSDP); a module
    marked with `replicate_over_ranks` over its group; any other plain module has no gradient
    sync, so each process is its own group of one.
    """
    from torch.distributed.tensor import DTensor

    replicas = getattr(module, _REPLICAS_ATTR, None)
    if replicas is not None:
        return replicas.group, replicas.size
    param = next(module.parameters(), None)
    if not isinstance(param, DTensor):
        return None, 1
    mesh = param.device_mesh
    if mesh.size() == dist.get_world_size():
        return None, mesh.size()
    return mesh.get_group(), mesh.size()


def split_micro_batches(
    batch, micro_batch_size: int | None, use_dynamic_bsz: bool, max_token_len: int | None, dp_group
):
    """Cut a TensorDict into micro-batches: fixed size, or by token budget (balanced, same count on all ranks).

    Returns (micro_batches, reverse_idx): `reverse_idx` restores the input order after
    concatenating per-micro-batch outputs (None for fixed-size splits, which keep the order).
    """
    if use_dynamic_bsz:
        if not max_token_len:
            raise ValueError(
                "use_dynamic_bsz is on but no token budget was given; set ppo_max_token_len_per_gpu "
                "(or log_prob_max_token_len_per_gpu / forward_max_token_len_per_gpu)"
            )
        micro_batches, partitions = rearrange_micro_batches(batch, max_token_len=int(max_token_len), dp_group=dp_group)
        order = [i for p in partitions for i in p]
        return micro_batches, torch.tensor(get_reverse_idx(order), dtype=torch.long)
    if not micro_batch_size or micro_batch_size <= 0:
        raise ValueError(
            f"micro batch size is {micro_batch_size!r}; set ppo_micro_batch_size_per_gpu (or "
            "log_prob_micro_batch_size_per_gpu / forward_micro_batch_size_per_gpu) to a positive number, or "
            "turn on use_dynamic_bsz"
        )
    return list(batch.split(int(micro_batch_size))), None


def clip_grad_norm(module: torch.nn.Module, grad_clip: float | None) -> torch.Tensor:
    """Clip the gradients of `module` to `grad_clip` (total norm over the full model) and return the
    norm before clipping as a 0-d tensor on the device, without waiting for it (no host sync). A
    replicated module's gradients are averaged over its ranks first. A non-finite norm leaves
    non-finite gradients: `step_if_finite` then skips the step."""
    from torch.distributed.fsdp import FSDPModule

    from verl.utils.fsdp_utils import fsdp2_clip_grad_norm_

    max_norm = float("inf") if grad_clip is None else float(grad_clip)
    average_replica_gradients(module)
    if isinstance(module, FSDPModule):
        return fsdp2_clip_grad_norm_(module.parameters(), max_norm=max_norm)
    return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=max_norm)


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: float) -> bool:
    """Step the optimizer, or, for a non-finite `grad_norm` (the same on every rank, so all ranks skip
    together), clear the gradients instead of raising. Returns whether it stepped."""
    if not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return False
    optimizer.step()
    return True


def metrics_to_host(metric_dicts: list[dict]) -> list[dict[str, float]]:
    """`metric_dicts` with every value a Python float, the tensor values fetched in one copy per device.

    Training code keeps its per-micro-batch metrics as 0-d device tensors (a `float()` on each would
    wait for the device every time: 5-7 host syncs per micro-batch) and converts them here, once per
    mini-batch, together with the gradient norm the optimizer step needs anyway.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for metrics in metric_dicts:
        for value in metrics.values():
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append(value)
    fetched: dict[int, float] = {}
    for tensors in by_device.values():
        stacked = torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors])
        fetched.update(zip((id(t) for t in tensors), stacked.tolist(), strict=True))
    return [
        {k: fetched[id(v)] if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}
        for metrics in metric_dicts
    ]


MULTI_MODAL_ROW = "multi_modal_row"
"""Batch key an actor or critic adds for a multi-modal batch: each row's index [B] into the batch's
`non_tensor_batch["multi_modal_inputs"]`. It travels with the rows through shuffling, mini- and
micro-batching (fixed or dynamic) and the zero-advantage row filter, so every micro-batch finds
the images of exactly its rows, in its row order."""


def refuse_vision_language_ulysses(hf_config, sp_size: int, sp_key: str, what: str) -> None:
    """A vision-language `what` (the actor, the critic) with Ulysses sequence parallelism: the
    sequence-parallel forward does not split image features across ranks."""
    if sp_size > 1:
        raise ValueError(
            f"{sp_key}={sp_size} with a vision-language {what} ({hf_config.model_type}): the Ulysses "
            "sequence-parallel forward does not split image features across ranks; set it to 1 "
            "(use_dynamic_bsz bounds each micro-batch's tokens instead)"
        )


def with_multi_modal_rows(data, batch, role: str, supported: bool = True):
    """(batch, multi_modal_inputs): `batch` (selected from `data.batch`) with `MULTI_MODAL_ROW` added and
    the per-row dicts (`pixel_values`, `image_grid_thw`; empty for a text-only row) when `data` carries
    `non_tensor_batch["multi_modal_inputs"]`; (`batch`, None) otherwise. A backend whose forward cannot
    pass images (`supported=False`) refuses such a batch rather than train `role` on its text alone."""
    non_tensor = getattr(data, "non_tensor_batch", None) or {}
    inputs = non_tensor.get("multi_modal_inputs")
    if inputs is None:
        return batch, None
    if not supported:
        raise ValueError(
            f"the {role} got a batch with multi_modal_inputs (images), but this backend's forward does not pass "
            "images to the model; train vision-language models with the FSDP backend (strategy=fsdp)"
        )
    if len(inputs) != len(batch):
        raise ValueError(f"multi_modal_inputs has {len(inputs)} rows, the batch {len(batch)}: they must be row-aligned")
    batch = batch.clone(recurse=False)
    batch[MULTI_MODAL_ROW] = torch.arange(len(batch))
    return batch, inputs


def multi_modal_kwargs(
    micro_batch, inputs, model: torch.nn.Module, is_vision_language: bool, collective_group=False
) -> dict:
    """The image inputs (`pixel_values`, `image_grid_thw`) of `model`'s forward for the rows of
    `micro_batch`, in its row order (their entries of `inputs`, the batch's `multi_modal_inputs`,
    found by `MULTI_MODAL_ROW`), on the micro-batch's device; {} for a text-only micro-batch. See
    `rows_multi_modal_kwargs` for the checks and `collective_group`."""
    if MULTI_MODAL_ROW not in micro_batch:
        return {}
    rows = micro_batch[MULTI_MODAL_ROW].tolist()
    return rows_multi_modal_kwargs(
        [inputs[i] for i in rows],
        micro_batch["position_ids"],
        micro_batch["input_ids"].device,
        model,
        is_vision_language,
        collective_group,
    )


def rows_multi_modal_kwargs(
    row_inputs: list,
    position_ids: torch.Tensor,
    device,
    model: torch.nn.Module,
    is_vision_language: bool,
    collective_group=False,
) -> dict:
    """The image inputs of `model`'s forward for a micro-batch whose rows' `multi_modal_inputs` are
    `row_inputs` (one dict, empty or None for a text-only row, in the micro-batch's row order):
    `extract_multi_modal_inputs` of them, on `device`; {} when no row has images. `position_ids`:
    the micro-batch's (3 dims, M-RoPE, wherever there are images).

    `collective_group` (a process group, None for the default one; False: not collective): the ranks
    of an FSDP2 model whose vision blocks are units of their own all-gather them only when their
    micro-batch has images, so ranks that disagree would wait on each other forever. They agree first
    (one all-reduce per micro-batch of a multi-modal batch) and, where some have images and others
    none, all raise the same error instead of hanging."""
    from verl.utils.model import extract_multi_modal_inputs

    found = extract_multi_modal_inputs(list(row_inputs))
    if collective_group is not False and is_vision_language:
        has = torch.tensor([float(bool(found)), -float(bool(found))], device=device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=collective_group)
        if has[0] > 0 and has[1] > -1:  # some rank has images, some has none
            raise ValueError(
                "this micro-batch has images on some data-parallel ranks and none on others; under FSDP the "
                "vision tower's collectives then cannot pair up (a text-only rank never runs it). Give every "
                "row an image (the dataset's image column), or train on one rank / plain replicas (a model "
                "small enough with fsdp_config.fsdp_size=-1)"
            )
    if found and not is_vision_language:
        raise ValueError(
            f"a batch with images (multi_modal_inputs: {sorted(found)}) reached a model "
            f"({type(model).__name__}) that has no vision tower; use a vision-language model "
            "(e.g. Qwen2.5-VL) or a dataset without images"
        )
    if found and position_ids.dim() != 3:
        raise ValueError(
            f"a batch with images has position_ids of {position_ids.dim()} dims; a vision-language model needs "
            "(batch, 4, length) (text and M-RoPE rows, verl.utils.vision.vl_position_ids), which the dataset and "
            "the rollout write"
        )
    return {key: value.to(device) for key, value in found.items()}


def model_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Batch position ids in the layout the model's forward takes: [B, L] as they are; a
    vision-language batch's [B, 4, L] (upstream's layout) as [4, B, L], Qwen2-VL's (row 0 the text
    positions its mask is built from, rows 1-3 M-RoPE's)."""
    return position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids
