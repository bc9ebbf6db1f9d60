"""Upstream's batch-level engine interface: `train_batch`, `infer_batch` and `forward_backward_batch`
over packed (no-padding) TensorDicts with a caller's loss function.

This is the interface upstream's `TrainingWorker` (`verl.workers.engine_workers`), its engine SFT
trainer and users' own training loops program against. The role workers here keep their own
micro-batch loops (`verl.workers.actor`, `verl.workers.critic`); this mixin gives the same engines
the loss-function interface as well, written once for every backend: a backend supplies only
`_packed_forward` (one packed row of tokens -> per-token log-probs, entropy or values), or, when its
forward needs a schedule of its own (megatron's pipeline), `_forward_backward_micro_batches`.

The batch (see `verl.workers.utils.padding`):
- `input_ids`, `position_ids`: jagged tensors [B, j] of each sequence's tokens (a vision-language
  model's M-RoPE position ids: [B, C, j], ragged in the last dimension);
- `multi_modal_inputs` (vision-language models, optional): one dict per row (`pixel_values`,
  `image_grid_thw`, ...; empty for a text row), a per-row column that follows its rows into every
  micro-batch, so each forward gets exactly its rows' images, in order;
- `loss_mask`: what the loss counts (jagged like `input_ids`, or a padded [B, R] response mask);
- batch-wide settings (`tu.assign_non_tensor`): `use_dynamic_bsz` with `max_token_len_per_gpu`,
  else `micro_batch_size_per_gpu`; `temperature` (1.0), `calculate_entropy` (False),
  `use_fused_kernels` (False), optionally `global_batch_size`.

`forward_backward_batch` adds the counts the loss normalises by (`dp_size`, `batch_num_tokens`:
`loss_mask` tokens over every data-parallel rank, `global_batch_size`: rows over every rank unless
given), cuts the batch into micro-batches, runs the model on each, calls
`loss_function(model_output=..., data=micro_batch, dp_group=...) -> (loss, metrics)` and, unless
`forward_only`, backpropagates each micro-batch's loss as it is (the losses of
`verl.workers.utils.losses` are already normalised over the whole batch). It returns
`{"model_output": {name: jagged [B, j] in the input's row order}, "loss": [per micro-batch],
"metrics": {name: [per micro-batch]}}`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl.utils import device as dev
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict

__all__ = ["EngineBatchAPI", "EngineModeContext", "has_images", "multi_modal_rows"]


class EngineModeContext(contextlib.AbstractContextManager):
    """What `train_mode()` / `eval_mode()` return (upstream's engines return a context manager; code
    that calls them as statements just switches the mode). Inside the block the parameters (and, in
    training, the optimizer state) are on the device when the engine offloads them, unless
    `disable_auto_offload=True` (the caller moved them with `engine.to(...)` itself)."""

    def __init__(self, engine, training: bool, disable_auto_offload: bool = False, **_ignored):
        self._placement = contextlib.nullcontext() if disable_auto_offload else engine.on_device(optimizer=training)

    def __enter__(self):
        self._placement.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._placement.__exit__(*exc_info)


def _seqlens(data: TensorDict) -> list[int]:
    ids = data["input_ids"]
    if not ids.is_nested:
        raise tu.TensorDictError(
            "the engine's batch API takes input_ids as a jagged nested tensor (no padding); convert a left-right "
            "padded RL batch with verl.workers.utils.padding.left_right_2_no_padding"
        )
    return ids.offsets().diff().tolist()


def multi_modal_rows(micro_batch: TensorDict) -> list | None:
    """The per-row `multi_modal_inputs` dicts of a batch (None or {} for a text row), or None without
    the column (upstream's layout: a per-row column of the TensorDict, `DataProto.to_tensordict`'s
    NonTensorStack of the RL batch's `non_tensor_batch["multi_modal_inputs"]`)."""
    from tensordict import NonTensorStack

    if "multi_modal_inputs" not in set(micro_batch.keys()):
        return None
    column = micro_batch.get("multi_modal_inputs")
    rows = column.tolist() if isinstance(column, NonTensorStack) else None
    if rows is None or len(rows) != micro_batch.batch_size[0] or not all(_is_row_dict(r) for r in rows):
        raise tu.TensorDictError(
            "multi_modal_inputs must be a per-row column holding one dict per row (pixel_values, image_grid_thw, "
            f"...; empty for a text-only row), got {type(column).__name__}; DataProto.to_tensordict makes it from "
            "non_tensor_batch['multi_modal_inputs'] (tu.get_tensordict from a list of dicts too)"
        )
    return rows


def _is_row_dict(row) -> bool:
    from tensordict import NonTensorData

    return row is None or isinstance(row.data if isinstance(row, NonTensorData) else row, dict)


def has_images(micro_batch: TensorDict) -> bool:
    """Whether any row of `micro_batch` has a non-empty `multi_modal_inputs` dict."""
    return any(bool(row) for row in multi_modal_rows(micro_batch) or [])


def _count(value: torch.Tensor) -> torch.Tensor:
    return (value.values() if value.is_nested else value).sum()


class EngineBatchAPI:
    """The batch methods of upstream's `BaseEngine`, for an engine with `module`, `optimizer`,
    `lr_scheduler`, `optimizer_config` and `on_device` (see `verl.workers.engine.base.BaseEngine`)."""

    # ------------------------------------------------------------ layout
    def initialize(self) -> None:
        """Upstream builds the model here; engines here are built when constructed, so nothing is left to do."""

    def get_data_parallel_group(self):
        """The process group whose ranks hold different data (None: the default group)."""
        return None

    def get_data_parallel_size(self) -> int:
        return dist.get_world_size(self.get_data_parallel_group()) if dist.is_initialized() else 1

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.get_data_parallel_group()) if dist.is_initialized() else 0

    @classmethod
    def has_batch_forward(cls) -> bool:
        """Whether this backend implements the batch forward (`_packed_forward` or its own
        `_forward_backward_micro_batches`)."""
        return (
            cls._packed_forward is not EngineBatchAPI._packed_forward
            or cls._forward_backward_micro_batches is not EngineBatchAPI._forward_backward_micro_batches
        )

    # ------------------------------------------------------------ modes
    def train_mode(self, **kwargs) -> EngineModeContext:
        """Training mode (dropout on); as a context, the model and optimizer state on the device."""
        self._switch_mode(True)
        return EngineModeContext(self, training=True, **kwargs)

    def eval_mode(self, **kwargs) -> EngineModeContext:
        """Evaluation mode; as a context, the model on the device."""
        self._switch_mode(False)
        return EngineModeContext(self, training=False, **kwargs)

    # ------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self) -> None:
        self._require_optimizer("optimizer_zero_grad")
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Clip the gradients to the optimizer config's `clip_grad` (the full model's norm) and step,
        or skip the step when the norm is not finite; returns the norm before clipping."""
        from verl.workers.dp_training import clip_grad_norm, step_if_finite

        self._require_optimizer("optimizer_step")
        config = self.optimizer_config
        clip = config.get("clip_grad", 1.0) if hasattr(config, "get") else getattr(config, "clip_grad", 1.0)
        grad_norm = float(clip_grad_norm(self.module, clip))
        step_if_finite(self.optimizer, grad_norm)
        return grad_norm

    # ------------------------------------------------------------ batches
    def train_batch(self, data: TensorDict, loss_function) -> dict:
        """Zero the gradients, forward and backward every micro-batch, step; the metrics gain `grad_norm`."""
        self.optimizer_zero_grad()
        output = self.forward_backward_batch(data, loss_function, forward_only=False)
        grad_norm = self.optimizer_step()
        if self.is_mp_src_rank_with_outputs():
            output["metrics"]["grad_norm"] = grad_norm
        return output

    def infer_batch(self, data: TensorDict, loss_function=None) -> dict:
        """The forward passes only (no gradients); with `loss_function` its loss and metrics too."""
        with torch.no_grad():
            return self.forward_backward_batch(data, loss_function, forward_only=True)

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only: bool = False) -> dict:
        """See the module docstring."""
        from verl.utils.seqlen_balancing import rearrange_micro_batches, restore_dynamic_batch

        if loss_function is None and not forward_only:
            raise ValueError("forward_backward_batch: a loss_function is needed unless forward_only=True")
        if not forward_only:
            self._require_optimizer("train_batch")
        group = self.get_data_parallel_group()
        dp_size = self.get_data_parallel_size()
        tu.maybe_fix_3d_position_ids(data)  # M-RoPE positions sent between processes (see there)
        seqlens = _seqlens(data)
        multi_modal_rows(data)  # a malformed image column is refused before any forward
        if "loss_mask" not in set(data.keys()):
            raise tu.TensorDictError("the batch has no loss_mask: the tokens the loss counts (1) and skips (0)")
        counts = torch.tensor([float(_count(data["loss_mask"])), float(len(seqlens))], dtype=torch.float64)
        if dist.is_initialized() and dp_size > 1:
            counts = counts.to(dev.collective_device(group))
            dist.all_reduce(counts, group=group)
        tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=int(counts[0].item()))
        if tu.get(data, "global_batch_size", None) is None:
            tu.assign_non_tensor(data, global_batch_size=int(counts[1].item()))

        if tu.get(data, "use_dynamic_bsz", True):
            max_tokens = tu.get(data, "max_token_len_per_gpu", None)
            if not max_tokens:
                raise ValueError(
                    "use_dynamic_bsz is on but the batch sets no max_token_len_per_gpu; set the engine config's "
                    "max_token_len_per_gpu (infer_max_token_len_per_gpu for inference) or use_dynamic_bsz=False with "
                    "micro_batch_size_per_gpu"
                )
            micro_batches, partitions = rearrange_micro_batches(
                data, max_token_len=self._token_budget(int(max_tokens)), dp_group=group
            )
        else:
            size = tu.get(data, "micro_batch_size_per_gpu", None)
            if not size or size < 1:
                raise ValueError(
                    "use_dynamic_bsz is off but the batch sets no micro_batch_size_per_gpu; set the engine config's "
                    "micro_batch_size_per_gpu (infer_micro_batch_size_per_gpu for inference)"
                )
            partitions = [list(range(i, min(i + size, len(seqlens)))) for i in range(0, len(seqlens), size)]
            micro_batches = [tu.index_select_tensor_dict(data, p) for p in partitions]

        outputs, losses, metrics = self._forward_backward_micro_batches(micro_batches, loss_function, forward_only)
        order = [i for p in partitions for i in p]
        model_output = {}
        for key, rows in outputs.items():
            nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
            model_output[key] = restore_dynamic_batch(nested, [order]) if order != sorted(order) else nested
        return {"model_output": model_output, "loss": losses, "metrics": metrics}

    def _token_budget(self, max_tokens: int) -> int:
        """The tokens one micro-batch may hold on this rank for a `max_token_len_per_gpu` of `max_tokens`."""
        return max_tokens

    def _forward_backward_micro_batches(self, micro_batches: list, loss_function, forward_only: bool):
        """Run the micro-batches (in order) and, with `loss_function`, their losses (backpropagated
        unless `forward_only`). Returns `(outputs, losses, metrics)`: {name: [per-row tensor, in the
        micro-batches' row order]}, [loss per micro-batch], {name: [value per micro-batch]}. This
        default runs each micro-batch through `_packed_forward` and calls `loss.backward()` on it;
        a backend whose forward needs its own schedule (megatron's pipeline) overrides it."""
        group = self.get_data_parallel_group()
        outputs, losses, metrics = {}, [], {}
        device = dev.get_device()
        for micro_batch in micro_batches:
            if device.type != "cpu":  # the loss function meets the model's outputs on the device
                micro_batch = micro_batch.to(device)
            model_output = self._micro_batch_outputs(micro_batch)
            if loss_function is None:
                loss, micro_metrics = None, {}
            else:
                loss, micro_metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=group)
                if not forward_only:
                    loss.backward()
                losses.append(float(loss.detach()))
            append_to_dict(metrics, micro_metrics)
            for key, value in model_output.items():
                outputs.setdefault(key, []).extend(value.detach().unbind())
        return outputs, losses, metrics

    def _micro_batch_outputs(self, micro_batch: TensorDict) -> dict[str, torch.Tensor]:
        ids = micro_batch["input_ids"]
        positions = micro_batch["position_ids"]
        if positions.dim() not in (2, 3):
            raise tu.TensorDictError(
                f"position_ids has {positions.dim()} dims; the batch API takes jagged position ids [B, j], or a "
                "vision-language model's M-RoPE position ids [B, C, j] (left_right_2_no_padding makes either)"
            )
        images = self._micro_batch_images(micro_batch)
        device = dev.get_device()
        packed_ids = ids.values().to(device).unsqueeze(0)
        # [1, T], or M-RoPE's [C, 1, T] (the jagged [B, C, j]'s values are [C, T]), the model's packed layout
        packed_pos = positions.values().to(device)
        packed_pos = packed_pos.unsqueeze(1) if positions.dim() == 3 else packed_pos.unsqueeze(0)
        per_token = self._packed_forward(
            packed_ids,
            packed_pos,
            temperature=float(tu.get(micro_batch, "temperature", 1.0)),
            calculate_entropy=bool(tu.get(micro_batch, "calculate_entropy", False)),
            use_fused_kernels=bool(tu.get(micro_batch, "use_fused_kernels", False)),
            multi_modal_inputs=images,
        )
        offsets = ids.offsets().to(device)
        return {key: torch.nested.nested_tensor_from_jagged(value, offsets=offsets) for key, value in per_token.items()}

    def _micro_batch_images(self, micro_batch: TensorDict) -> dict[str, torch.Tensor]:
        """The model's image inputs (`pixel_values`, `image_grid_thw`, ...) for the rows of `micro_batch`, in
        its row order, from its `multi_modal_inputs` column ({} for text). This default is a backend whose
        forward passes no images: it refuses M-RoPE positions and images rather than train on the text alone."""
        if micro_batch["position_ids"].dim() == 3 or has_images(micro_batch):
            raise NotImplementedError(
                f"{type(self).__name__}'s batch forward passes no images to the model (M-RoPE position ids or "
                "multi_modal_inputs with images); run vision-language batches on the FSDP engine (strategy=fsdp)"
            )
        return {}

    def _packed_forward(
        self,
        input_ids,
        position_ids,
        temperature: float,
        calculate_entropy: bool,
        use_fused_kernels: bool,
        multi_modal_inputs: dict | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs [T] of one packed row [1, T] (position ids [1, T], or M-RoPE's [C, 1, T]) with
        the rows' images `multi_modal_inputs`: `log_probs` (and `entropy`) of an LM, where position t is the
        log-prob of token t + 1, or `values` of a value model."""
        raise NotImplementedError(f"{type(self).__name__} has no batch forward (train_batch / infer_batch)")

    # ------------------------------------------------------------ placement
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move the parameters (`model`; their gradients live with them) and optimizer state (`optimizer`)
        to `device` (the device name, "device" for it, or "cpu"), whatever the offload settings: the
        manual counterpart of `train_mode`'s placement. Backends name what moves (`_placed_state`)."""
        from verl.utils.fsdp_utils import (
            load_fsdp_model_to_device,
            load_fsdp_optimizer,
            offload_fsdp_model_to_cpu,
            offload_fsdp_optimizer,
        )

        modules, optim = self._placed_state()
        device = dev.get_device_name() if device == "device" else device
        if device not in ("cpu", dev.get_device_name()):
            raise ValueError(f"engine.to({device!r}): use 'cpu' or this machine's device ({dev.get_device_name()!r})")
        to_host = device == "cpu"
        if model:
            for module in modules:
                (offload_fsdp_model_to_cpu if to_host else load_fsdp_model_to_device)(module)
        if optimizer and optim is not None:
            (offload_fsdp_optimizer if to_host else load_fsdp_optimizer)(optim)

    def _placed_state(self) -> tuple[list, object]:
        """(the modules, the torch optimizer or None) that `to` moves."""
        raise NotImplementedError(f"{type(self).__name__} does not move its state by hand")
