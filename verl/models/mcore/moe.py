"""Mixture-of-experts training on megatron-core: expert gradients and the router load-balancing loss.

Design decisions:
- Expert parameters (megatron's `mlp.experts.*`) are replicated only over the expert-data-parallel
  group (world / (etp x ep x pp) ranks), not over the data-parallel one: with ep > 1 each rank holds
  E/ep experts, and the all-to-all's backward has already brought each of them the gradient of
  every token routed to it, from every rank of its expert-parallel group. Summing over the
  expert-data-parallel group therefore adds up the contributions of every token of the world; one
  division by the data x context-parallel size gives the data-parallel average the dense
  parameters get (context ranks each hold cp times their share, see
  `verl.models.mcore.context_parallel`). This is what megatron's DDP does with its expert buckets.
- The gradient norm counts each expert shard once: dense parameters over the model-parallel group
  as before, expert parameters over the expert-tensor x expert-parallel x pipeline group.
- The load-balancing loss is the FSDP actor's (`verl.models.moe.load_balancing_loss`, HF's
  Switch-Transformer form over all layers' router logits of a micro-batch, real tokens only), not
  megatron's per-layer aux loss, so both backends train the same function and log the same
  `actor/load_balancing_loss`. It is switched on as on FSDP, by the HF config's
  `output_router_logits` (coefficient `router_aux_loss_coef`). The router logits are recorded by
  wrapping each router's `gating`; megatron's local forward routes the trailing pad tokens of the
  left-aligned batch too (harmless for the outputs: routing is dropless, a token's output never
  depends on another's), so they are masked out of the loss. Under sequence parallelism the logits
  are gathered over the tensor-parallel ranks first (each rank routes a slice of the sequence).
- The distributed optimizer (`use_distributed_optimizer`: the Adam state split by whole parameters
  over ranks that hold the same parameters) splits at ep > 1 over the ranks with this rank's tensor,
  pipeline, expert and expert-tensor ranks: data-parallel ranks hold different experts, and
  expert-data-parallel ranks different dense shards when etp != tp. Each moment is then written to
  a checkpoint by its owner in one chosen group (`writes_optimizer_state`).
- Not done: the loss with pipeline parallelism (its layers' logits live on different stages and the
  loss couples them) or context parallelism (each rank routes part of each sequence); both are
  refused when the loss is on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.models.moe import load_balancing_loss

__all__ = [
    "MegatronRouterAuxLoss",
    "expert_grad_sq_norm",
    "is_expert_param",
    "optimizer_state_shard_group",
    "reduce_expert_grads",
]

_OVERRIDE = "actor_rollout_ref.model.override_config"


def is_expert_param(name: str) -> bool:
    """Whether a megatron parameter name is a routed expert's weight (sharded over ep/etp)."""
    return ".mlp.experts." in f".{name}"


def expert_params(model_chunks) -> list[torch.nn.Parameter]:
    return [p for chunk in model_chunks for n, p in chunk.named_parameters() if is_expert_param(n) and p.requires_grad]


def reduce_expert_grads(params: list[torch.nn.Parameter], average) -> None:
    """Sum the experts' gradients over the expert-data-parallel group and divide by the data x
    context-parallel size (see the module docstring). `average(params, group, size)` is the bucketed
    all-reduce-and-divide the dense gradients use."""
    from megatron.core import parallel_state as mpu

    if not params:
        return
    size = mpu.get_data_parallel_world_size(with_context_parallel=True)
    group = mpu.get_expert_data_parallel_group()
    if dist.get_world_size(group) > 1 or size > 1:
        average(params, group, size)


def optimizer_state_shard_group():
    """The group the distributed optimizer splits the Adam state over: the ranks that hold the same
    parameters (`verl.utils.megatron.parallel_state.parameter_replica_group`)."""
    from verl.utils.megatron.parallel_state import parameter_replica_group

    return parameter_replica_group()


def expert_grad_sq_norm(model_chunks, device) -> torch.Tensor:
    """Squared L2 norm of the experts' gradients over the whole model: each expert shard once."""
    from megatron.core import parallel_state as mpu

    total = torch.zeros((), dtype=torch.float64, device=device)
    first_etp = mpu.get_expert_tensor_parallel_rank() == 0
    for param in expert_params(model_chunks):
        if param.grad is None:
            continue
        if getattr(param, "tensor_model_parallel", False) or first_etp:
            total += param.grad.detach().double().pow(2).sum()
    dist.all_reduce(total, group=mpu.get_expert_tensor_model_pipeline_parallel_group())
    return total


class MegatronRouterAuxLoss:
    """The megatron actor's load-balancing term; `coef`, `enabled` and `loss(micro_batch)` as the
    FSDP actor's `verl.models.moe.RouterAuxLoss` offers them."""

    def __init__(self, model_chunks, hf_config, trains: bool = True):
        from verl.models.moe import is_moe

        wanted = is_moe(hf_config) and bool(getattr(hf_config, "output_router_logits", False))
        if wanted:  # the actor owns the flag from here on, as on FSDP (saved configs say false)
            hf_config.output_router_logits = False
        self.enabled = trains and wanted
        self._logits: list[torch.Tensor] = []
        if not self.enabled:
            return
        self.coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
        self.top_k = int(hf_config.num_experts_per_tok)
        config = model_chunks[0].config
        for key, size in (
            ("pipeline_model_parallel_size", config.pipeline_model_parallel_size),
            ("context_parallel_size", config.context_parallel_size),
        ):
            if size > 1:
                raise ValueError(
                    f"{_OVERRIDE}.output_router_logits=true (the MoE load-balancing loss) with "
                    f"actor.megatron.{key}={size}: the loss couples the router logits of every layer and token of "
                    f"a micro-batch, which this backend computes only when one rank sees them all; set {key}=1 "
                    "or output_router_logits=false"
                )
        self.sequence_parallel = bool(config.sequence_parallel)
        from megatron.core.transformer.moe.router import TopKRouter

        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.gating = self._recording(module.gating)

    def _recording(self, gating):
        def gating_and_record(hidden_states):
            logits = gating(hidden_states)
            if torch.is_grad_enabled():  # training forwards only (log-prob passes run without grad)
                self._logits.append(logits)
            return logits

        return gating_and_record

    def loss(self, micro_batch) -> torch.Tensor | None:
        """The loss over the real tokens of the micro-batch whose forward just ran (None when off)."""
        if not self.enabled:
            return None
        logits, self._logits = self._logits, []
        if not logits:
            raise RuntimeError("no router logits were recorded for this micro-batch's forward")
        aligned = micro_batch["_aligned"]
        batch_size, length = aligned.input_ids.shape
        lengths = micro_batch["attention_mask"].sum(dim=1).to(aligned.input_ids.device)
        real = (torch.arange(length, device=lengths.device)[:, None] < lengths[None, :]).reshape(-1)  # [L*B]
        per_layer = []
        for layer in logits:  # [L_local, B, E], sequence first
            if self.sequence_parallel:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                layer = gather_from_sequence_parallel_region(layer, tensor_parallel_output_grad=False)
            per_layer.append(layer.reshape(length * batch_size, -1)[real])
        return load_balancing_loss(per_layer, self.top_k)
