"""The PPO critic on a data-parallel (FSDP2) model, free of Ray: values and value-loss updates.

`DataParallelPPOCritic(config, critic_module, critic_optimizer)` takes a value model whose
forward returns `.logits` of shape [B, L, 1] (an HF `*ForTokenClassification` with one label, see
`verl.utils.model.load_valuehead_model`). The value of response token t is read at the position
before it (the state from which token t was chosen), so values align with `responses` exactly
like log-probs do.

Batching, micro-batch loss weighting, remove-padding and gradient clipping work as in the actor
(`verl.workers.actor.dp_actor`, `verl.workers.dp_training`). Config keys (the `critic` section):
ppo_mini_batch_size (per rank, normalised by the worker), ppo_micro_batch_size_per_gpu,
use_dynamic_bsz, ppo_max_token_len_per_gpu, ppo_epochs, shuffle, data_loader_seed, grad_clip (or optim.clip_grad),
cliprange_value, loss_agg_mode, ulysses_sequence_parallel_size (> 1 needs remove-padding, see `verl.utils.ulysses`), and
`model.use_remove_padding` (or `use_remove_padding`). compute_values reads `micro_batch_size`,
`use_dynamic_bsz`, `max_token_len` from `data.meta_info`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.algorithms.value_losses import compute_value_loss
from verl.utils import ulysses
from verl.utils.device import collective_device, get_device
from verl.utils.flops_counter import FlopsCounter, FlopsTally
from verl.utils.optim import grad_clip
from verl.utils.remove_padding import pad_input, unpad_input, unpad_position_ids
from verl.utils.torch_functional import masked_mean
from verl.workers.critic.base import BasePPOCritic
from verl.workers.dp_training import (
    append_to_dict,
    clip_grad_norm,
    config_to_dict,
    dp_group_and_size,
    loss_normaliser,
    metrics_to_host,
    micro_batch_weight,
    pad_response_columns,
    response_mask_of,
    split_micro_batches,
    step_if_finite,
    token_window,
)

__all__ = ["DataParallelPPOCritic"]

_MODEL_INPUTS = ["responses", "input_ids", "attention_mask", "position_ids"]


class DataParallelPPOCritic(BasePPOCritic):
    """Value function over an HF token-classification model (FSDP2-sharded or plain)."""

    def __init__(
        self,
        config,
        critic_module: torch.nn.Module,
        critic_optimizer: torch.optim.Optimizer | None,
        ulysses_group=None,
    ):
        """`ulysses_group`: this rank's sequence-parallel peers when `ulysses_sequence_parallel_size` > 1."""
        super().__init__(config)
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        cfg = config_to_dict(config)
        self._cfg = cfg
        self.grad_clip = grad_clip(cfg, "critic")
        model_cfg = cfg.get("model") or {}
        self.use_remove_padding = bool(model_cfg.get("use_remove_padding", cfg.get("use_remove_padding", False)))
        self.sp_size = ulysses.setup(
            "critic",
            cfg,
            getattr(critic_module, "config", None),
            self.use_remove_padding,
            ulysses_group,
            "critic.model.use_remove_padding",
        )
        self._sp_group = ulysses_group
        self.loss_agg_mode = cfg.get("loss_agg_mode", "token-mean")
        self.cliprange_value = float(cfg.get("cliprange_value", 0.5))
        self._shuffle_generator = torch.Generator().manual_seed(int(cfg.get("data_loader_seed", 0) or 0))
        self._dp_group, self._dp_size = dp_group_and_size(critic_module)
        # a value model's head has one output, not the vocabulary
        self.flops = FlopsTally(FlopsCounter.for_model(getattr(critic_module, "config", None), head_outputs=1))

    def _forward_micro_batch(self, micro_batch) -> torch.Tensor:
        """Values [B, R] for the responses of `micro_batch` (padding positions not masked)."""
        input_ids = micro_batch["input_ids"]
        batch_size, seqlen = input_ids.shape
        response_length = micro_batch["responses"].shape[-1]
        if self.use_remove_padding:
            packed_ids, indices = unpad_input(input_ids, micro_batch["attention_mask"])
            packed_pos = unpad_position_ids(micro_batch["position_ids"], indices)
            if self.sp_size > 1:  # gradients scaled by sp for FSDP's average over dp x sp ranks
                out, pad = ulysses.forward_slice(self.critic_module, packed_ids, packed_pos, self._sp_group)
                packed = ulysses.gather_outputs_and_unpad(out.logits[0, :, 0], 0, pad, self._sp_group, self.sp_size)
            else:
                packed = self.critic_module(input_ids=packed_ids, position_ids=packed_pos, use_cache=False).logits[
                    0, :, 0
                ]
            values = pad_input(packed, indices, batch_size, seqlen)
            return values[:, -response_length - 1 : -1]
        # Columns that are padding in every row are left out (see `token_window`).
        start, end, kept = token_window(micro_batch["attention_mask"], response_length)
        out = self.critic_module(
            input_ids=input_ids[:, start:end],
            attention_mask=micro_batch["attention_mask"][:, start:end],
            position_ids=micro_batch["position_ids"][:, start:end],
            use_cache=False,
        ).logits
        return pad_response_columns(out[:, -kept - 1 : -1, 0], response_length)

    @torch.no_grad()
    def compute_values(self, data) -> torch.Tensor:
        """Values [B, R], zero outside the response mask. Micro-batching from `data.meta_info`."""
        self.critic_module.eval()
        meta = data.meta_info
        keys = _MODEL_INPUTS + (["response_mask"] if "response_mask" in data.batch else [])
        batch = data.batch.select(*keys)
        micro_batches, reverse_idx = split_micro_batches(
            batch,
            micro_batch_size=meta.get("micro_batch_size"),
            use_dynamic_bsz=bool(meta.get("use_dynamic_bsz", False)),
            max_token_len=meta.get("max_token_len"),
            dp_group=self._dp_group,
        )
        values = []
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(get_device())
            values.append(self._forward_micro_batch(micro_batch) * response_mask_of(micro_batch))
        values = torch.cat(values, dim=0)
        if reverse_idx is not None:
            values = values[reverse_idx.to(values.device)]
        return values

    def update_critic(self, data) -> dict[str, list[float]]:
        """PPO epochs of clipped value regression towards `returns`; metric lists for the worker to reduce.

        Metrics: critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean per micro-batch;
        critic/grad_norm, critic/lr, critic/skipped_nonfinite_grad per mini-batch.
        """
        if self.critic_optimizer is None:
            raise RuntimeError("this critic was built without an optimizer; it cannot be updated")
        self.critic_module.train()
        keys = [*_MODEL_INPUTS, "values", "returns"]
        present = set(data.batch.keys())
        missing = [k for k in keys if k not in present]
        if missing:
            raise KeyError(f"update_critic needs batch keys {missing}; the batch has {sorted(present)}")
        keys += ["response_mask"] if "response_mask" in present else []
        batch = data.batch.select(*keys)
        mini_batch_size = int(self._cfg.get("ppo_mini_batch_size") or 0)
        if mini_batch_size <= 0 or len(batch) % mini_batch_size != 0:
            raise ValueError(
                f"this rank holds {len(batch)} samples, which is not a positive multiple of the per-rank "
                f"critic ppo_mini_batch_size={mini_batch_size}; make data.train_batch_size a multiple of "
                "critic.ppo_mini_batch_size"
            )
        metrics: dict[str, list[float]] = {}
        self.flops.reset()
        for _ in range(int(self._cfg.get("ppo_epochs", 1) or 1)):
            epoch_batch = batch
            if self._cfg.get("shuffle", False):
                epoch_batch = batch[torch.randperm(len(batch), generator=self._shuffle_generator)]
            for mini_batch in epoch_batch.split(mini_batch_size):
                self._update_on_mini_batch(mini_batch, metrics)
        self.critic_optimizer.zero_grad()
        return metrics

    def _update_on_mini_batch(self, mini_batch, metrics: dict) -> None:
        normaliser, micro_batches = self._mini_batch_plan(mini_batch)
        self.critic_optimizer.zero_grad()
        micro_metrics = []
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(get_device())
            self.flops.add(micro_batch["attention_mask"], micro_batch["responses"].shape[-1])
            loss, out = self._micro_batch_loss(micro_batch, self._forward_micro_batch(micro_batch), normaliser)
            loss.backward()
            micro_metrics.append(out)
        grad_norm = clip_grad_norm(self.critic_module, self.grad_clip)
        # one wait for the device per mini-batch: the metrics come to the host with the gradient norm
        *micro_metrics, step = metrics_to_host([*micro_metrics, {"grad_norm": grad_norm}])
        for out in micro_metrics:
            append_to_dict(metrics, out)
        stepped = step_if_finite(self.critic_optimizer, step["grad_norm"])
        append_to_dict(metrics, self._step_metrics(step["grad_norm"], stepped))

    def _mini_batch_plan(self, mini_batch) -> tuple[float, list]:
        """(loss normaliser over all ranks, micro-batches) of one mini-batch (on the host, like the
        reduction where the group allows it)."""
        normaliser = loss_normaliser(response_mask_of(mini_batch), self.loss_agg_mode)
        if self._dp_size > 1:
            normaliser = normaliser.to(collective_device(self._dp_group))
            dist.all_reduce(normaliser, group=self._dp_group)
        micro_batches, _ = split_micro_batches(
            mini_batch,
            micro_batch_size=self._cfg.get("ppo_micro_batch_size_per_gpu"),
            use_dynamic_bsz=bool(self._cfg.get("use_dynamic_bsz", False)),
            max_token_len=self._cfg.get("ppo_max_token_len_per_gpu"),
            dp_group=self._dp_group,
        )
        return float(normaliser), micro_batches

    def _micro_batch_loss(self, micro_batch, vpreds, normaliser: float) -> tuple[torch.Tensor, dict]:
        """(loss to backpropagate, metrics) of one micro-batch from its predicted values [b, R]: the
        clipped value loss, scaled by the micro-batch's weight in the mini-batch loss over all ranks
        (see verl.workers.dp_training). Shared by every backend's critic."""
        response_mask = response_mask_of(micro_batch)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            micro_batch["returns"],
            micro_batch["values"],
            response_mask,
            cliprange_value=self.cliprange_value,
            loss_agg_mode=self.loss_agg_mode,
        )
        out = {  # device tensors: read once per mini-batch (`metrics_to_host`)
            "critic/vf_loss": vf_loss.detach(),
            "critic/vf_clipfrac": vf_clipfrac.detach() if isinstance(vf_clipfrac, torch.Tensor) else vf_clipfrac,
            "critic/vpred_mean": masked_mean(vpreds.detach(), response_mask),
        }
        return vf_loss * micro_batch_weight(response_mask, self.loss_agg_mode, normaliser, self._dp_size, vf_loss), out

    def _step_metrics(self, grad_norm: float, stepped: bool) -> dict[str, float]:
        return {
            "critic/grad_norm": grad_norm,
            "critic/lr": float(self.critic_optimizer.param_groups[0]["lr"]),
            "critic/skipped_nonfinite_grad": 0.0 if stepped else 1.0,
        }
