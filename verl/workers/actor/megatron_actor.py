"""The PPO actor on a megatron-core GPTModel (tensor / pipeline parallel), free of Ray.

`MegatronPPOActor(config, model_chunks, hf_config, actor_optimizer=None)` is the role logic of
`verl.workers.actor.ppo_actor.PPOActor` (config keys, batch semantics, micro-batching, loss
functions, loss normalisation, guarded steps, metric names: written once, shared with the FSDP
actor, its sibling) with what touches the model: the forward pass, gradient synchronisation and
clipping.

Design decisions:
- Forward and backward go through megatron's `get_forward_backward_func()`, one call per
  mini-batch with all of its micro-batches, so pipeline (and interleaved pipeline) parallelism
  overlaps micro-batches as megatron intends. The loss function runs on the last stage; metrics
  and log-probs are broadcast from it to the other stages, so every rank returns the same thing.
- Rows are left-aligned before the forward (see `verl.models.mcore.forward`); logits are divided
  by the sampling temperature as in the FSDP actor, and log-probs/entropy come from the
  tensor-parallel vocabulary shards without gathering them
  (`verl.utils.megatron.tensor_parallel`).
- The optimizer is a plain torch optimizer (AdamW from the worker) over this rank's parameter
  shards, not megatron's `DistributedOptimizer`: Adam is elementwise, so stepping shards is exactly
  stepping the full model; megatron's optimizer needs its DDP gradient buffers and, for speed,
  apex or TransformerEngine, none of which exist on CPU. `use_distributed_optimizer` splits the
  Adam state over data-parallel ranks with torch's ZeroRedundancyOptimizer (`verl.utils.optim`).
  Its parameters are the model's, so they stay fp32 at `megatron.dtype=bf16` and the forward runs
  under autocast (`verl.models.mcore.config.compute_autocast`): bf16 parameters would be bf16
  master weights, which a small lr never moves.
- Gradients are synchronised by hand after each mini-batch: averaged over megatron's data-parallel
  group (flat buckets of up to 64 MB, `verl.workers.dp_training.average_gradients`), summed over
  the embedding group for tied embeddings split across pipeline stages, then clipped by the norm
  over the whole model (each tensor-parallel shard once, replicated parameters once, the tied copy
  once) as `torch.nn.utils.clip_grad_norm_` would compute it on the unsharded model.

Context parallelism (`megatron.context_parallel_size`): each rank runs its columns of every
sequence (`verl.models.mcore.context_parallel`); per-token log-probs and entropies are gathered
back to whole rows, so losses and metrics are computed as without it. Dynamic batch sizes count
`ppo_max_token_len_per_gpu` per rank, so a micro-batch holds cp times that many tokens.

MoE router replay (`router_replay.mode`, `verl.models.mcore.router_replay`): with R2 the
old-log-prob pass records each token's experts and returns them as `routed_experts`; with R3 the
rollout engine recorded them and the old-log-prob pass replays them too. The update's forwards
replay them, micro-batch by micro-batch, through the `before_forward` hook of
`run_megatron_schedule`. The MoE load-balancing loss (`verl.models.mcore.moe`) uses both hooks in
a training pass: each chunk's routers add their statistics between them, and after this rank's
last chunk the micro-batch's statistics go to the other pipeline and context-parallel ranks.

Not supported (clear errors): `use_remove_padding` is ignored (rows are already left-aligned
and trimmed), ulysses sequence parallelism, multi-dimensional position ids.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import torch
import torch.distributed as dist

from verl.models.mcore.config import compute_autocast
from verl.models.mcore.forward import left_align, response_columns
from verl.models.mcore.lora import partial_grad_group
from verl.models.mcore.moe import MegatronRouterAuxLoss, expert_grad_sq_norm, expert_params, reduce_expert_grads
from verl.models.mcore.mtp import find_mtp_training, mtp_loss
from verl.models.mcore.router_replay import ROUTED_EXPERTS, MegatronRouterReplay
from verl.utils import shared_prompt, speed_paths
from verl.utils.device import get_device
from verl.utils.flops_counter import FlopsCounter, FlopsTally
from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_and_entropy
from verl.workers.actor.ppo_actor import MODEL_INPUTS, PPOActor, require_temperature
from verl.workers.config import McoreActorConfig
from verl.workers.dp_training import (
    append_to_dict,
    average_gradients,
    metrics_to_host,
    micro_batch_weight,
    response_mask_of,
    split_micro_batches,
    step_if_finite,
)

__all__ = [
    "MegatronPPOActor",
    "broadcast_from_last_stage",
    "clip_grads_megatron",
    "context_parallel_config",
    "per_rank_token_budget",
    "finalize_megatron_grads",
    "run_megatron_schedule",
]


def _dp_group_and_size():
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group(), mpu.get_data_parallel_world_size()


def per_rank_token_budget(max_token_len):
    """A `*_max_token_len_per_gpu` budget for one sequence's whole group of context-parallel ranks:
    each rank holds 1/cp of every sequence, so a micro-batch may hold cp times the tokens."""
    from megatron.core import parallel_state as mpu

    cp = mpu.get_context_parallel_world_size()
    return max_token_len if max_token_len is None or cp == 1 else int(max_token_len) * cp


def context_parallel_config(cfg):
    """`cfg` (an actor or critic config dataclass) with `ppo_max_token_len_per_gpu` scaled by
    `per_rank_token_budget`: a copy, since config sections are frozen and shared."""
    budget = cfg.ppo_max_token_len_per_gpu
    if budget is None:
        return cfg
    return dataclasses.replace(cfg, ppo_max_token_len_per_gpu=per_rank_token_budget(budget))


def broadcast_from_last_stage(obj):
    """`obj` (a picklable value on the last pipeline stage) on every stage."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return obj
    group = mpu.get_pipeline_model_parallel_group()
    holder = [obj]
    last = dist.get_global_rank(group, mpu.get_pipeline_model_parallel_world_size() - 1)
    dist.broadcast_object_list(holder, src=last, group=group)
    return holder[0]


