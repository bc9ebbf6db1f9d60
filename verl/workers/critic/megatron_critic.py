"""The PPO critic on a megatron-core GPTModel with a value head, free of Ray.

`MegatronPPOCritic(config, model_chunks, critic_optimizer)` is the role logic of
`verl.workers.critic.ppo_critic.PPOCritic` (config keys, batching, loss weighting and metrics:
written once, shared with the FSDP critic, its sibling) with the forward pass and the gradient
handling of the megatron actor (`verl.workers.actor.megatron_actor`): megatron's schedule per mini-batch, left-aligned
rows, gradients averaged over data-parallel ranks and clipped by the full model's norm.

The model is built with `verl.models.mcore.build_model_chunks(..., value_head=True)`: the LM head
becomes HF's token-classification `score` layer ([1, hidden] weight and bias), replicated on the
tensor-parallel ranks, so a critic converts to and from an HF `*ForTokenClassification`
checkpoint with the same functions as the actor (`score.*` names).

LoRA (`critic.model.lora.rank > 0`) needs nothing here: the engine puts the adapters on the chunks
and leaves only them and the value head trainable (`verl.models.mcore.lora.apply_lora(...,
value_head=True)`), and the optimizer it is given holds exactly those.
"""

from __future__ import annotations

from functools import partial

import torch

from verl.models.mcore.forward import response_columns
from verl.utils.flops_counter import FlopsCounter, FlopsTally
from verl.workers.actor.megatron_actor import (
    broadcast_from_last_stage,
    clip_grads_megatron,
    context_parallel_config,
    finalize_megatron_grads,
    per_rank_token_budget,
    run_megatron_schedule,
)
from verl.workers.config import McoreCriticConfig
from verl.workers.critic.ppo_critic import MODEL_INPUTS, PPOCritic
from verl.workers.dp_training import (
    append_to_dict,
    metrics_to_host,
    response_mask_of,
    split_micro_batches,
    step_if_finite,
)

__all__ = ["MegatronPPOCritic"]


class MegatronPPOCritic(PPOCritic):
    """Value function over this rank's megatron GPTModel chunks (value head on the last stage)."""

    config_class = McoreCriticConfig

    def __init__(
        self, config, model_chunks: list, critic_optimizer: torch.optim.Optimizer | None = None, hf_config=None
    ):
        """`hf_config`: the HF config the model was built from, for the update's FLOP count (None: no MFU)."""
        from megatron.core import parallel_state as mpu

        if not isinstance(model_chunks, (list, tuple)):
            model_chunks = [model_chunks]
        super().__init__(config, critic_optimizer)
        self.model_chunks = list(model_chunks)
        self._cfg = context_parallel_config(self._cfg)
        self.use_remove_padding = False
        self._dp_group, self._dp_size = mpu.get_data_parallel_group(), mpu.get_data_parallel_world_size()
        self.flops = FlopsTally(FlopsCounter.for_model(hf_config, head_outputs=1))

    @staticmethod
    def _values(micro_batch, output) -> torch.Tensor:
        """Values [B, R] at the response columns from the last stage's output [B, L, 1]."""
        return response_columns(output[..., 0], micro_batch["_aligned"])

    @torch.no_grad()
    def compute_values(self, data) -> torch.Tensor:
        """Values [B, R], zero outside the response mask, the same on every model-parallel rank."""
        for chunk in self.model_chunks:
            chunk.eval()
        meta = data.meta_info
        keys = MODEL_INPUTS + (["response_mask"] if "response_mask" in data.batch else [])
        micro_batches, reverse_idx = split_micro_batches(
            self._with_multi_modal_rows(data, data.batch.select(*keys)),
            micro_batch_size=meta.get("micro_batch_size"),
            use_dynamic_bsz=bool(meta.get("use_dynamic_bsz", False)),
            max_token_len=per_rank_token_budget(meta.get("max_token_len")),
            dp_group=self._dp_group,
        )

        def loss_fn(micro_batch, output):
            values = self._values(micro_batch, output) * response_mask_of(micro_batch)
            return output.new_zeros(()), {"values": values}

        results = broadcast_from_last_stage(run_megatron_schedule(self.model_chunks, micro_batches, loss_fn, True))
        values = torch.cat([r["values"] for r in results], dim=0)
        if reverse_idx is not None:
            values = values[reverse_idx.to(values.device)]
        return values

    def _set_train_mode(self) -> None:
        for chunk in self.model_chunks:
            chunk.train()

    def _train_and_step(self, micro_batches: list, normaliser: float, metrics: dict) -> tuple[float, bool]:
        loss_fn = partial(self._value_loss, normaliser=normaliser)
        for micro_batch in micro_batches:
            self.flops.add(micro_batch["attention_mask"], micro_batch["responses"].shape[-1])
        results = run_megatron_schedule(self.model_chunks, micro_batches, loss_fn, False)
        finalize_megatron_grads(self.model_chunks)
        grad_norm = clip_grads_megatron(self.model_chunks, self.grad_clip)
        # one wait for the device: the last stage's metrics with the gradient norm, then to every stage
        *results, step = metrics_to_host([*results, {"grad_norm": grad_norm}])
        for micro_metrics in broadcast_from_last_stage(results):
            append_to_dict(metrics, micro_metrics)
        return step["grad_norm"], step_if_finite(self.critic_optimizer, step["grad_norm"])

    def _value_loss(self, micro_batch, output, normaliser: float):
        """(scaled loss, metrics) of one micro-batch, weighted as the FSDP critic weights it."""
        return self._micro_batch_loss(micro_batch, self._values(micro_batch, output), normaliser)
