"""The PPO actor on a data-parallel (FSDP2) model, free of Ray: log-probs and policy updates.

`DataParallelPPOActor(config, actor_module, actor_optimizer=None)` works on any HF causal LM
module: an FSDP2-sharded one inside a worker, or a plain module in one process (tests, scripts).
The worker owns the model, optimizer and lr scheduler; this class owns the training loop.

Batch semantics (upstream's): `ppo_mini_batch_size` arrives already normalised by the worker to
samples per rank per optimizer step; each mini-batch is cut into micro-batches of
`ppo_micro_batch_size_per_gpu` samples, or, with `use_dynamic_bsz`, into micro-batches of at most
`ppo_max_token_len_per_gpu` tokens, balanced by Karmarkar-Karp and equal in number on every rank.
Gradients accumulate over the micro-batches; each mini-batch ends with gradient clipping
(`grad_clip`) and one optimizer step; `ppo_epochs` passes go over the data. How micro-batch
losses are weighted so the split never changes the gradient: see `verl.workers.dp_training`.

Forward: logits are divided by the sampling temperature in place before the log-softmax, exactly
as the rollout engines do, so `old_log_probs` and the rollout's log-probs agree.
`use_remove_padding` packs the micro-batch's real tokens into one sequence (see
`verl.utils.remove_padding`); results equal the padded path to float rounding.
`share_prompt_forward` (default True) runs each distinct prompt of a micro-batch once and the
responses on its KV cache (see `verl.utils.shared_prompt`): GRPO repeats every prompt
`rollout.n` times, so this removes most prompt tokens from the forward and backward passes. With
`use_remove_padding` it is taken in its packed layout (no padding either), where that layout is
available (SDPA or eager attention, a bounded mask), and the remove-padding path runs otherwise.

Two guarded steps:
* a non-finite gradient norm skips the optimizer step (gradients cleared), reported as
  `actor/skipped_nonfinite_grad` (1.0 per skipped step, 0.0 otherwise; its mean is the fraction);
* `skip_zero_advantage_step` (default True): when every advantage of a mini-batch is zero on all
  ranks and no KL loss or entropy bonus is used, the gradient is exactly zero, yet AdamW would
  still move the weights (momentum and weight decay). Such mini-batches are skipped without a
  forward pass, reported as `actor/skipped_zero_adv`. GRPO groups whose samples all score the
  same produce exactly this.

`skip_zero_advantage_rows` (default True) applies the same reasoning to single rows: with a
policy loss in which a zero advantage makes the row's loss exactly zero (`vanilla`, `gspo`,
`gpg`), no KL loss and no entropy bonus, a row whose advantages are all zero adds nothing to the
gradient, so it is left out of the forward and backward passes. The loss normaliser is still
taken over the whole mini-batch, so the gradient is the one of the full mini-batch (to float
rounding). Ranks must run equally many micro-batches (FSDP's collectives): a rank with fewer rows
to train splits them into as many micro-batches as the busiest rank, keeping back some of its
zero-advantage rows where it has too few (they add zero). Reported as `actor/zero_adv_rows_skipped`
(the fraction of rows left out); `actor/pg_clipfrac`, `actor/ppo_kl` and the on-policy
`actor/entropy` then describe the trained rows. GRPO groups whose samples all score the same
(every group of a problem the model always or never solves) are such rows: about a third of the
bundled task's groups at the start.

Host syncs: the per-micro-batch metrics stay 0-d device tensors and come to the host once per
mini-batch, together with the gradient norm that decides the step (`metrics_to_host`); the
mini-batch's loss normaliser and agreement counts are reduced on the host where the group has a
CPU backend. `flops` tallies the model FLOPs of the micro-batches `update_policy` runs, as they
run (shared prompts once, skipped rows not at all; see `verl.utils.flops_counter`), for the
worker's `perf/mfu/actor`.

Rollout correction: `rollout_is_weights` in the batch (decoupled mode, computed by the trainer)
multiply each token's policy loss; with `rollout_log_probs` in the batch every micro-batch also
reports the current policy's gap to the rollout (`rollout_corr/*`, as upstream); bypass mode is the
`bypass_mode` policy loss (see `verl.algorithms.rollout_corr`).

Config keys read (the `actor_rollout_ref.actor` section; DictConfig, dataclass or dict):
ppo_mini_batch_size, ppo_micro_batch_size_per_gpu, use_dynamic_bsz, ppo_max_token_len_per_gpu,
ppo_epochs, shuffle, data_loader_seed (the shuffle's seed), grad_clip or optim.clip_grad
(`verl.utils.optim.grad_clip`), clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c,
tis_imp_ratio_cap, tau_pos, tau_neg (sapo), loss_scale_factor (seq-mean-token-sum-norm's length,
for every term of the loss), calculate_entropy (compute and report `actor/entropy` during the
update even without an entropy bonus), policy_loss {loss_mode, clip_cov_*, kl_cov_ratio,
ppo_kl_coef, rollout_correction}, loss_agg_mode (replaced by the loss's own for `sapo` and
`geo_mean`, with a warning: `verl.algorithms.policy_losses.LOSS_AGG_MODE_OVERRIDES`), entropy_coeff, use_kl_loss,
kl_loss_coef, kl_loss_type, use_remove_padding,
ulysses_sequence_parallel_size (must be 1), skip_zero_advantage_step, skip_zero_advantage_rows,
share_prompt_forward. `use_torch_compile` is
accepted and has no effect: the log-prob and entropy kernels are chunked autograd functions that
already bound memory, and compiling them gains little. compute_log_prob reads its micro-batching
from `data.meta_info` (`micro_batch_size`, `use_dynamic_bsz`, `max_token_len`, `temperature`), as
upstream's worker passes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from verl.algorithms.aggregation import agg_loss
from verl.algorithms.kl import kl_penalty
from verl.algorithms.policy_losses import LOSS_AGG_MODE_OVERRIDES, PolicyLossParams, get_policy_loss_fn
from verl.algorithms.rollout_corr import compute_rollout_corr_metrics_from_logprobs
from verl.utils import shared_prompt, speed_paths, ulysses
from verl.utils.device import collective_device, get_device
from verl.utils.flops_counter import FlopsCounter, FlopsTally
from verl.utils.hf_forward import model_forward
from verl.utils.logging_utils import get_logger
from verl.utils.optim import grad_clip
from verl.utils.remove_padding import pad_input, unpad_input, unpad_position_ids
from verl.utils.seqlen_balancing import num_micro_batches_for_budget
from verl.utils.shared_prompt import prompt_groups, shared_prompt_logits
from verl.utils.torch_functional import (
    entropy_from_logits_with_chunking,
    logprobs_from_logits,
    sum_pi_squared_from_logits,
)
from verl.workers.actor.base import BasePPOActor
from verl.workers.dp_training import (
    append_to_dict,
    clip_grad_norm,
    config_to_dict,
    dp_group_and_size,
    loss_normaliser,
    metrics_to_host,
    micro_batch_weight,
    pad_response_columns,
    response_mask_of,
    split_micro_batches,
    step_if_finite,
    token_window,
)

__all__ = ["TOKEN_STATS", "DataParallelPPOActor"]

logger = get_logger(__name__, "INFO")

# policy losses whose per-row loss is exactly zero when the row's advantages are (see the module docstring)
ROW_SEPARABLE_LOSSES = ("vanilla", "gspo", "gpg", "cispo", "sapo")

TOKEN_STATS = {"entropy": entropy_from_logits_with_chunking, "sum_pi_squared": sum_pi_squared_from_logits}
"""Per-token statistics of the (temperature-scaled) logits [..., V] -> [...] the forward can return
beside the log-probs: `entropy` (differentiable) and `sum_pi_squared` (sum_v p_v^2, for the
optimal token baseline; no gradient)."""


def skips_zero_advantage_rows(actor_cfg) -> bool:
    """Whether an actor with this config (`actor_rollout_ref.actor`: DictConfig or dict) leaves
    zero-advantage rows out of its update: switched on, a row-separable policy loss, and no KL
    loss or entropy bonus that would give such rows a gradient of their own."""
    policy_loss = actor_cfg.get("policy_loss") or {}
    return (
        bool(actor_cfg.get("skip_zero_advantage_rows", True))
        and policy_loss.get("loss_mode", "vanilla") in ROW_SEPARABLE_LOSSES
        and not actor_cfg.get("use_kl_loss", False)
        and not float(actor_cfg.get("entropy_coeff", 0.0) or 0.0)
    )


def rows_with_advantage(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows with a nonzero advantage on some response token (the rows an actor that
    `skips_zero_advantage_rows` trains)."""
    return ((advantages != 0) & (response_mask != 0)).any(dim=-1)