def finalize_megatron_grads(model_chunks) -> None:
    """Sum the sequence-parallel norms' gradients over the tensor-parallel group, average gradients
    over the data-parallel x context-parallel group and sum the tied embedding's two copies (first
    and last pipeline stage); megatron's DDP would do this, we train without its wrapper.
    Context-parallel ranks each hold `cp` times their share of the gradient (see
    `verl.models.mcore.context_parallel`), so the average over them is the exact sum."""
    from megatron.core import parallel_state as mpu

    params = {id(p): p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad}
    tp_size = mpu.get_tensor_model_parallel_world_size()
    experts = {id(p) for p in expert_params(model_chunks)}  # a MoE model's: see verl.models.mcore.moe
    # an expert's bias (gpt-oss) is marked sequence-parallel by megatron too, but the experts' own
    # reduction below already sums over the ranks that routed tokens to it, tensor ranks included
    sequence_parallel = [p for i, p in params.items() if getattr(p, "sequence_parallel", False) and i not in experts]
    if tp_size > 1 and sequence_parallel:
        # norms under sequence parallelism saw only this rank's slice of the tokens: sum the slices
        # (the average over tp_size ranks of tp_size times each)
        for param in sequence_parallel:
            if param.grad is not None:
                param.grad.mul_(tp_size)
        average_gradients(sequence_parallel, mpu.get_tensor_model_parallel_group(), tp_size)
    # LoRA's A of a column-parallel layer (B of an expert's fc2): each rank holds its share of the sum
    for param in params.values():
        group = partial_grad_group(param) if param.grad is not None else None
        if group is not None:
            dist.all_reduce(param.grad, group=group)
    reduce_expert_grads([p for p in params.values() if id(p) in experts], average_gradients)
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)
    if dp_size > 1:  # bucketed: a few all-reduces per step instead of one per tensor
        dense = [p for p in params.values() if id(p) not in experts]
        average_gradients(dense, mpu.get_data_parallel_group(with_context_parallel=True), dp_size)
    if mpu.get_pipeline_model_parallel_world_size() > 1 and mpu.is_rank_in_embedding_group(ignore_virtual=True):
        _sum_embedding_copies(model_chunks)


def _sum_embedding_copies(model_chunks) -> None:
    """Sum the gradients of the embedding's copies on the first and last pipeline stage (as megatron's
    `_allreduce_embedding_grad`): the last stage keeps one for a tied LM head and for the MTP layers
    (`verl.models.mcore.mtp`). Every rank of the embedding group joins the all-reduce, a copy that got
    no gradient (detached MTP inputs, a frozen embedding) with zeros, so neither stage waits alone."""
    from megatron.core import parallel_state as mpu

    for chunk in (model_chunks[0], model_chunks[-1]):
        if not (chunk.share_embeddings_and_output_weights or chunk.config.mtp_num_layers):
            continue
        weight = chunk.shared_embedding_or_output_weight()
        if weight is None or not weight.requires_grad:
            continue
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=mpu.get_embedding_group())
        return


