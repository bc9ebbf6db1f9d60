"""The Ray-facing workers on the FSDP2 backend (`strategy=fsdp`, upstream's import path).

The RPC bodies are the role workers of `verl.workers.engine_workers`, written once on the engine
interface; this module only says what is FSDP's: the engines come from
`verl.workers.engine.fsdp` (`fsdp_config` sections), the role logic is `DataParallelPPOActor` /
`DataParallelPPOCritic` (which own the Ulysses sequence-parallel forward), every rank is a
data-parallel rank and returns its own chunk (the default `DP_COMPUTE_PROTO` dispatch), and the
reward model is a plain HF sequence classifier replicated on each rank (padded, packed, or packed and
split by Ulysses).

LoRA (`model.lora_rank > 0` or `model.lora_adapter_path`, see `verl.utils.lora`) exists on this
backend only: the reference policy is then the actor's own engine with its adapters switched off.
The critic's (`critic.model.lora_rank > 0`) trains adapters and its value head.
"""

from __future__ import annotations

import dataclasses

import torch

from verl.utils import device as dev
from verl.utils.fsdp_utils import create_device_mesh
from verl.workers import engine_workers, reward_model_worker
from verl.workers.engine import BaseEngine

__all__ = [
    "ActorRolloutRefWorker",
    "CriticWorker",
    "RewardModelWorker",
    "create_device_mesh",
    "get_sharding_strategy",
    "get_vl_model_vision_tower",
]


# ---------------------------------------------------------- upstream's module-level helpers
# verl-recipe's workers that wrap their models themselves (PRIME, FlowRL, rep_exp) import these.
def get_sharding_strategy(device_mesh, zero3_enable: bool = True):
    """FSDP1's sharding strategy for `device_mesh`: a 1-D mesh shards over all its ranks
    (FULL_SHARD, or SHARD_GRAD_OP without `zero3_enable`), a 2-D ('ddp', 'fsdp') mesh shards within
    each group and replicates across them (HYBRID_SHARD, or _HYBRID_SHARD_ZERO2)."""
    from torch.distributed.fsdp import ShardingStrategy

    strategies = {
        1: ShardingStrategy.FULL_SHARD if zero3_enable else ShardingStrategy.SHARD_GRAD_OP,
        2: ShardingStrategy.HYBRID_SHARD if zero3_enable else ShardingStrategy._HYBRID_SHARD_ZERO2,
    }
    if device_mesh.ndim not in strategies:
        raise NotImplementedError(
            f"Get device mesh ndim={device_mesh.ndim}, but only support 1 or 2 (a 1-D 'fsdp' mesh or a 2-D "
            "('ddp', 'fsdp') mesh from create_device_mesh)"
        )
    return strategies[device_mesh.ndim]


def get_vl_model_vision_tower(vl_model_instance):
    """The vision tower of a vision-language model: `model.visual` (transformers >= 4.52 layout),
    else `visual` (older), else None."""
    inner = getattr(vl_model_instance, "model", None)
    if inner is not None and hasattr(inner, "visual"):
        return inner.visual
    return getattr(vl_model_instance, "visual", None)


def _role_engine_section(section):
    """A role's `fsdp_config` for its engine: the role's actor or critic splits sequences itself
    (`verl.workers.ulysses_rows`, sp read from the role's keys), so the engine's own split is off."""
    from verl.workers.engine.fsdp.transformer_impl import without_engine_ulysses

    return without_engine_ulysses(section)


