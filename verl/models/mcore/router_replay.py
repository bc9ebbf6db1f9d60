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
  parallelism megatron runs each micro-batch's forward and backward back to back.
- Pipeline parallelism (pp > 1): each stage's routers are a slice of the model's MoE layers; each
  knows its layers' columns of `routed_experts` (a stage may hold none: DeepSeek-V3's dense first
  layers). Replay sets a stage's targets in its forward of a micro-batch; 1F1B runs later
  micro-batches' forwards before an earlier one's backward, which is right only because the
  backward does not route again, so activation recomputation with pp > 1 is refused, as is the
  virtual pipeline (one chunk per stage is tracked). Recording queues each forward's choice per
  layer; only the last stage sees the micro-batch results, so after the pass every stage turns its
  queue into its columns of every micro-batch and the stages' columns are all-gathered over the
  pipeline group (one object all-gather of layers x top_k bytes a token per pass).
- Supported layouts: tp (with sequence parallelism), cp, ep and etp, dp, pp (as above). Not done:
  virtual pipeline, the FSDP actor, the critic and the reference (neither has a probability ratio
  whose two passes must agree; upstream reads the actor's key only).
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
        # [tokens, k] per forward not yet collected, oldest first (on a pipeline stage that is not the
        # last, a pass's micro-batches are collected after the schedule)
        self.recorded: list[torch.Tensor] = []
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
            self.recorded.append(indices.detach())
        return values, indices


def _has_router(layer) -> bool:
    return hasattr(layer.mlp, "router")


def _check_pipelined(config, mode: str, num_chunks: int) -> None:
    """Replay over pipeline stages: one model chunk a stage, no activation recomputation.

    The 1F1B schedule runs up to pp micro-batches' forwards before their backwards, so a layer's
    replay targets are those of its latest forward when an earlier micro-batch's backward runs: right
    without recomputation (the backward never routes again), wrong with it. Interleaved chunks are
    not tracked (each would need its own record queue in the interleaved order)."""
    if num_chunks > 1:
        raise NotImplementedError(
            f"{_KEY}={mode} with actor.megatron.virtual_pipeline_model_parallel_size={num_chunks}: replay tracks one "
            "model chunk per pipeline stage; set virtual_pipeline_model_parallel_size=null"
        )
    if config.recompute_granularity is not None:
        raise NotImplementedError(
            f"{_KEY}={mode} with pipeline_model_parallel_size={config.pipeline_model_parallel_size} and activation "
            f"recomputation (recompute_granularity={config.recompute_granularity}): 1F1B recomputes a micro-batch's "
            "routers after later micro-batches' forwards have replaced their targets; turn recomputation off "
            "(override_transformer_config.recompute_granularity=null) or set pipeline_model_parallel_size=1"
        )


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

        from verl.models.mcore.deepseek import is_moe_layer

        routers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        config = model_chunks[0].config
        self.pipelined = config.pipeline_model_parallel_size > 1
        # with pipeline stages a stage may hold no MoE layer (DeepSeek-V3's dense first layers)
        self.num_layers = (
            sum(is_moe_layer(config, i) for i in range(config.num_layers)) if self.pipelined else len(routers)
        )
        if not self.num_layers:
            raise ValueError(
                f"{_KEY}={mode} replays mixture-of-experts routing, but this model has no MoE layers; "
                f"set {_KEY}=disabled"
            )
        if routers and not hasattr(routers[0], "router_replay"):
            raise NotImplementedError(
                f"{_KEY}={mode} needs megatron-core's router replay hook (TopKRouter.router_replay, "
                "megatron-core 0.16 or newer); upgrade megatron-core or set the mode to disabled"
            )
        if self.pipelined:
            _check_pipelined(config, mode, len(model_chunks))
            # this stage's routers are a slice of the model's MoE layers: their columns in routed_experts
            globals_ = [layer.layer_number - 1 for layer in model_chunks[0].decoder.layers if _has_router(layer)]
            self.columns = [sum(is_moe_layer(config, i) for i in range(g)) for g in globals_]
            if len(self.columns) != len(routers):
                raise NotImplementedError(
                    f"{_KEY}={mode} with pipeline stages: this stage has {len(routers)} routers but "
                    f"{len(self.columns)} MoE decoder layers (MTP layers?); replay them without pipeline parallelism"
                )
        else:
            self.columns = list(range(len(routers)))
        self.layers = [_LayerRouting() for _ in routers]
        for router, layer in zip(routers, self.layers, strict=True):
            router.router_replay = layer
        self._pending: list[dict] = []  # pipelined recording: this stage's micro-batches, in order
        self.top_k = int(config.moe_router_topk)
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
            self._pending = []
            for layer in self.layers:
                layer.recorded, layer.target = [], None

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
        """Set every layer's replay targets from the micro-batch's `routed_experts` (replay); with
        pipeline stages, note the micro-batch whose routing this stage is about to record."""
        if self._action == "record" and self.pipelined:
            self._pending.append(micro_batch)
        if self._action != "replay":
            return
        tokens = self._to_model_tokens(micro_batch[ROUTED_EXPERTS], micro_batch["_aligned"])
        for column, layer in zip(self.columns, self.layers, strict=True):
            layer.target = tokens[:, column]

    def recorded(self, micro_batch: dict) -> torch.Tensor:
        """[b, S, num_layers, top_k] routing of the micro-batch whose forward just ran, over the
        columns of its `input_ids` (zeros at padding); the same on every rank of the replica."""
        aligned = micro_batch["_aligned"]
        missing = [column for column, layer in zip(self.columns, self.layers, strict=True) if not layer.recorded]
        if missing:
            raise RuntimeError(f"router replay: MoE layers {missing} recorded no routing in this forward")
        rows = aligned.input_ids.shape[0]
        if not self.layers:  # a pipeline stage of dense layers only
            return torch.zeros((rows, micro_batch["input_ids"].shape[1], 0, self.top_k), dtype=self.dtype)
        tokens = torch.stack([layer.recorded.pop(0) for layer in self.layers], dim=1)  # [s*b, n, k]
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

    def pipeline_recorded(self, device) -> torch.Tensor:
        """The whole model's [B, S, num_layers, top_k] routing of a pass over pipeline stages: each
        stage collects its own MoE layers' recording of every micro-batch (in the schedule's order,
        the same on every stage), and the stages' columns are gathered over the pipeline group and
        joined in layer order. The same on every rank; call it on every stage after the schedule."""
        from megatron.core import parallel_state as mpu

        mine = torch.cat([self.recorded(micro_batch).cpu() for micro_batch in self._pending], dim=0)
        self._pending = []
        group = mpu.get_pipeline_model_parallel_group()
        stages = [None] * dist.get_world_size(group)
        dist.all_gather_object(stages, mine, group=group)
        return torch.cat(stages, dim=2).to(device)

    def _to_model_tokens(self, routing: torch.Tensor, aligned) -> torch.Tensor:
        """[b, S, n, k] over the padded columns -> [tokens, n, k] in the order this rank's routers see
        their tokens (module docstring)."""
        rows, _, layers, top_k = routing.shape
        if layers != self.num_layers or top_k != self.top_k:
            raise ValueError(
                f"{ROUTED_EXPERTS} has {layers} layers x top-{top_k} per token, but this model has "
                f"{self.num_layers} MoE layers x top-{self.top_k}: it was recorded with another model"
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
