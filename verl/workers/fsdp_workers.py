"""The Ray-facing workers on the FSDP2 backend (`strategy=fsdp`, upstream's import path).

The RPC bodies are the role workers of `verl.workers.engine_workers`, written once on the engine
interface; this module only says what is FSDP's: the engines come from
`verl.workers.engine.fsdp` (`fsdp_config` sections), the role logic is `DataParallelPPOActor` /
`DataParallelPPOCritic` (which own the Ulysses sequence-parallel forward), every rank is a
data-parallel rank and returns its own chunk (the default `DP_COMPUTE_PROTO` dispatch), and the
reward model is a plain HF sequence classifier replicated on each rank.

LoRA (`model.lora_rank > 0` or `model.lora_adapter_path`, see `verl.utils.lora`) exists on this
backend only: the reference policy is then the actor's own engine with its adapters switched off.
The critic's (`critic.model.lora_rank > 0`) trains adapters and its value head.
"""

from __future__ import annotations

import torch

from verl.utils import device as dev
from verl.workers import engine_workers
from verl.workers.engine import BaseEngine

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker"]


class ActorRolloutRefWorker(engine_workers.ActorRolloutRefWorker):
    """Actor (FSDP2 training), rollout (generation engine) and reference policy, in any combination;
    also the rollout-only worker of a separate generation pool, whatever the actor's backend."""

    strategy = "fsdp"

    def _actor_engine_config(self):
        # a rollout-only pool serving a Megatron actor has no FSDP section: the defaults
        return self.actor_config.fsdp_config if "fsdp_config" in self.actor_config else None

    def _ref_engine_config(self):
        # a reference without its own fsdp_config takes the defaults (no offload), as upstream's
        return self.ref_config.fsdp_config

    def _make_actor(self, engine: BaseEngine, trains: bool):
        from verl.workers.actor.dp_actor import DataParallelPPOActor

        optimizer = engine.optimizer if trains else None
        return DataParallelPPOActor(
            self.actor_config,
            engine.module,
            optimizer,
            ulysses_group=self.ulysses.group,
            use_fused_kernels=engine_workers.policy_uses_fused_kernels(self.model_config, self.actor_config),
        )


class CriticWorker(engine_workers.CriticWorker):
    """The value model on FSDP2 (an LM body with a one-output token head)."""

    strategy = "fsdp"

    def _engine_config(self):
        return self.critic_config.model.fsdp_config

    def _make_critic(self, engine: BaseEngine):
        from verl.workers.critic.dp_critic import DataParallelPPOCritic

        return DataParallelPPOCritic(
            self.critic_config, engine.module, engine.optimizer, ulysses_group=self.ulysses.group
        )


class RewardModelWorker(engine_workers.RewardModelWorker):
    """The learned reward model: an HF `*ForSequenceClassification`, a full copy on each rank."""

    def _build_model(self) -> None:
        from verl.utils.model import load_sequence_classifier
        from verl.workers.engine.utils import plain_section

        model_cfg = self.config.model
        # bf16 on GPU, as upstream loads its reward model (an fp32 forward runs at a fraction of the
        # tensor cores' rate); fp32 on CPU. `model.override_config` edits its HF config before the
        # weights load, as the policy's does.
        self.model = load_sequence_classifier(
            model_cfg.path,
            torch_dtype=dev.default_compute_dtype(),
            trust_remote_code=model_cfg.trust_remote_code,
            override_config=plain_section(model_cfg.override_config),
        )
        self.model.to(dev.get_device()).eval()

    def _sequence_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One score per row [B] (float32, CPU): the classifier's output at its pooled token."""
        micro = self.config.micro_batch_size_per_gpu or len(input_ids)
        scores = []
        with torch.no_grad():
            for start in range(0, len(input_ids), micro):
                ids = input_ids[start : start + micro].to(dev.get_device())
                mask = attention_mask[start : start + micro].to(dev.get_device())
                position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
                # [rows, num_labels]: the last (with one label, the only) output; a 1-row batch keeps its row
                scores.append(logits.float().reshape(len(ids), -1)[:, -1].cpu())
        return torch.cat(scores).reshape(-1)