class ActorRolloutRefWorker(engine_workers.ActorRolloutRefWorker):
    """Actor (FSDP2 training), rollout (generation engine) and reference policy, in any combination;
    also the rollout-only worker of a separate generation pool, whatever the actor's backend."""

    strategy = "fsdp"

    def _actor_engine_config(self):
        # a rollout-only pool serving a Megatron actor has no FSDP section: the defaults
        return _role_engine_section(self.actor_config.fsdp_config if "fsdp_config" in self.actor_config else None)

    def _ref_engine_config(self):
        # a reference without its own fsdp_config takes the defaults (no offload), as upstream's
        return _role_engine_section(self.ref_config.fsdp_config)

    def _engine_options(self, role: str) -> dict:
        # upstream's actor.freeze_vision_tower: the trained policy's vision tower stays as loaded
        if role == "actor":
            return {"freeze_vision_tower": bool(self.actor_config.get("freeze_vision_tower", False))}
        return {}

    # ------------------------------------------------------------ upstream's worker internals
    # verl-recipe's workers (SPPO's `SPPOActorRolloutRefWorker`) override init_model with upstream's
    # legacy body: `_build_model_optimizer` for the actor and the reference, `_build_rollout`, then their own
    # `DataParallelPPOActor` subclass. The models are this backend's engines, so the RPCs (update_actor,
    # generate_sequences with its weight sync, compute_log_prob, checkpoints) run as for init_model's.
    @property
    def _is_offload_param(self) -> bool:
        section = self.config.actor.fsdp_config if self._is_actor else self.config.ref.get("fsdp_config", {})
        return bool(section.get("param_offload", False))

    @property
    def _is_offload_optimizer(self) -> bool:
        return self._is_actor and bool(self.config.actor.fsdp_config.get("optimizer_offload", False))

    def _build_model_optimizer(
        self,
        model_path: str,
        fsdp_config,
        optim_config,
        override_model_config,
        use_remove_padding: bool = False,
        use_fused_kernels: bool = False,
        enable_gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        use_liger: bool = False,
        role: str = "actor",
        enable_activation_offload: bool = False,
        use_prefix_grouper: bool = False,
        use_tiled_mlp: bool = False,
        tiled_mlp_shards: int = 4,
    ):
        """Upstream's: (module, optimizer, lr scheduler, HF config) of the model at `model_path`, FSDP2-sharded
        as `fsdp_config` says, trained with `optim_config` (None: frozen, as the reference). Also loads
        `self.tokenizer` and `self.processor` when not yet loaded. The engine behind it is the worker's
        actor (`role="actor"`) or reference engine (`role="ref"`), which the RPCs use. `use_liger`,
        `enable_activation_offload`, `use_prefix_grouper` and the tiled MLP select upstream's kernels for
        the same computation (ignored here, as the config keys are)."""
        del use_liger, enable_activation_offload, use_prefix_grouper, use_tiled_mlp, tiled_mlp_shards
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.tokenizer import hf_processor
        from verl.workers.engine import EngineRegistry

        if role not in ("actor", "ref"):
            raise ValueError(f"_build_model_optimizer(role={role!r}): the role is 'actor' or 'ref'")
        model_config = dataclasses.replace(
            self.model_config,
            path=model_path,
            override_config=dict(override_model_config or {}),
            use_remove_padding=bool(use_remove_padding),
            use_fused_kernels=bool(use_fused_kernels),
            enable_gradient_checkpointing=bool(enable_gradient_checkpointing),
            trust_remote_code=bool(trust_remote_code),
        )
        if self.__dict__.get("tokenizer") is None:
            self._load_tokenizer(model_path)
            self.processor = hf_processor(model_path, trust_remote_code=bool(trust_remote_code))
        trains = optim_config is not None
        engine = EngineRegistry.new(
            "language_model",
            self.strategy,
            model_config,
            _role_engine_section(fsdp_config),
            omega_conf_to_dataclass(optim_config, type(self.actor_config.optim)) if trains else None,
            self.actor_config.checkpoint if trains else None,
            self.tokenizer,
            **self._engine_options(role),
        )
        if role == "actor":
            self.actor_model = engine
        else:
            self.ref_model = engine
        module = engine.module
        # upstream's recipes take `_fsdp_wrapped_module` (FSDP1's inner module); an FSDP2 module is itself
        # the HF model, so the attribute names it (a plain attribute: no submodule cycle in state_dict)
        object.__setattr__(module, "_fsdp_wrapped_module", module)
        return module, engine.optimizer, getattr(engine, "lr_scheduler", None) if trains else None, engine.hf_config

    def _make_actor(self, engine: BaseEngine, trains: bool):
        from verl.workers.actor.dp_actor import DataParallelPPOActor

        optimizer = engine.optimizer if trains else None
        return DataParallelPPOActor(
            self.actor_config,
            engine.module,
            optimizer,
            ulysses_group=self.ulysses.group,
            use_fused_kernels=engine_workers.policy_uses_fused_kernels(self.model_config, self.actor_config),
            model_config=self.model_config,  # its tiled_mlp and enable_activation_offload
        )


