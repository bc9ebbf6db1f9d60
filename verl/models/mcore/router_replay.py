"""Mixture-of-experts router replay on megatron-core (upstream's `actor.router_replay.mode`).

A MoE policy's log-probability depends on which experts each token is routed to, and the top-k
choice is a discontinuous function of the router weights: after one optimizer step some tokens
flip experts, so the update's forward of a later mini-batch (or epoch) scores a different network
from the one that computed `old_log_probs`, and the PPO ratio mixes a weight change with a routing
change. Router replay pins the routing: the update's forward uses the experts recorded in another
pass; the gate values are still computed from the current router logits at those experts, so the
router keeps training (megatron's replay gathers the scores at the given indices).

Modes (upstream's names):
- `R2`: the old-log-prob pass (`compute_log_prob`) records the top-k expert ids of every token in
  every MoE layer and returns them as `routed_experts`; the update's forwards replay them.
- `R3`: the rollout engine records them while it generates (`rollout.enable_rollout_routing_replay`,
  the built-in engine only: `verl.workers.rollout.native.engine`; vLLM and SGLang need the patches
  upstream's README names) and both the old-log-prob pass and the update's forwards replay them, so
  `old_log_probs` and the update score the network that sampled the tokens. As upstream, R3 returns
  no recording of its own: the rollout's `routed_experts` stay in the batch.

Data path: `routed_experts` is [B, S, num_moe_layers, top_k] over the columns of `input_ids` (left-
padded prompt, right-padded response; zeros at padding), the smallest integer dtype that holds the
expert ids (uint8 up to 256 experts). It travels in the DataProto like any per-token tensor, so
row chunking, shuffling, dynamic batching and micro-batch splits keep it with its row. Inside a
micro-batch it is moved to megatron's layout: left-aligned (`verl.models.mcore.forward`), this
context-parallel rank's columns, sequence first, this tensor rank's slice under sequence
parallelism, flattened to the router's [tokens, top_k]. Recording goes the other way (gathers over
the same groups). Padding columns are not replayed: they take the router's own choice, as without
replay, so each expert's batch of tokens has the same shape as in the recorded pass (a replayed
update with nothing to correct is the unreplayed one bit for bit).

Design decisions:
- Each router of one model gets its own `_LayerRouting` object in megatron's `router.router_replay`
  slot (what `topk_routing_with_score_function` consults) instead of megatron's
  `moe_enable_routing_replay`, whose instances sit in one process-wide list shared by every model of
  the process (the actor's, the reference's and a critic's routers would be mixed).
- A replayed micro-batch's targets stay set until the next micro-batch's forward, so activation
  recomputation in its backward replays the same experts. This holds because without pipeline
  parallelism megatron runs each micro-batch's forward and backward back to back; with pipeline
  parallelism (1F1B interleaves them, and each stage holds part of the layers) replay is refused.
- Supported layouts: tp (with sequence parallelism), cp, ep and etp, dp. Not done: pp > 1 (see
  above), the FSDP actor, the critic and the reference (neither has a probability ratio whose
  two passes must agree; upstream reads the actor's key only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.models.moe import ROUTED_EXPERTS, routing_dtype

__all__ = ["MODES", "ROUTED_EXPERTS", "MegatronRouterReplay", "routing_dtype"]

MODES = ("disabled", "R2", "R3")
_KEY = "actor_rollout_ref.actor.router_replay.mode"


class _LayerRouting:
    """One router's replay slot: megatron calls `get_replay_topk` in place of its top-k."""

    def __init__(self):
        self.action: str | None = None  # None: megatron's own top-k; "record"; "replay"
        self.recorded: torch.Tensor | None = None  # [tokens, k], the last forward's choice
        self.target: torch.Tensor | None = None  # [tokens, k], what to replay; -1: the router's own choice

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.action == "replay":
            if self.target is None or self.target.shape != (scores.shape[0], topk):
                got = None if self.target is None else tuple(self.target.shape)
                raise RuntimeError(
                    f"router replay: targets {got} for a forward of {scores.shape[0]} tokens, top-{topk}"
                )
            _, own = default_compute_topk(scores, topk, num_groups, group_topk)
            target = self.target.to(scores.device)
            indices = torch.where(target[:, :1] >= 0, target, own)
            return scores.gather(1, indices), indices
        values, indices = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.action == "record":
            self.recorded = indices.detach()
        return values, indices