def _grad_norm(model_chunks) -> torch.Tensor:
    """L2 norm of the full model's gradient, each parameter counted once across tp and pp ranks: a
    float64 0-d tensor on the device (no host sync)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    total = torch.zeros((), dtype=torch.float64, device=get_device())
    seen = {id(p) for p in expert_params(model_chunks)}  # counted over the expert groups below
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.grad is None or id(param) in seen:
                continue
            seen.add(id(param))
            if getattr(param, "shared", False):  # the last stage's copy of the tied embedding
                continue
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            total += param.grad.detach().double().pow(2).sum()
    dist.all_reduce(total, group=mpu.get_model_parallel_group())
    if seen:
        total += expert_grad_sq_norm(model_chunks, total.device)
    return total.sqrt()


def clip_grads_megatron(model_chunks, grad_clip: float | None) -> torch.Tensor:
    """Clip to `grad_clip` by the full model's norm, with `torch.nn.utils.clip_grad_norm_`'s scaling;
    returns the norm before clipping as a device tensor (no host sync). A non-finite norm leaves
    non-finite gradients (`step_if_finite` skips the step)."""
    grad_norm = _grad_norm(model_chunks)
    max_norm = float("inf") if grad_clip is None else float(grad_clip)
    coef = (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.grad is not None:
                param.grad.mul_(coef)
    return grad_norm


def _interleavable(micro_batches: list, model_chunks) -> list:
    """The micro-batches in a form megatron's interleaved (virtual pipeline) schedule runs: at least
    one per pipeline stage (the largest is halved until there are), with the chunks' group size
    (micro-batches run back to back per virtual stage) set so that the last group is not shorter
    than the pipeline. Splitting rows changes no loss or gradient: every micro-batch's loss is
    weighted by the mini-batch's normaliser, not by its own size."""
    from megatron.core import parallel_state as mpu

    pp = mpu.get_pipeline_model_parallel_world_size()
    micro_batches = list(micro_batches)
    while len(micro_batches) < pp:
        largest = max(range(len(micro_batches)), key=lambda i: micro_batches[i].batch_size[0])
        rows = micro_batches[largest].batch_size[0]
        if rows < 2:
            total = sum(m.batch_size[0] for m in micro_batches)
            raise ValueError(
                f"the interleaved pipeline schedule (virtual_pipeline_model_parallel_size="
                f"{len(model_chunks)}) needs at least pipeline_model_parallel_size={pp} micro-batches, "
                f"but this rank's batch has only {total} rows; use a larger batch per data-parallel rank "
                "or set virtual_pipeline_model_parallel_size=null"
            )
        half = micro_batches.pop(largest)
        micro_batches[largest:largest] = [half[: rows // 2], half[rows // 2 :]]
    count = len(micro_batches)
    group = next(n for n in range(pp, count + 1) if count % n == 0 or count % n >= pp)
    for chunk in model_chunks:
        chunk.config.microbatch_group_size_per_vp_stage = group
    return micro_batches


def run_megatron_schedule(
    model_chunks, micro_batches: list, loss_fn, forward_only: bool, before_forward=None, after_forward=None
) -> list:
    """Forward (and backward) the micro-batches (TensorDicts in the project layout) through
    megatron's schedule; returns the per-micro-batch dicts of `loss_fn(micro_batch, output) ->
    (loss, dict)` as seen on the last pipeline stage (empty elsewhere). `micro_batch` is a dict
    holding the tensors plus `_aligned`, its left-aligned form; `before_forward(micro_batch)`, when
    given, runs just before a chunk's forward on it (router replay sets its targets there), and
    `after_forward(micro_batch, chunk)` just after (the load-balancing loss closes its statistics)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_wrapper(micro_batch, output):
        loss, result = loss_fn(micro_batch, output)
        # megatron's (loss, num_tokens, reduced) form; calculate_per_token_loss keeps `loss` unscaled
        return loss, torch.ones((), dtype=torch.int), result

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        aligned = micro_batch["_aligned"]
        if before_forward is not None:
            before_forward(micro_batch)
        with compute_autocast(model):  # bf16 compute on fp32 parameters (verl.models.mcore.config)
            output = model(aligned.model_input_ids, aligned.model_position_ids, None)
        if after_forward is not None:
            after_forward(micro_batch, model)
        return output, partial(loss_wrapper, micro_batch)

    from verl.models.mcore.context_parallel import context_parallel_group

    if len(model_chunks) > 1:
        micro_batches = _interleavable(micro_batches, model_chunks)
    cp_group, cp_size, cp_rank = context_parallel_group()
    multiple = 2 * cp_size if cp_size > 1 else 1
    config = model_chunks[0].config
    if config.sequence_parallel:  # each rank's columns are split again over the tensor-parallel ranks
        multiple = math.lcm(multiple, cp_size * config.tensor_model_parallel_size)
    prepared = []
    for micro_batch in micro_batches:
        micro_batch = dict(micro_batch.to(get_device()).items())
        response_length = micro_batch["responses"].shape[-1]
        micro_batch["_aligned"] = left_align(
            micro_batch["input_ids"],
            micro_batch["attention_mask"],
            micro_batch["position_ids"],
            response_length,
            multiple_of=multiple,
        ).split_for_context_parallel(cp_group, cp_size, cp_rank)
        prepared.append(micro_batch)
    iterators = [iter(prepared) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=list(model_chunks),
        num_microbatches=len(prepared),
        seq_length=max(m["_aligned"].input_ids.shape[1] for m in prepared),
        micro_batch_size=max(m["_aligned"].input_ids.shape[0] for m in prepared),
        forward_only=forward_only,
    )


class MegatronPPOActor(PPOActor):
    """PPO/GRPO actor over this rank's megatron GPTModel chunks (one, or `vpp` with interleaving)."""

    config_class = McoreActorConfig

    def __init__(self, config, model_chunks: list, hf_config, actor_optimizer: torch.optim.Optimizer | None = None):
        if not isinstance(model_chunks, (list, tuple)):
            model_chunks = [model_chunks]
        super().__init__(config, actor_optimizer)
        self.model_chunks = list(model_chunks)
        self.hf_config = hf_config
        self._cfg = context_parallel_config(self._cfg)
        self.use_remove_padding = False  # rows are left-aligned and trimmed instead
        # every row runs whole (GPTModel takes no KV cache): reported, as the FSDP actor reports its path
        requested = self._cfg.share_prompt_forward
        self.shared_prompt_path = shared_prompt.speed_path(requested, self.model_chunks[0], False, None)
        speed_paths.report([self.shared_prompt_path])
        self._dp_group, self._dp_size = _dp_group_and_size()
        self.router_aux = MegatronRouterAuxLoss(self.model_chunks, hf_config, trains=actor_optimizer is not None)
        replay_mode = self._cfg.router_replay.mode
        self.router_replay = MegatronRouterReplay(self.model_chunks, replay_mode, trains=actor_optimizer is not None)
        self.flops = FlopsTally(FlopsCounter.for_model(hf_config))  # the chunks' config is megatron's, not HF's
        # multi-token prediction (model.mtp.enable_train): its loss joins the policy loss
        self.mtp = find_mtp_training(self.model_chunks) if actor_optimizer is not None else None

    # ------------------------------------------------------------------ forward

    def _micro_batch_outputs(self, micro_batch, temperature: float, calculate_entropy: bool, output):
        """(entropy or None, log_probs), both [B, R], from the last stage's logits `output`."""
        aligned = micro_batch["_aligned"]
        logits = output / temperature
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits, aligned.model_labels, self.hf_config.vocab_size, calculate_entropy
        )
        log_probs = response_columns(log_probs, aligned)
        return (response_columns(entropy, aligned) if calculate_entropy else None), log_probs

    def _run_schedule(self, micro_batches: list, loss_fn, forward_only: bool, normaliser: float | None = None) -> list:
        """Megatron's schedule with this actor's hooks: router replay's, and in a training pass
        (`normaliser` given) the load-balancing loss's."""
        replay = self.router_replay.before_forward if self.router_replay.enabled else None
        aux = self.router_aux if self.router_aux.enabled and normaliser is not None else None
        if aux is None:
            return run_megatron_schedule(self.model_chunks, micro_batches, loss_fn, forward_only, replay)

        def before_forward(micro_batch):
            if replay is not None:
                replay(micro_batch)
            mask = response_mask_of(micro_batch)
            aux.start(
                micro_batch,
                micro_batch_weight(
                    mask, self.loss_agg_mode, normaliser, self._dp_size, torch.zeros((), device=mask.device)
                ),
            )

        return run_megatron_schedule(
            self.model_chunks, micro_batches, loss_fn, forward_only, before_forward, aux.end_forward
        )

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def _log_probs_and_entropy(self, data, calculate_entropy: bool) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, R]} of the responses (with "entropy" [B, R], and the recorded
        `routed_experts` while router replay records), the same on every rank of the model-parallel
        group; `data.meta_info` as for `PPOActor.compute_log_prob_and_stats`."""
        for chunk in self.model_chunks:
            chunk.eval()
        meta = data.meta_info
        temperature = require_temperature(meta)
        replay = self.router_replay
        batch = self._with_multi_modal_rows(
            data, data.batch.select(*MODEL_INPUTS, *self._rollout_routing_keys(data.batch))
        )
        micro_batches, reverse_idx = split_micro_batches(
            batch,
            micro_batch_size=meta.get("micro_batch_size"),
            use_dynamic_bsz=bool(meta.get("use_dynamic_bsz", False)),
            max_token_len=per_rank_token_budget(meta.get("max_token_len")),
            dp_group=self._dp_group,
        )

        def loss_fn(micro_batch, output):
            entropy, log_probs = self._micro_batch_outputs(micro_batch, temperature, calculate_entropy, output)
            result = {"log_probs": log_probs, "entropy": entropy}
            if replay.recording and not replay.pipelined:  # over pipeline stages: collected after the schedule
                result[ROUTED_EXPERTS] = replay.recorded(micro_batch)
            return output.new_zeros(()), result

        results = broadcast_from_last_stage(self._run_schedule(micro_batches, loss_fn, forward_only=True))
        outputs = {"log_probs": torch.cat([r["log_probs"] for r in results], dim=0)}
        if calculate_entropy:
            outputs["entropy"] = torch.cat([r["entropy"] for r in results], dim=0)
        if replay.recording and replay.pipelined:  # every stage records its own MoE layers
            outputs[ROUTED_EXPERTS] = replay.pipeline_recorded(outputs["log_probs"].device)
        elif replay.recording:
            outputs[ROUTED_EXPERTS] = torch.cat([r[ROUTED_EXPERTS] for r in results], dim=0)
        if reverse_idx is not None:
            outputs = {k: v[reverse_idx.to(v.device)] for k, v in outputs.items()}
        return outputs

    def compute_log_prob_and_stats(self, data, stats: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict]:
        """See `PPOActor.compute_log_prob_and_stats`; this backend computes the `entropy` statistic only.
        With `router_replay.mode=R2` the dict also holds `routed_experts` [B, S, num_moe_layers,
        top_k], the routing of this pass; with R3 the pass replays the batch's `routed_experts`, the
        rollout's (`verl.models.mcore.router_replay`)."""
        unsupported = [name for name in stats if name != "entropy"]
        if unsupported:
            raise NotImplementedError(
                f"the megatron actor cannot compute {unsupported} (its logits are split over tensor-parallel "
                "ranks); actor.calculate_sum_pi_squared (for adv_estimator=optimal_token_baseline) needs "
                "actor_rollout_ref.actor.strategy=fsdp"
            )
        if self.router_replay.enabled:
            self.router_replay.start_old_log_prob_pass()
        try:
            outputs = self._log_probs_and_entropy(data, calculate_entropy="entropy" in stats)
        finally:
            self.router_replay.stop()
        return outputs.pop("log_probs"), outputs

    # ------------------------------------------------------------------ training

    def _set_train_mode(self) -> None:
        for chunk in self.model_chunks:
            chunk.train()

    def _training_keys(self, batch) -> list[str]:
        """The FSDP actor's keys, and with router replay the recorded `routed_experts`: required
        whenever old log-probs come with the batch (without them the update is strictly on-policy,
        its own forward is the only one, and there is nothing to replay)."""
        keys = super()._training_keys(batch)
        if self.router_replay.replays_rollout_routing:
            return [*keys, *self._rollout_routing_keys(batch)]
        if not self.router_replay.enabled or "old_log_probs" not in keys:
            return keys
        if ROUTED_EXPERTS not in batch:
            raise KeyError(
                f"actor.router_replay.mode={self.router_replay.mode} replays the routing recorded by the old-log-prob "
                f"pass (compute_log_prob), but the batch has old_log_probs and no {ROUTED_EXPERTS}: they came from "
                "elsewhere (the rollout's log-probs under rollout correction's bypass mode or an async tis source); "
                "let the actor recompute them or set actor.router_replay.mode=disabled"
            )
        return [*keys, ROUTED_EXPERTS]

    def _rollout_routing_keys(self, batch) -> list[str]:
        """[`routed_experts`] under R3, whose every forward replays the rollout's routing; else []."""
        if not self.router_replay.replays_rollout_routing:
            return []
        if ROUTED_EXPERTS not in batch:
            raise KeyError(
                f"actor.router_replay.mode=R3 replays the routing the rollout engine recorded, but the batch has no "
                f"{ROUTED_EXPERTS}: generate with actor_rollout_ref.rollout.enable_rollout_routing_replay=true (the "
                "built-in engine, rollout.name=hf), or set actor.router_replay.mode=R2"
            )
        return [ROUTED_EXPERTS]

    def _train_and_step(self, micro_batches: list, temperature: float, normaliser: float, metrics: dict):
        """Megatron's schedule over the micro-batches, then gradient reduction, clipping and the step.
        The last stage's metrics come to the host together with the gradient norm (one wait for the
        device), then go to the other stages."""
        for micro_batch in micro_batches:  # every row whole: no shared-prompt path on this backend
            self.flops.add(micro_batch["attention_mask"], micro_batch["responses"].shape[-1])
        if ROUTED_EXPERTS in micro_batches[0]:
            self.router_replay.start_replaying()
        try:
            loss_fn = partial(
                self._policy_loss, temperature=temperature, normaliser=normaliser, num_micro_batches=len(micro_batches)
            )
            results = self._run_schedule(micro_batches, loss_fn, False, normaliser)
        finally:
            self.router_replay.stop()
        finalize_megatron_grads(self.model_chunks)
        grad_norm = clip_grads_megatron(self.model_chunks, self.grad_clip)
        *results, step = metrics_to_host([*results, {"grad_norm": grad_norm}])
        for micro_metrics in broadcast_from_last_stage(results):
            append_to_dict(metrics, micro_metrics)
        return step["grad_norm"], step_if_finite(self.actor_optimizer, step["grad_norm"])

    def _policy_loss(self, micro_batch, output, temperature: float, normaliser: float, num_micro_batches: int = 1):
        """(scaled loss, metrics) of one micro-batch: the FSDP actor's loss, weighted the same way, plus
        the multi-token-prediction loss when the model trains its MTP layers."""
        entropy, log_prob = self._micro_batch_outputs(micro_batch, temperature, self.needs_entropy(micro_batch), output)
        aux_loss = self.router_aux.loss(micro_batch)
        aux_coef = self.router_aux.coef if aux_loss is not None else 0.0
        loss, metrics = self._micro_batch_loss(micro_batch, log_prob, entropy, normaliser, aux_loss, aux_coef)
        if self.mtp is not None:
            loss = loss + self._mtp_loss(micro_batch, num_micro_batches, metrics)
        return loss, metrics

    def _mtp_loss(self, micro_batch, num_micro_batches: int, metrics: dict) -> torch.Tensor:
        """`mtp_loss_scaling_factor` x the mean over depths of each depth's mean cross-entropy on this
        micro-batch, divided by the mini-batch's micro-batch count (upstream's weighting; the
        data-parallel average of the gradients then averages over ranks), see `verl.models.mcore.mtp`.
        Each depth's unscaled mean is logged as upstream names it, `mtp_losses/mtp_{k}_loss`."""
        logits = self.mtp.take_logits()
        if not logits:
            raise RuntimeError("the training forward ran no MTP layers, though the model trains them")
        aligned = micro_batch["_aligned"]
        means = mtp_loss(
            logits,
            aligned.labels,
            aligned.response_index,
            response_mask_of(micro_batch),
            self.hf_config.vocab_size,
            local=aligned.local,
            full=aligned.full,
        )
        for depth, mean in enumerate(means, start=1):
            metrics[f"mtp_losses/mtp_{depth}_loss"] = mean.detach()
        return self.mtp.scaling_factor / len(means) * torch.stack(means).sum() / num_micro_batches
