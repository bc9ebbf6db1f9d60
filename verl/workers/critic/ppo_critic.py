"""The PPO critic's role logic, written once for every training backend, free of Ray.

`PPOCritic` holds what a critic computes whatever the model's parallelism: the settings read from
the `critic` section (ppo_mini_batch_size per rank, normalised by the worker;
ppo_micro_batch_size_per_gpu, use_dynamic_bsz, ppo_max_token_len_per_gpu, ppo_epochs, shuffle,
data_loader_seed, grad_clip or optim.clip_grad, cliprange_value, loss_agg_mode), the PPO epochs
over shuffled mini-batches, the clipped value loss weighted in the mini-batch loss over all ranks
(`verl.workers.dp_training`), the guarded step and the metric names.

A backend's critic (`DataParallelPPOCritic`, `MegatronPPOCritic`) is a sibling subclass that
supplies the forward pass (`compute_values`) and `_train_and_step` (forward/backward of a
mini-batch's micro-batches, gradient synchronisation, clipping, the step).

As for the actor, the section is built into its typed class once, when the critic is (the class its
`_target_` names, else the backend's `config_class`), and read by attribute from then on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.algorithms.value_losses import compute_value_loss
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import collective_device
from verl.utils.optim import grad_clip
from verl.utils.torch_functional import masked_mean
from verl.workers.config import CriticConfig
from verl.workers.critic.base import BasePPOCritic
from verl.workers.dp_training import (
    append_to_dict,
    loss_normaliser,
    micro_batch_weight,
    response_mask_of,
    split_micro_batches,
    with_multi_modal_rows,
)

__all__ = ["MODEL_INPUTS", "PPOCritic"]

MODEL_INPUTS = ["responses", "input_ids", "attention_mask", "position_ids"]


class PPOCritic(BasePPOCritic):
    """The value function's training loop and loss; a backend subclass supplies the model's part."""

    config_class: type[CriticConfig] = CriticConfig
    """The class a section without `_target_` (a plain dict) is built into; the backend's subclass."""
    supports_multi_modal: bool = False
    """Whether the backend's forward passes a batch's `multi_modal_inputs` (images) to the model; a
    backend that cannot refuses such a batch instead of valuing its text alone."""

    def __init__(self, config, critic_optimizer: torch.optim.Optimizer | None):
        """`config`: the `critic` section (a `CriticConfig`, or a DictConfig or dict it is built from)."""
        cfg = omega_conf_to_dataclass(config, self.config_class)
        super().__init__(cfg)
        self.critic_optimizer = critic_optimizer
        self._cfg = cfg
        self.grad_clip = grad_clip(cfg, "critic")
        self.loss_agg_mode = cfg.loss_agg_mode
        self.cliprange_value = float(cfg.cliprange_value)
        self._shuffle_generator = torch.Generator().manual_seed(int(cfg.data_loader_seed or 0))
        # the data-parallel group the mini-batch's loss is normalised over; the backend sets it
        self._dp_group, self._dp_size = None, 1
        # the `multi_modal_inputs` of the batch being processed, indexed by MULTI_MODAL_ROW (None: text only)
        self._multi_modal_inputs = None

    # ------------------------------------------------------------------ the backend's part

    def _set_train_mode(self) -> None:
        """Put the model in training mode before an update."""
        raise NotImplementedError

    def compute_values(self, data) -> torch.Tensor:
        """Values [B, R], zero outside the response mask. Micro-batching from `data.meta_info`
        (`micro_batch_size`, `use_dynamic_bsz`, `max_token_len`)."""
        raise NotImplementedError

    def _train_and_step(self, micro_batches: list, normaliser: float, metrics: dict) -> tuple[float, bool]:
        """Forward and backward every micro-batch of one mini-batch (each loss from
        `_micro_batch_loss`), then synchronise, clip and step: (grad norm, whether the optimizer
        stepped). Per-micro-batch metrics go into `metrics`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the role logic, once

    def _with_multi_modal_rows(self, data, batch):
        """`batch` with `MULTI_MODAL_ROW` added when `data` carries `multi_modal_inputs` (kept for the
        forward, see `verl.workers.dp_training.with_multi_modal_rows`)."""
        batch, self._multi_modal_inputs = with_multi_modal_rows(data, batch, "critic", self.supports_multi_modal)
        return batch

    def update_critic(self, data) -> dict[str, list[float]]:
        """PPO epochs of clipped value regression towards `returns`; metric lists for the worker to reduce.

        Metrics: critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean per micro-batch;
        critic/grad_norm, critic/lr, critic/skipped_nonfinite_grad per mini-batch.
        """
        if self.critic_optimizer is None:
            raise RuntimeError("this critic was built without an optimizer; it cannot be updated")
        self._set_train_mode()
        keys = [*MODEL_INPUTS, "values", "returns"]
        present = set(data.batch.keys())
        missing = [k for k in keys if k not in present]
        if missing:
            raise KeyError(f"update_critic needs batch keys {missing}; the batch has {sorted(present)}")
        keys += ["response_mask"] if "response_mask" in present else []
        batch = self._with_multi_modal_rows(data, data.batch.select(*keys))
        mini_batch_size = int(self._cfg.ppo_mini_batch_size)
        if mini_batch_size <= 0 or len(batch) % mini_batch_size != 0:
            raise ValueError(
                f"this rank holds {len(batch)} samples, which is not a positive multiple of the per-rank "
                f"critic ppo_mini_batch_size={mini_batch_size}; make data.train_batch_size a multiple of "
                "critic.ppo_mini_batch_size"
            )
        metrics: dict[str, list[float]] = {}
        self.flops.reset()
        for _ in range(int(self._cfg.ppo_epochs)):
            epoch_batch = batch
            if self._cfg.shuffle:
                epoch_batch = batch[torch.randperm(len(batch), generator=self._shuffle_generator)]
            for mini_batch in epoch_batch.split(mini_batch_size):
                self._update_on_mini_batch(mini_batch, metrics)
        self.critic_optimizer.zero_grad()
        return metrics

    def _update_on_mini_batch(self, mini_batch, metrics: dict) -> None:
        normaliser, micro_batches = self._mini_batch_plan(mini_batch)
        self.critic_optimizer.zero_grad()
        grad_norm, stepped = self._train_and_step(micro_batches, normaliser, metrics)
        append_to_dict(metrics, self._step_metrics(grad_norm, stepped))

    def _mini_batch_plan(self, mini_batch) -> tuple[float, list]:
        """(loss normaliser over all ranks, micro-batches) of one mini-batch (on the host, like the
        reduction where the group allows it)."""
        normaliser = loss_normaliser(response_mask_of(mini_batch), self.loss_agg_mode)
        if self._dp_size > 1:
            normaliser = normaliser.to(collective_device(self._dp_group))
            dist.all_reduce(normaliser, group=self._dp_group)
        micro_batches, _ = split_micro_batches(
            mini_batch,
            micro_batch_size=self._cfg.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=self._cfg.use_dynamic_bsz,
            max_token_len=self._cfg.ppo_max_token_len_per_gpu,
            dp_group=self._dp_group,
        )
        return float(normaliser), micro_batches

    def _micro_batch_loss(self, micro_batch, vpreds, normaliser: float) -> tuple[torch.Tensor, dict]:
        """(loss to backpropagate, metrics) of one micro-batch from its predicted values [b, R]: the
        clipped value loss, scaled by the micro-batch's weight in the mini-batch loss over all ranks
        (see verl.workers.dp_training). Written once for every backend."""
        response_mask = response_mask_of(micro_batch)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            micro_batch["returns"],
            micro_batch["values"],
            response_mask,
            cliprange_value=self.cliprange_value,
            loss_agg_mode=self.loss_agg_mode,
            loss_scale_factor=self._cfg.loss_scale_factor,
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