class CriticWorker(engine_workers.CriticWorker):
    """The value model on FSDP2 (an LM body with a one-output token head)."""

    strategy = "fsdp"

    def _engine_config(self):
        return _role_engine_section(self.critic_config.fsdp)  # the older model.fsdp_config merged in

    def _make_critic(self, engine: BaseEngine):
        from verl.workers.critic.dp_critic import DataParallelPPOCritic

        return DataParallelPPOCritic(
            self.critic_config, engine.module, engine.optimizer, ulysses_group=self.ulysses.group
        )


class RewardModelWorker(reward_model_worker.RewardModelWorker):
    """The learned reward model: an HF `*ForSequenceClassification`, a full copy on each rank.

    Padded rows by default; with `reward_model.model.use_remove_padding` each micro-batch's rows are packed
    into one sequence, the decoder body runs on it, and the score head is applied to each row's last token
    (where the padded classifier pools). With `reward_model.ulysses_sequence_parallel_size` > 1 the packed
    sequence is split across the sp ranks (`verl.utils.ulysses`), whose hidden states are gathered back
    before the head; the ranks of a group score the group's rows together (`UlyssesRows`)."""

    sequence_parallel = True

    def _build_model(self) -> None:
        from verl.utils import ulysses
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
        self.use_remove_padding = bool(model_cfg.use_remove_padding)
        self.sp = ulysses.setup(
            "reward_model",
            self.config,
            self.model.config,
            self.use_remove_padding,
            self.ulysses.group,
            "reward_model.model.use_remove_padding",
        )
        if self.use_remove_padding:
            self._body, self._head = _body_and_head(self.model)

    def _sequence_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One score per row [B] (float32, CPU): the classifier's output at its pooled token."""
        micro = self.config.micro_batch_size_per_gpu or len(input_ids)
        forward = self._packed_scores if self.use_remove_padding else self._padded_scores
        scores = []
        with torch.no_grad():
            for start in range(0, len(input_ids), micro):
                ids = input_ids[start : start + micro].to(dev.get_device())
                mask = attention_mask[start : start + micro].to(dev.get_device())
                # [rows, num_labels]: the last (with one label, the only) output; a 1-row batch keeps its row
                scores.append(forward(ids, mask).float().reshape(len(ids), -1)[:, -1].cpu())
        return torch.cat(scores).reshape(-1)

    def _padded_scores(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits

    def _packed_scores(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[rows, num_labels]: the head at each row's last token of one packed (and, at sp > 1, split) forward."""
        from verl.utils import ulysses
        from verl.utils.remove_padding import packed_model_inputs, unpad_input, unpad_position_ids

        lengths = mask.sum(-1)
        if not bool((lengths > 0).all()):
            raise ValueError(
                "the reward model got a row with no tokens (all-zero attention_mask); it has nothing to score"
            )
        packed_ids, indices = unpad_input(ids, mask)
        packed_pos = unpad_position_ids((mask.cumsum(-1) - 1).clamp(min=0), indices)
        if self.sp > 1:
            out, pad = ulysses.forward_slice(self._body, packed_ids, packed_pos, self.ulysses.group)
            hidden = ulysses.gather_and_unpad(out.last_hidden_state[0], 0, pad, self.ulysses.group)
        else:
            inputs = packed_model_inputs(self._body, packed_ids, packed_pos)
            hidden = self._body(**inputs, use_cache=False).last_hidden_state[0]
        return self._head(hidden[lengths.cumsum(0) - 1])


def _body_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder body and the score head of an HF decoder `*ForSequenceClassification` (the head maps each
    token's hidden state to the scores; the classifier pools it at the row's last token)."""
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "score", None)
    if not isinstance(body, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        raise ValueError(
            f"reward_model.model.use_remove_padding=true scores packed rows with the decoder body and the `score` "
            f"head of a decoder *ForSequenceClassification; {type(model).__name__} has no such pair; set "
            "reward_model.model.use_remove_padding=false"
        )
    return body, head


# Upstream's name for the actor-rollout worker its agent-loop (server-mode) rollout needs; this worker
# serves both modes (synchronous generation and agent loops), so recipes that ask for it get it.
AsyncActorRolloutRefWorker = ActorRolloutRefWorker