_MODEL_INPUTS = ["responses", "input_ids", "attention_mask", "position_ids"]


def _require_temperature(meta_info: dict) -> float:
    if "temperature" not in meta_info:
        raise KeyError(
            "data.meta_info['temperature'] is missing: set it to the rollout's sampling temperature "
            "(actor_rollout_ref.rollout.temperature); log-probs must be computed at the temperature the "
            "responses were sampled with"
        )
    temperature = float(meta_info["temperature"])
    if temperature <= 0:
        raise ValueError(
            f"temperature={temperature} in data.meta_info: log-probs need a positive sampling temperature "
            "(greedy decoding has no log-probs to train on; use 1.0 for training rollouts)"
        )
    return temperature


class DataParallelPPOActor(BasePPOActor):
    """PPO/GRPO actor over an HF causal LM (FSDP2-sharded or plain)."""

    def __init__(
        self,
        config,
        actor_module: torch.nn.Module,
        actor_optimizer: torch.optim.Optimizer | None = None,
        ulysses_group=None,
    ):
        """`ulysses_group`: the process group of this rank's sequence-parallel peers, needed when
        `ulysses_sequence_parallel_size` > 1 (see `verl.utils.ulysses`)."""
        super().__init__(config)
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        cfg = config_to_dict(config)
        self._cfg = cfg
        self.use_remove_padding = bool(cfg.get("use_remove_padding", False))
        # a peft model forwards its keyword arguments to the HF model it wraps: ask that one
        hf_module = actor_module.get_base_model() if hasattr(actor_module, "get_base_model") else actor_module
        self.sp_size = ulysses.setup(
            "actor", cfg, getattr(hf_module, "config", None), self.use_remove_padding, ulysses_group
        )
        self._sp_group = ulysses_group
        forward = model_forward(hf_module)
        self._accepts_logits_to_keep = forward.accepts_logits_to_keep
        self._hf_module = hf_module
        self._attn_implementation = getattr(getattr(hf_module, "config", None), "_attn_implementation", None)
        # whether the shared-prompt path can run at all, and why not (reported, never silent)
        self.shared_prompt_path = shared_prompt.speed_path(
            bool(cfg.get("share_prompt_forward", True)), hf_module, self.use_remove_padding, self._attn_implementation
        )
        speed_paths.report([self.shared_prompt_path])
        # on even when the path is off for updates only (gradient checkpointing): log-probs still share
        self.share_prompt_forward = self.shared_prompt_path.requested and forward.cache_argument is not None
        # the shared-prompt forward has no sequence-parallel form: sp > 1 runs every row in full
        self.share_prompt_forward = self.share_prompt_forward and self.sp_size == 1
        policy_loss_cfg = cfg.get("policy_loss") or {}
        self.loss_mode = policy_loss_cfg.get("loss_mode", "vanilla")
        self.loss_agg_mode = self._effective_loss_agg_mode(cfg.get("loss_agg_mode", "token-mean"))
        self.policy_loss_fn = get_policy_loss_fn(self.loss_mode)
        self.policy_loss_params = PolicyLossParams.from_actor_config(cfg)
        self.loss_scale_factor = self.policy_loss_params.loss_scale_factor
        self.entropy_coeff = float(cfg.get("entropy_coeff", 0.0) or 0.0)
        self.calculate_entropy = bool(cfg.get("calculate_entropy", False))
        self.grad_clip = grad_clip(cfg, "actor_rollout_ref.actor")
        self.use_kl_loss = bool(cfg.get("use_kl_loss", False))
        self.kl_loss_coef = float(cfg.get("kl_loss_coef", 0.001))
        self.kl_loss_type = cfg.get("kl_loss_type", "low_var_kl")
        self.skip_zero_advantage_step = bool(cfg.get("skip_zero_advantage_step", True))
        self.skip_zero_advantage_rows = skips_zero_advantage_rows(cfg)
        self._shuffle_generator = torch.Generator().manual_seed(int(cfg.get("data_loader_seed", 0) or 0))
        self._dp_group, self._dp_size = dp_group_and_size(actor_module)
        # FSDP2 units gather and reduce per forward call: ranks must then agree on the calls they make
        self._calls_are_collective = isinstance(actor_module, FSDPModule) and self._dp_size > 1
        # with frozen weights (LoRA) the backward computes no weight gradients for them: the work of 2
        # forwards instead of 3 (any frozen parameter counts as such, so the count never exceeds the work)
        frozen = any(not p.requires_grad for p in actor_module.parameters())
        self.flops = FlopsTally(FlopsCounter.for_model(getattr(hf_module, "config", None)), passes=2 if frozen else 3)

    def _effective_loss_agg_mode(self, configured: str) -> str:
        """The aggregation the whole loss uses: the configured one, unless the policy loss fixes its
        own (`LOSS_AGG_MODE_OVERRIDES`); then every term follows it, so micro-batches stay weighted
        consistently (see verl.workers.dp_training), and the replacement is logged."""
        fixed = LOSS_AGG_MODE_OVERRIDES.get(self.loss_mode)
        if fixed is None or fixed == configured:
            return configured
        logger.warning(
            f"actor.policy_loss.loss_mode={self.loss_mode} aggregates its loss {fixed} (as upstream), so "
            f"actor.loss_agg_mode={configured} is replaced by {fixed} for the whole actor loss"
        )
        return fixed

    # ------------------------------------------------------------------ forward

    def _forward_micro_batch(
        self, micro_batch, temperature: float, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(entropy [B, R] or None, log_probs [B, R]) of the responses in `micro_batch`."""
        stats, log_probs = self._forward_with_stats(micro_batch, temperature, ("entropy",) if calculate_entropy else ())
        return stats.get("entropy"), log_probs

    def _forward_with_stats(
        self, micro_batch, temperature: float, stats: tuple[str, ...] = ()
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({name: [B, R]} for each `TOKEN_STATS` name in `stats`, log_probs [B, R]) of the
        responses in `micro_batch`."""
        input_ids = micro_batch["input_ids"]
        batch_size, seqlen = input_ids.shape
        response_length = micro_batch["responses"].shape[-1]
        # Columns that are padding in every row are left out (see `token_window`).
        start, end, kept = token_window(micro_batch["attention_mask"], response_length)
        shared = self._share_prompts(micro_batch, response_length, start)
        if self.actor_module.training:  # the work the update ran (see verl.utils.flops_counter)
            self.flops.add(micro_batch["attention_mask"], response_length, None if shared is None else shared[:2])
        if shared is not None:
            first_rows, inverse, layout = shared
            first_logits, rest_logits, packed = shared_prompt_logits(
                self.actor_module,
                input_ids,
                micro_batch["attention_mask"],
                micro_batch["position_ids"],
                response_length,
                first_rows,
                inverse,
                start=start,
                kept=kept,
                accepts_logits_to_keep=self._accepts_logits_to_keep,
                attn_implementation=self._attn_implementation,
                layout=layout,
            )
            if packed is not None:
                return self._packed_response_outputs(
                    first_logits, rest_logits, packed, micro_batch["responses"], temperature, stats
                )
            return self._response_outputs(
                [first_logits[:, None, :], rest_logits], micro_batch["responses"], temperature, stats
            )
        if self.use_remove_padding:
            packed_ids, indices = unpad_input(input_ids, micro_batch["attention_mask"])
            packed_pos = unpad_position_ids(micro_batch["position_ids"], indices)
            if self.sp_size > 1:
                return self._sp_packed_outputs(packed_ids, packed_pos, indices, micro_batch, temperature, stats)
            logits = self.actor_module(input_ids=packed_ids, position_ids=packed_pos, use_cache=False).logits[0]
            logits.div_(temperature)
            # label of each packed position = the next packed token; it is wrong only at a sequence's
            # last token, whose prediction is never a (valid) response token
            labels = torch.roll(packed_ids[0], shifts=-1)
            log_probs = pad_input(logprobs_from_logits(logits, labels), indices, batch_size, seqlen)
            log_probs = log_probs[:, -response_length - 1 : -1]
            out = {}
            for name in stats:
                values = pad_input(TOKEN_STATS[name](logits), indices, batch_size, seqlen)
                out[name] = values[:, -response_length - 1 : -1]
            return out, log_probs
        # Only the last R + 1 positions predict response tokens: skip the LM head everywhere else
        # (a large saving for real vocabularies, e.g. 152k for Qwen2.5).
        keep = {"logits_to_keep": kept + 1} if self._accepts_logits_to_keep else {}
        output = self.actor_module(
            input_ids=input_ids[:, start:end],
            attention_mask=micro_batch["attention_mask"][:, start:end],
            position_ids=micro_batch["position_ids"][:, start:end],
            use_cache=False,
            **keep,
        )
        return self._response_outputs(
            [output.logits[:, -kept - 1 : -1, :]], micro_batch["responses"], temperature, stats
        )

    def _sp_packed_outputs(self, packed_ids, packed_pos, indices, micro_batch, temperature, stats):
        """`_forward_with_stats`'s remove-padding branch with the packed tokens split across the
        Ulysses group; gradients scaled by sp for FSDP's average over the dp x sp ranks."""
        batch_size, seqlen = micro_batch["input_ids"].shape
        response_length = micro_batch["responses"].shape[-1]
        fns = {name: TOKEN_STATS[name] for name in stats}
        log_probs, values = ulysses.packed_forward(
            self.actor_module, packed_ids, packed_pos, self._sp_group, temperature, fns, grad_scale=self.sp_size
        )

        def place(packed):
            return pad_input(packed, indices, batch_size, seqlen)[:, -response_length - 1 : -1]

        return {name: place(v) for name, v in values.items()}, place(log_probs)

    @staticmethod
    def _response_outputs(logit_parts, responses, temperature: float, stats: tuple[str, ...]):
        """({stat: [B, R]}, log_probs [B, R]) from logits [B, k_i, V] of consecutive response columns."""
        response_length = responses.shape[-1]
        log_probs, parts, col = [], {name: [] for name in stats}, 0
        for logits in logit_parts:
            width = logits.shape[1]
            if width == 0:
                continue
            logits.div_(temperature)
            log_probs.append(logprobs_from_logits(logits, responses[:, col : col + width]))
            for name in stats:
                parts[name].append(TOKEN_STATS[name](logits))
            col += width
        log_probs = pad_response_columns(torch.cat(log_probs, dim=1), response_length)
        out = {name: pad_response_columns(torch.cat(values, dim=1), response_length) for name, values in parts.items()}
        return out, log_probs

    @staticmethod
    def _packed_response_outputs(first_logits, rest_logits, packed, responses, temperature: float, stats):
        """({stat: [B, R]}, log_probs [B, R]) from the shared-prompt pass's packed layout
        (`first_logits` [B, V], `rest_logits` [U, width, V]; see `verl.utils.shared_prompt`).
        Response columns the packed pass does not predict (padding) are 0."""
        batch_size, response_length = responses.shape
        first_logits.div_(temperature)
        rest_logits.div_(temperature)
        at = (packed.group, packed.slot)
        labels = torch.zeros(rest_logits.shape[:2], dtype=torch.long, device=responses.device)
        labels = labels.index_put(at, responses[packed.row, packed.col].long())
        rows = torch.cat([torch.arange(batch_size, device=responses.device), packed.row])
        cols = torch.cat([packed.col.new_zeros(batch_size), packed.col])

        def place(first, rest):
            values = torch.cat([first, rest[at]])
            return values.new_zeros((batch_size, response_length)).index_put((rows, cols), values)

        log_probs = place(
            logprobs_from_logits(first_logits, responses[:, 0]), logprobs_from_logits(rest_logits, labels)
        )
        return {
            name: place(TOKEN_STATS[name](first_logits), TOKEN_STATS[name](rest_logits)) for name in stats
        }, log_probs

    def _share_prompts(self, micro_batch, response_length: int, start: int):
        """(first_rows, inverse, layout) when this micro-batch takes the shared-prompt path, else None.

        Worth it when at most half the rows have distinct prompts (GRPO's rollout.n copies). With
        `use_remove_padding` the path is taken only in its packed layout (no padding anywhere, like
        the remove-padding path, which would recompute every prompt for each of its rows), so
        `layout` is that layout; otherwise `layout` is "auto" (`shared_prompt_logits` picks). Under
        FSDP2 every rank must make the same number of forward calls, so the choice is agreed over
        the data-parallel group: any rank that gains makes all take the path (exact whatever the
        grouping), unless a rank that must pack cannot. With gradient checkpointing in training HF
        drops the KV cache, so the plain path runs then.
        """
        if not self.share_prompt_forward:
            return None
        if self.actor_module.training and any(
            getattr(m, "gradient_checkpointing", False) for m in self._hf_module.modules()
        ):
            return None
        input_ids = micro_batch["input_ids"]
        attention_mask = micro_batch["attention_mask"]
        position_ids = micro_batch["position_ids"]
        if position_ids.dim() != 2:  # multi-dimensional (mrope) position ids: the same on every rank
            return None
        prompt_end = input_ids.shape[1] - response_length
        first_rows, inverse = prompt_groups(input_ids, attention_mask, position_ids, prompt_end)
        gains = 2 * len(first_rows) <= len(input_ids)
        layout = "auto"
        if self.use_remove_padding:
            layout = shared_prompt.packed_response_layout(
                attention_mask[:, prompt_end:],
                inverse,
                len(first_rows),
                prompt_width=prompt_end - start,
                padded_positions=None,  # compared with the remove-padding path instead: always cheaper
                attn_implementation=self._attn_implementation,
            )
        cannot_pack = self.use_remove_padding and layout is None
        if self._calls_are_collective:
            flags = torch.tensor([float(gains), float(cannot_pack)], device=input_ids.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._dp_group)
            gains, cannot_pack = bool(flags[0] > 0), bool(flags[1] > 0)
        if not gains or cannot_pack:
            return None
        return first_rows, inverse, layout

    # ------------------------------------------------------------------ inference

    def compute_log_prob(self, data, calculate_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, R] of the responses (and entropies [B, R] when `calculate_entropy`).

        `data.meta_info` gives `temperature`, `micro_batch_size` (or `use_dynamic_bsz` +
        `max_token_len`). Every rank must call it with the same number of samples.
        """
        log_probs, stats = self.compute_log_prob_and_stats(data, ("entropy",) if calculate_entropy else ())
        return log_probs, stats.get("entropy")

    @torch.no_grad()
    def compute_log_prob_and_stats(self, data, stats: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict]:
        """(log-probs [B, R], {name: [B, R]}) for each `TOKEN_STATS` name in `stats` (`entropy`,
        `sum_pi_squared`); `data.meta_info` as for `compute_log_prob`."""
        unknown = [name for name in stats if name not in TOKEN_STATS]
        if unknown:
            raise ValueError(f"unknown per-token statistics {unknown}; available: {sorted(TOKEN_STATS)}")
        self.actor_module.eval()
        meta = data.meta_info
        temperature = _require_temperature(meta)
        batch = data.batch.select(*_MODEL_INPUTS)
        micro_batches, reverse_idx = split_micro_batches(
            batch,
            micro_batch_size=meta.get("micro_batch_size"),
            use_dynamic_bsz=bool(meta.get("use_dynamic_bsz", False)),
            max_token_len=meta.get("max_token_len"),
            dp_group=self._dp_group,
        )
        log_probs, parts = [], {name: [] for name in stats}
        for micro_batch in micro_batches:
            values, log_prob = self._forward_with_stats(micro_batch.to(get_device()), temperature, tuple(stats))
            log_probs.append(log_prob)
            for name in stats:
                parts[name].append(values[name])
        log_probs = torch.cat(log_probs, dim=0)
        out = {name: torch.cat(values, dim=0) for name, values in parts.items()}
        if reverse_idx is not None:
            log_probs = log_probs[reverse_idx.to(log_probs.device)]
            out = {name: values[reverse_idx.to(values.device)] for name, values in out.items()}
        return log_probs, out

    # ------------------------------------------------------------------ training

    def _training_keys(self, batch) -> list[str]:
        present = set(batch.keys())
        # Without old_log_probs the update is strictly on-policy: the current log-probs, detached,
        # stand in for them (see `update_policy`).
        keys = [*_MODEL_INPUTS, *(["old_log_probs"] if "old_log_probs" in present else []), "advantages"]
        missing = [k for k in keys if k not in present]
        if self.use_kl_loss:
            keys.append("ref_log_prob")
            if "ref_log_prob" not in present:
                missing.append("ref_log_prob (actor.use_kl_loss is on: compute reference log-probs first)")
        if missing:
            raise KeyError(f"update_policy needs batch keys {missing}; the batch has {sorted(present)}")
        keys += [k for k in ("response_mask", "rollout_log_probs", "rollout_is_weights") if k in present]
        return keys

    def update_policy(self, data) -> dict[str, list[float]]:
        """PPO epochs x mini-batches x micro-batches on `data`; returns metric lists (the worker reduces).

        Metrics: actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl,
        actor/entropy (entropy_coeff != 0), actor/kl_loss + actor/kl_coef (use_kl_loss) per
        micro-batch; actor/grad_norm, actor/lr, actor/skipped_nonfinite_grad, actor/skipped_zero_adv
        per mini-batch.
        """
        if self.actor_optimizer is None:
            raise RuntimeError("this actor was built without an optimizer (a reference policy?); it cannot be updated")
        self.actor_module.train()
        temperature = _require_temperature(data.meta_info)
        batch = data.batch.select(*self._training_keys(data.batch))
        mini_batch_size = int(self._cfg.get("ppo_mini_batch_size") or 0)
        if mini_batch_size <= 0 or len(batch) % mini_batch_size != 0:
            raise ValueError(
                f"this rank holds {len(batch)} samples, which is not a positive multiple of the per-rank "
                f"ppo_mini_batch_size={mini_batch_size} (ppo_mini_batch_size * rollout.n / data-parallel size); "
                "make data.train_batch_size a multiple of actor.ppo_mini_batch_size"
            )
        epochs = int(self._cfg.get("ppo_epochs", 1) or 1)
        if "old_log_probs" not in batch and (epochs > 1 or len(batch) > mini_batch_size):
            raise KeyError(
                "update_policy got no old_log_probs, which is only valid for a strictly on-policy update "
                f"(one PPO epoch and one mini-batch), but ppo_epochs={epochs} and this rank has {len(batch)} samples "
                f"in mini-batches of {mini_batch_size}; compute old log-probs first (compute_log_prob)"
            )
        metrics: dict[str, list[float]] = {}
        self.flops.reset()
        for _ in range(epochs):
            epoch_batch = batch
            if self._cfg.get("shuffle", False):
                epoch_batch = batch[torch.randperm(len(batch), generator=self._shuffle_generator)]
            for mini_batch in epoch_batch.split(mini_batch_size):
                self._update_on_mini_batch(mini_batch, temperature, metrics)
        self.actor_optimizer.zero_grad()
        return metrics

    def _update_on_mini_batch(self, mini_batch, temperature: float, metrics: dict) -> None:
        response_mask = response_mask_of(mini_batch)
        adv_nonzero = rows_with_advantage(mini_batch["advantages"], response_mask).any().to(torch.float64)
        # the mini-batch is on the host, and so is this reduction where the group allows it (no device sync)
        totals = torch.stack([loss_normaliser(response_mask, self.loss_agg_mode), adv_nonzero])
        if self._dp_size > 1:
            totals = totals.to(collective_device(self._dp_group))
            dist.all_reduce(totals, group=self._dp_group)
        normaliser, num_ranks_with_adv = totals.tolist()
        only_pg_loss = not self.use_kl_loss and self.entropy_coeff == 0
        if self.skip_zero_advantage_step and only_pg_loss and num_ranks_with_adv == 0:
            append_to_dict(metrics, {"actor/skipped_zero_adv": 1.0})
            return

        use_dynamic_bsz = bool(self._cfg.get("use_dynamic_bsz", False))
        num_micro = None
        if self.skip_zero_advantage_rows:
            rows = len(mini_batch)
            mini_batch, num_micro = self._rows_with_advantage(mini_batch, response_mask, use_dynamic_bsz)
            append_to_dict(metrics, {"actor/zero_adv_rows_skipped": 1.0 - len(mini_batch) / rows})
        if num_micro is not None:  # as many micro-batches as the busiest rank, each within the size limit
            base, extra = divmod(len(mini_batch), num_micro)
            micro_batches = list(mini_batch.split([base + (i < extra) for i in range(num_micro)]))
        else:
            micro_batches, _ = split_micro_batches(
                mini_batch,
                micro_batch_size=self._cfg.get("ppo_micro_batch_size_per_gpu"),
                use_dynamic_bsz=use_dynamic_bsz,
                max_token_len=self._cfg.get("ppo_max_token_len_per_gpu"),
                dp_group=self._dp_group,
            )
        self.actor_optimizer.zero_grad()
        grad_norm, stepped = self._train_and_step(micro_batches, temperature, normaliser, metrics)
        append_to_dict(
            metrics,
            {
                "actor/grad_norm": grad_norm,
                "actor/lr": float(self.actor_optimizer.param_groups[0]["lr"]),
                "actor/skipped_nonfinite_grad": 0.0 if stepped else 1.0,
                "actor/skipped_zero_adv": 0.0,
            },
        )

    def _train_and_step(self, micro_batches: list, temperature: float, normaliser: float, metrics: dict):
        """Forward and backward every micro-batch of one mini-batch, then clip and step: (grad norm,
        whether the optimizer stepped). The one part another backend's actor replaces.

        The micro-batches' metrics stay on the device until the gradient norm is known; both come to
        the host in one copy, the mini-batch's only wait for the device in this loop."""
        micro_metrics = []
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(get_device())
            micro_metrics.append(self._backward_micro_batch(micro_batch, temperature, normaliser))
        grad_norm = clip_grad_norm(self.actor_module, self.grad_clip)
        *micro_metrics, step = metrics_to_host([*micro_metrics, {"grad_norm": grad_norm}])
        for micro in micro_metrics:
            append_to_dict(metrics, micro)
        return step["grad_norm"], step_if_finite(self.actor_optimizer, step["grad_norm"])

    def _rows_with_advantage(self, mini_batch, response_mask: torch.Tensor, use_dynamic_bsz: bool):
        """The rows of `mini_batch` with a nonzero advantage on some response token, in order, and the
        number of fixed-size micro-batches every rank runs (None with use_dynamic_bsz, whose split
        equalises the count itself). Zero-advantage rows are kept back where a rank would otherwise
        have fewer rows than the busiest rank has micro-batches."""
        keep = rows_with_advantage(mini_batch["advantages"], response_mask)
        kept = int(keep.sum())
        if use_dynamic_bsz:
            budget = int(self._cfg.get("ppo_max_token_len_per_gpu") or 0)
            seqlens = mini_batch["attention_mask"][keep].sum(dim=-1).tolist()
            local = num_micro_batches_for_budget(seqlens, budget) if kept and budget > 0 else 1
        else:
            size = int(self._cfg.get("ppo_micro_batch_size_per_gpu") or 0)
            if size <= 0:  # the same on every rank: split_micro_batches explains the setting
                return mini_batch, None
            local = -(-max(kept, 1) // size)
        need = local
        if self._dp_size > 1:
            count = torch.tensor([local], dtype=torch.int64, device=collective_device(self._dp_group))
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._dp_group)
            need = int(count.item())
        # the dynamic split agrees on its own count, which these rows cannot raise (each fits the budget)
        num_micro = None if use_dynamic_bsz else need
        if kept < need:
            filler = torch.nonzero(~keep)[: need - kept, 0]
            keep = keep.clone()
            keep[filler] = True
        if bool(keep.all()):
            return mini_batch, num_micro
        return mini_batch[torch.nonzero(keep)[:, 0]], num_micro

    def _backward_micro_batch(self, micro_batch, temperature: float, normaliser: float) -> dict:
        entropy, log_prob = self._forward_micro_batch(micro_batch, temperature, self.needs_entropy(micro_batch))
        loss, out = self._micro_batch_loss(micro_batch, log_prob, entropy, normaliser)
        loss.backward()
        return out

    def needs_entropy(self, micro_batch) -> bool:
        """Whether the loss of `micro_batch` needs the entropy (bonus, `calculate_entropy`, or
        reported on-policy)."""
        return self.entropy_coeff != 0 or self.calculate_entropy or "old_log_probs" not in micro_batch

    def _micro_batch_loss(self, micro_batch, log_prob, entropy, normaliser: float) -> tuple[torch.Tensor, dict]:
        """(loss to backpropagate, metrics) of one micro-batch from its log-probs and entropy [b, R]:
        policy loss, entropy bonus and KL loss, scaled by the micro-batch's weight in the mini-batch
        loss over all ranks (see verl.workers.dp_training). Shared by every backend's actor.

        The metrics are detached 0-d tensors (or plain numbers), read by `metrics_to_host` once per
        mini-batch; nothing here waits for the device."""
        response_mask = response_mask_of(micro_batch)
        on_policy = "old_log_probs" not in micro_batch
        rollout_log_probs = micro_batch.get("rollout_log_probs", None)
        # passed only when present, so a user's loss written without the argument keeps working
        weights = micro_batch.get("rollout_is_weights", None)
        extra = {} if weights is None else {"rollout_is_weights": weights}
        pg_loss, pg_metrics = self.policy_loss_fn(
            log_prob.detach() if on_policy else micro_batch["old_log_probs"],
            log_prob,
            micro_batch["advantages"],
            response_mask,
            self.loss_agg_mode,
            params=self.policy_loss_params,
            rollout_log_probs=rollout_log_probs,
            **extra,
        )
        loss = pg_loss
        # names with a "/" are already namespaced (rollout_corr/...); the others are the actor's
        out = {(name if "/" in name else f"actor/{name}"): _detached(value) for name, value in pg_metrics.items()}
        out["actor/pg_loss"] = pg_loss.detach()
        if rollout_log_probs is not None and self.loss_mode != "bypass_mode":
            # the current policy's gap to the rollout, as upstream logs it (bypass mode's loss reports its own)
            out.update(compute_rollout_corr_metrics_from_logprobs(log_prob, rollout_log_probs, response_mask))
        if self.entropy_coeff != 0:
            entropy_loss = agg_loss(entropy, response_mask, self.loss_agg_mode, self.loss_scale_factor)
            loss = loss - self.entropy_coeff * entropy_loss
            out["actor/entropy"] = entropy_loss.detach()
        elif on_policy or self.calculate_entropy:  # reported; on-policy runs skip compute_log_prob, which reports it
            out["actor/entropy"] = agg_loss(entropy.detach(), response_mask, self.loss_agg_mode, self.loss_scale_factor)
        if self.use_kl_loss:
            kld = kl_penalty(log_prob, micro_batch["ref_log_prob"], self.kl_loss_type)
            kl_loss = agg_loss(kld, response_mask, self.loss_agg_mode, self.loss_scale_factor)
            loss = loss + self.kl_loss_coef * kl_loss
            out["actor/kl_loss"] = kl_loss.detach()
            out["actor/kl_coef"] = self.kl_loss_coef
        return loss * micro_batch_weight(response_mask, self.loss_agg_mode, normaliser, self._dp_size, loss), out


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value
