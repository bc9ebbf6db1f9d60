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
  `output_router_logits` (coefficient `router_aux_loss_coef`). Each router's `gating` is wrapped;
  megatron's local forward routes the trailing pad tokens of the left-aligned batch too (harmless
  for the outputs: routing is dropless, a token's output never depends on another's), so they are
  masked out. Under sequence parallelism the logits are gathered over the tensor-parallel ranks
  first (each rank routes a slice of the sequence).
- The loss couples every layer and token of a micro-batch (E * sum_e f_e * P_e over all of them),
  while pipeline stages hold different layers and context-parallel ranks different tokens. It is
  computed from sums instead (`_RouterStats`): per expert the top-k choices c_e and the summed
  probabilities p_e, and the routed token count T, each summed over this rank's routers, then
  all-reduced over the pipeline x context-parallel ranks of the micro-batch. Since
  loss = E * sum_e c_e p_e / T^2 is linear in p given the non-differentiable c and T, each rank's
  routers receive exactly their share of the gradient, E * c_e / T^2 (totals) times the loss weight.
- Megatron's schedule backpropagates only the last stage's loss, so the term's gradient enters at
  the routers (`_AttachRouterLoss`, megatron's `MoEAuxLossAutoScaler` idea: identity on the logits,
  whose backward adds the gradient of the router's summed probabilities) and the loss the last
  stage adds is a detached value, the metric. Every layout (pp=1 too) takes this one path.
- The all-reduce is started asynchronously after this rank's last chunk has run the micro-batch's
  forward, on a communicator of its own: under 1F1B an early stage must go on with other
  micro-batches (a blocking all-reduce there would wait for a stage that waits for it). Every
  stage has run the micro-batch's forward before any backward of it, so the totals are complete
  when a backward (or the last stage's loss) waits for them.
- Context-parallel ranks each compute the loss of the whole sequence, so their gradients are cp
  times their share (`verl.models.mcore.context_parallel`); the term's gradient is scaled likewise.
- Refused with the loss on: activation recomputation that re-runs the routers
  (`recompute_granularity=full`, or `selective` with `moe`): the recomputed routers run inside the
  backward, after the statistics were exchanged (and the first, no-grad forward records nothing).
  Recomputing `core_attn` only is fine.
- The distributed optimizer (`use_distributed_optimizer`: the Adam state split by whole parameters
  over ranks that hold the same parameters) splits at ep > 1, and at ep=1 with etp > tp, over the
  ranks with this rank's tensor, pipeline, expert and expert-tensor ranks: data-parallel ranks hold
  different experts (or, at etp > tp, different shards of each expert), and expert-data-parallel
  ranks different dense shards when etp != tp. Each moment is then written to
  a checkpoint by its owner in one chosen group (`writes_optimizer_state`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "MegatronRouterAuxLoss",
    "expert_grad_sq_norm",
    "freeze_routers",
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


def freeze_routers(model_chunks) -> int:
    """Upstream's `override_mcore_model_config.moe_config.freeze_moe_router`: every router's weight (and
    bias) stops requiring a gradient, so it gets none, no optimizer state and no update (a sigmoid
    router's correction bias is a buffer, fixed anyway). Returns how many routers this rank holds."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        for name in ("weight", "bias"):
            param = getattr(router, name, None)
            if isinstance(param, torch.nn.Parameter):
                param.requires_grad_(False)
    return len(routers)


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


class _RouterStats:
    """One training micro-batch's load-balancing statistics on this rank, summed over its routers.

    HF's loss over all layers' logits [T, E] is E * sum_e (c_e / T) * (p_e / T): c_e the top-k
    choices of expert e (no gradient), p_e the summed softmax probabilities of e, T the routed real
    tokens times the layers. All three are sums, so each rank sums its own layers and tokens and
    one all-reduce over the pipeline x context-parallel ranks gives the micro-batch's totals. The
    loss is linear in p given c and T, so each rank's p_e receives the gradient E * c_e / T^2 (the
    totals') times the micro-batch's loss weight, through `_AttachRouterLoss` on its routers."""

    def __init__(self, real: torch.Tensor, grad_scale: torch.Tensor, experts: int, dtype: torch.dtype):
        self.real = real  # [L_local * B] bool, sequence-first like the routers' logits
        self.grad_scale = grad_scale
        self.experts = experts
        self.sums = torch.zeros(2 * experts + 1, dtype=dtype, device=real.device)  # [c, p, T]
        self.exchanged = False
        self._handle = None

    def add(self, counts: torch.Tensor, prob_sum: torch.Tensor, tokens: int) -> None:
        e = self.experts
        self.sums[:e] += counts
        self.sums[e : 2 * e] += prob_sum
        self.sums[-1] += tokens

    def exchange(self, group) -> None:
        """Start summing over `group` (None: this rank is alone); waited for by `totals`."""
        self.exchanged = True
        if group is not None:
            self._handle = dist.all_reduce(self.sums, group=group, async_op=True)

    def totals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.exchanged:
            raise RuntimeError("the router statistics of a micro-batch were read before this rank's forward ended")
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        e = self.experts
        return self.sums[:e], self.sums[e : 2 * e], self.sums[-1].clamp(min=1)

    def loss(self) -> torch.Tensor:
        counts, prob_sums, tokens = self.totals()
        return self.experts * (counts * prob_sums).sum() / tokens**2

    def prob_sum_grad(self) -> torch.Tensor:
        counts, _, tokens = self.totals()
        return self.grad_scale * self.experts * counts / tokens**2


class _AttachRouterLoss(torch.autograd.Function):
    """Identity on a router's logits whose backward also sends the load-balancing gradient into
    `prob_sum` (this router's summed probabilities [E]): megatron's `MoEAuxLossAutoScaler` idea.
    The term then trains the routers of every pipeline stage, though megatron's schedule
    backpropagates only the last stage's loss; by the time a stage's backward reaches its routers,
    every stage has run the micro-batch's forward and the totals are there."""

    @staticmethod
    def forward(ctx, logits, prob_sum, stats):
        ctx.stats = stats
        return logits

    @staticmethod
    def backward(ctx, grad_logits):
        return grad_logits, ctx.stats.prob_sum_grad(), None


def _pipeline_and_context_group(config):
    """The group of ranks holding the same tokens' other layers (pipeline) or other columns
    (context parallel): same data- and tensor-parallel rank. None when that is this rank alone.
    Built with `dist.new_group` by every rank (collective), for the actor's own use only: its
    all-reduces run asynchronously beside the pipeline's send/receive and the context-parallel
    attention's all-gathers, so they get their own communicator."""
    if config.pipeline_model_parallel_size * config.context_parallel_size == 1:
        return None
    from megatron.core import parallel_state as mpu

    key = (mpu.get_data_parallel_rank(), mpu.get_tensor_model_parallel_rank())
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    mine = None
    for value in sorted(set(keys)):
        group = dist.new_group([rank for rank, k in enumerate(keys) if k == value])
        if value == key:
            mine = group
    return mine


class MegatronRouterAuxLoss:
    """The megatron actor's load-balancing term, at any tensor, pipeline, context and expert
    layout; `coef`, `enabled` and `loss(micro_batch)` as the FSDP actor's
    `verl.models.moe.RouterAuxLoss` offers them.

    Per training micro-batch (`start` before each chunk's forward, `end_forward` after it): every
    router on this rank adds its statistics (`_RouterStats`) over the real tokens it routed, and
    wraps its logits so the backward brings the term's gradient to it; after this rank's last
    chunk the statistics are summed over the pipeline x context-parallel ranks (asynchronously:
    the earlier stages have to go on feeding the pipeline). `loss` (last stage) is the total's
    value, detached: the gradient goes through the routers, not through the loss."""

    def __init__(self, model_chunks, hf_config, trains: bool = True):
        from verl.models.moe import is_moe, num_experts

        wanted = is_moe(hf_config) and bool(getattr(hf_config, "output_router_logits", False))
        if wanted:  # the actor owns the flag from here on, as on FSDP (saved configs say false)
            hf_config.output_router_logits = False
        self.enabled = trains and wanted
        self._current: _RouterStats | None = None
        if not self.enabled:
            return
        self.coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
        self.top_k = int(hf_config.num_experts_per_tok)
        self.num_experts = num_experts(hf_config)
        self.chunks = list(model_chunks)
        config = model_chunks[0].config
        recompute_modules = getattr(config, "recompute_modules", None) or []
        if config.recompute_granularity == "full" or (
            config.recompute_granularity == "selective" and "moe" in recompute_modules
        ):
            raise ValueError(
                f"{_OVERRIDE}.output_router_logits=true (the MoE load-balancing loss) with activation "
                f"recomputation of the routers (override_transformer_config.recompute_granularity="
                f"{config.recompute_granularity}): the routers run again inside the backward pass, where the "
                "loss's statistics can no longer be summed over ranks; recompute only core_attn "
                "(recompute_granularity=selective, recompute_modules=[core_attn]) or set output_router_logits=false"
            )
        self.sequence_parallel = bool(config.sequence_parallel)
        self.context_parallel_size = config.context_parallel_size
        self.dtype = torch.promote_types(config.params_dtype, torch.float32)
        self.group = _pipeline_and_context_group(config)
        from megatron.core.transformer.moe.router import TopKRouter

        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.gating = self._recording(module.gating)

    def start(self, micro_batch, weight: torch.Tensor) -> None:
        """Before a chunk's training forward of `micro_batch`, whose loss weight in the mini-batch
        is `weight` (the factor `_micro_batch_loss` multiplies its loss by)."""
        stats = micro_batch.get("_router_stats")
        if stats is None:
            aligned = micro_batch["_aligned"]
            length = aligned.input_ids.shape[1]
            lengths = micro_batch["attention_mask"].sum(dim=1).to(aligned.input_ids.device)
            real = torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]  # [B, L]
            real = aligned.local(real).transpose(0, 1).reshape(-1)  # this rank's columns, sequence first
            # each context-parallel rank's gradients are cp times its share (verl.models.mcore.context_parallel)
            scale = weight.detach().to(self.dtype) * self.coef * self.context_parallel_size
            stats = micro_batch["_router_stats"] = _RouterStats(real, scale, self.num_experts, self.dtype)
        self._current = stats

    def end_forward(self, micro_batch, model) -> None:
        """After a chunk's training forward: the statistics are complete after this rank's last chunk."""
        self._current = None
        if model is self.chunks[-1]:
            micro_batch["_router_stats"].exchange(self.group)

    def _recording(self, gating):
        def gating_and_record(hidden_states):
            logits = gating(hidden_states)
            stats = self._current
            if stats is None or not torch.is_grad_enabled():  # log-prob passes run without grad
                return logits
            routed = logits
            if self.sequence_parallel:  # each tensor rank routed a slice of the sequence
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                routed = gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=False)
            routed = routed.reshape(-1, routed.shape[-1])[stats.real]
            probs = torch.softmax(routed.to(self.dtype), dim=-1)
            chosen = torch.topk(probs.detach(), self.top_k, dim=-1).indices.reshape(-1)
            counts = torch.zeros(self.num_experts, dtype=self.dtype, device=probs.device)
            counts.index_add_(0, chosen, torch.ones(chosen.numel(), dtype=self.dtype, device=probs.device))
            prob_sum = probs.sum(dim=0)
            stats.add(counts, prob_sum.detach(), routed.shape[0])
            return _AttachRouterLoss.apply(logits, prob_sum, stats)

        return gating_and_record

    def loss(self, micro_batch) -> torch.Tensor | None:
        """The loss over the real tokens of the micro-batch whose forward just ran (None when off),
        without gradient: its gradient reaches the routers through `_AttachRouterLoss`."""
        if not self.enabled:
            return None
        stats = micro_batch.get("_router_stats")
        if stats is None:
            raise RuntimeError("no router statistics were recorded for this micro-batch's forward")
        return stats.loss()
