"""The PPO critic on a data-parallel (FSDP2) model, free of Ray: values and value-loss updates.

`DataParallelPPOCritic(config, critic_module, critic_optimizer)` takes a value model whose
forward returns `.logits` of shape [B, L, 1] (an HF `*ForTokenClassification` with one label, see
`verl.utils.model.load_valuehead_model`). The value of response token t is read at the position
before it (the state from which token t was chosen), so values align with `responses` exactly
like log-probs do.

A vision-language value model (the generic head over Qwen2-VL's image-text base model, see
`verl.utils.model`) gets each micro-batch's images and (4, B, L) position ids as the actor's forward
does (`verl.workers.dp_training.multi_modal_kwargs`); Ulysses is refused for it.

The training loop, loss and its weighting are `verl.workers.critic.ppo_critic.PPOCritic`'s
(written once, shared with the megatron critic); this class supplies the forward (padded,
or remove-padding with optional Ulysses sequence parallelism) and the FSDP gradient step. Config
keys (the `critic` section):
ppo_mini_batch_size (per rank, normalised by the worker), ppo_micro_batch_size_per_gpu,
use_dynamic_bsz, ppo_max_token_len_per_gpu, ppo_epochs, shuffle, data_loader_seed, grad_clip (or optim.clip_grad),
cliprange_value, loss_agg_mode, ulysses_sequence_parallel_size (> 1 needs remove-padding, see `verl.utils.ulysses`), and
`model.use_remove_padding`. compute_values reads `micro_batch_size`,
`use_dynamic_bsz`, `max_token_len` from `data.meta_info`.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from verl.utils import ulysses
from verl.utils.device import get_device
from verl.utils.flops_counter import FlopsCounter, FlopsTally
from verl.utils.remove_padding import packed_model_inputs, pad_input, unpad_input, unpad_position_ids
from verl.utils.ulysses_keys import role_sp
from verl.utils.vision import is_vision_language_config
from verl.workers.config import FSDPCriticConfig
from verl.workers.critic.ppo_critic import MODEL_INPUTS, PPOCritic
from verl.workers.dp_training import (
    append_to_dict,
    clip_grad_norm,
    dp_group_and_size,
    metrics_to_host,
    model_position_ids,
    multi_modal_kwargs,
    pad_response_columns,
    refuse_vision_language_ulysses,
    response_mask_of,
    split_micro_batches,
    step_if_finite,
    token_window,
)
from verl.workers.model_memory import apply_model_memory_options

__all__ = ["DataParallelPPOCritic"]


class DataParallelPPOCritic(PPOCritic):
    """Value function over an HF token-classification model (FSDP2-sharded or plain)."""

    config_class = FSDPCriticConfig
    supports_multi_modal = True

    def __init__(
        self,
        config,
        critic_module: torch.nn.Module,
        critic_optimizer: torch.optim.Optimizer | None,
        ulysses_group=None,
    ):
        """`ulysses_group`: this rank's sequence-parallel peers when `ulysses_sequence_parallel_size` > 1."""
        super().__init__(config, critic_optimizer)
        self.critic_module = critic_module
        cfg = self._cfg
        # critic.model.tiled_mlp and enable_activation_offload (verl.workers.model_memory)
        self.activation_offload = apply_model_memory_options(
            critic_module, cfg.model, cfg.strategy, trains=critic_optimizer is not None
        )
        self.use_remove_padding = cfg.model.use_remove_padding
        self.is_vision_language = is_vision_language_config(getattr(critic_module, "config", None))
        sp_size, sp_key = role_sp(cfg, "critic")
        if self.is_vision_language:
            refuse_vision_language_ulysses(critic_module.config, sp_size, sp_key, "critic")
        self.sp_size = ulysses.setup(
            "critic",
            cfg,
            getattr(critic_module, "config", None),
            self.use_remove_padding,
            ulysses_group,
            "critic.model.use_remove_padding",
        )
        self._sp_group = ulysses_group
        self._dp_group, self._dp_size = dp_group_and_size(critic_module)
        # FSDP2 units gather and reduce per forward call: ranks must then agree on the calls they make
        self._calls_are_collective = isinstance(critic_module, FSDPModule) and self._dp_size > 1
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
                packed = ulysses.gather_and_unpad(out.logits[0, :, 0], 0, pad, self._sp_group, self.sp_size)
            else:
                inputs = packed_model_inputs(self.critic_module, packed_ids, packed_pos)
                packed = self.critic_module(**inputs, **self._multi_modal_kwargs(micro_batch), use_cache=False)
                packed = packed.logits[0, :, 0]
            values = pad_input(packed, indices, batch_size, seqlen)
            return values[:, -response_length - 1 : -1]
        # Columns that are padding in every row are left out (see `token_window`).
        start, end, kept = token_window(micro_batch["attention_mask"], response_length)
        out = self.critic_module(
            input_ids=input_ids[:, start:end],
            attention_mask=micro_batch["attention_mask"][:, start:end],
            position_ids=model_position_ids(micro_batch["position_ids"][..., start:end]),
            use_cache=False,
            **self._multi_modal_kwargs(micro_batch),
        ).logits
        return pad_response_columns(out[:, -kept - 1 : -1, 0], response_length)

    def _multi_modal_kwargs(self, micro_batch) -> dict:
        """The model's image inputs for the rows of `micro_batch` ({} for text only; `multi_modal_kwargs`)."""
        group = self._dp_group if self._calls_are_collective else False
        return multi_modal_kwargs(
            micro_batch, self._multi_modal_inputs, self.critic_module, self.is_vision_language, group
        )

    def _set_train_mode(self) -> None:
        self.critic_module.train()

    @torch.no_grad()
    def compute_values(self, data) -> torch.Tensor:
        """Values [B, R], zero outside the response mask. Micro-batching from `data.meta_info`."""
        self.critic_module.eval()
        meta = data.meta_info
        keys = MODEL_INPUTS + (["response_mask"] if "response_mask" in data.batch else [])
        batch = self._with_multi_modal_rows(data, data.batch.select(*keys))
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

    def _train_and_step(self, micro_batches: list, normaliser: float, metrics: dict) -> tuple[float, bool]:
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
        return step["grad_norm"], step_if_finite(self.critic_optimizer, step["grad_norm"])