class MegatronRouterReplay:
    """Records and replays the routing of one model's MoE layers (see the module docstring).

    `enabled` is False for `mode=disabled` and for a model without an optimizer (a reference
    policy); then every call is a no-op and the routers are untouched."""

    def __init__(self, model_chunks, mode: str, trains: bool = True):
        if mode not in MODES:
            raise ValueError(f"{_KEY}={mode!r} is not a valid choice; use one of {', '.join(MODES)}")
        self.mode = mode
        self.enabled = trains and mode != "disabled"
        self._action: str | None = None
        if not self.enabled:
            return
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError(
                f"{_KEY}={mode} replays mixture-of-experts routing, but this model has no MoE layers; "
                f"set {_KEY}=disabled"
            )
        if not hasattr(routers[0], "router_replay"):
            raise NotImplementedError(
                f"{_KEY}={mode} needs megatron-core's router replay hook (TopKRouter.router_replay, "
                "megatron-core 0.16 or newer); upgrade megatron-core or set the mode to disabled"
            )
        config = model_chunks[0].config
        if config.pipeline_model_parallel_size > 1:
            raise NotImplementedError(
                f"{_KEY}={mode} with actor.megatron.pipeline_model_parallel_size="
                f"{config.pipeline_model_parallel_size}: each stage holds part of the MoE layers and 1F1B "
                "interleaves micro-batches, which this replay does not track; set pipeline_model_parallel_size=1 "
                "(expert, tensor and context parallelism are supported) or the mode to disabled"
            )
        self.layers = [_LayerRouting() for _ in routers]
        for router, layer in zip(routers, self.layers, strict=True):
            router.router_replay = layer
        self.top_k = int(routers[0].topk)
        self.num_experts = int(config.num_moe_experts)
        self.dtype = routing_dtype(self.num_experts)
        self.sequence_parallel = bool(config.sequence_parallel) and config.tensor_model_parallel_size > 1

    # ------------------------------------------------------------------ which pass does what

    def start_recording(self) -> None:
        self._set_action("record")

    def start_old_log_prob_pass(self) -> None:
        """R2 records the pass's routing; R3 replays the rollout's (`routed_experts` in the batch)."""
        self._set_action("replay" if self.mode == "R3" else "record")

    @property
    def replays_rollout_routing(self) -> bool:
        """Whether every forward of this model replays the rollout's `routed_experts` (R3)."""
        return self.enabled and self.mode == "R3"

    def start_replaying(self) -> None:
        self._set_action("replay")

    def stop(self) -> None:
        self._set_action(None)
        if self.enabled:
            for layer in self.layers:
                layer.recorded = layer.target = None

    @property
    def recording(self) -> bool:
        return self._action == "record"

    def _set_action(self, action: str | None) -> None:
        self._action = action if self.enabled else None
        if self.enabled:
            for layer in self.layers:
                layer.action = self._action

    # ------------------------------------------------------------------ per micro-batch

    def before_forward(self, micro_batch: dict) -> None:
        """Set every layer's replay targets from the micro-batch's `routed_experts` (replay only)."""
        if self._action != "replay":
            return
        tokens = self._to_model_tokens(micro_batch[ROUTED_EXPERTS], micro_batch["_aligned"])
        for i, layer in enumerate(self.layers):
            layer.target = tokens[:, i]

    def recorded(self, micro_batch: dict) -> torch.Tensor:
        """[b, S, num_layers, top_k] routing of the micro-batch whose forward just ran, over the
        columns of its `input_ids` (zeros at padding); the same on every rank of the replica."""
        aligned = micro_batch["_aligned"]
        missing = [i for i, layer in enumerate(self.layers) if layer.recorded is None]
        if missing:
            raise RuntimeError(f"router replay: MoE layers {missing} recorded no routing in this forward")
        rows = aligned.input_ids.shape[0]
        tokens = torch.stack([layer.recorded for layer in self.layers], dim=1)  # [s*b, n, k]
        for layer in self.layers:
            layer.recorded = None
        per_column = tokens.view(-1, rows, len(self.layers), self.top_k)  # [s, b, n, k]: sequence first
        if self.sequence_parallel:
            from megatron.core import parallel_state as mpu

            group = mpu.get_tensor_model_parallel_group()
            parts = [torch.empty_like(per_column) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, per_column.contiguous(), group=group)
            per_column = torch.cat(parts, dim=0)
        aligned_routing = aligned.full(per_column.transpose(0, 1).contiguous())  # [b, L, n, k]
        input_ids = micro_batch["input_ids"]
        out = torch.zeros(
            (rows, input_ids.shape[1], len(self.layers), self.top_k), dtype=torch.long, device=aligned_routing.device
        )
        real = aligned.real
        rows_index = torch.arange(rows, device=real.device)[:, None].expand_as(real)
        out[rows_index[real], aligned.source_columns[real]] = aligned_routing[real]
        return out.to(self.dtype)

    def _to_model_tokens(self, routing: torch.Tensor, aligned) -> torch.Tensor:
        """[b, S, n, k] over the padded columns -> [tokens, n, k] in the order this rank's routers see
        their tokens (module docstring)."""
        rows, _, layers, top_k = routing.shape
        if layers != len(self.layers) or top_k != self.top_k:
            raise ValueError(
                f"{ROUTED_EXPERTS} has {layers} layers x top-{top_k} per token, but this model has "
                f"{len(self.layers)} MoE layers x top-{self.top_k}: it was recorded with another model"
            )
        index = aligned.source_columns[..., None, None].expand(-1, -1, layers, top_k)
        chosen = torch.gather(routing.long(), 1, index)  # [b, L, n, k]
        chosen = torch.where(aligned.real[..., None, None], chosen, -1)  # padding: the router's own choice
        local = aligned.local(chosen).transpose(0, 1)  # this context rank's columns, [s, b, n, k]
        if self.sequence_parallel:
            from megatron.core import parallel_state as mpu

            size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
            local = local.chunk(size, dim=0)[rank]
        return local.reshape(-1, layers, top_k)
