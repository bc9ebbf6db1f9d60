"""The PPO actor on a data-parallel (FSDP2) model, free of Ray: log-probs and policy updates.

`DataParallelPPOActor(config, actor_module, actor_optimizer=None)` works on any HF causal LM
module: an FSDP2-sharded one inside a worker, or a plain module in one process (tests, scripts).
The engine (`verl.workers.engine.FSDPEngine`) owns the model, optimizer and lr scheduler; the
training loop, the guarded steps and the loss are `verl.workers.actor.ppo_actor.PPOActor`'s,
written once for every backend; this class supplies the forward passes below and the FSDP
gradient step (`_train_and_step`).

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

`use_fused_kernels` (the model's or the actor's key, as upstream) takes log-probs and entropy from
the last hidden states and the LM head's weight, chunk by chunk, never holding the micro-batch's
[tokens, vocab] logits (`verl.utils.experimental.torch_functional.fused_lm_head`, which runs inside
the model's own call, where FSDP2 has gathered the head). It covers the padded and remove-padding
forwards. With `share_prompt_forward` as well, a micro-batch that shares its prompts takes the
shared-prompt forward (each prompt once, response logits only: no more memory than the padded
path) and the others are fused; the `fused_kernels` speed path says so. Ulysses sequence
parallelism and statistics other than the entropy are refused with the reason.

Vision-language models (Qwen2-VL family, `verl.utils.vision.is_vision_language_config`): a batch
with `non_tensor_batch["multi_modal_inputs"]` (one dict per row: `pixel_values`, `image_grid_thw`)
gets a row index (`MULTI_MODAL_ROW`) that follows its rows through shuffling and every micro-batch
split, so each forward passes `extract_multi_modal_inputs` of exactly its rows, in order; the
(B, 4, L) position ids (text row + M-RoPE rows) go to the model as (4, B, L), packed to (4, 1, T) on
the remove-padding path. The shared-prompt forward is off for such models and Ulysses is refused
(see docs/multimodal_training.md).

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
kl_loss_coef, kl_loss_type, use_remove_padding (needed by a MoE model's load-balancing loss, `verl.models.moe`),
ulysses_sequence_parallel_size or fsdp_config.ulysses_sequence_parallel_size (`verl.utils.ulysses_keys.role_sp`),
skip_zero_advantage_step, skip_zero_advantage_rows,
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

from verl.models.moe import RouterAuxLoss
from verl.utils import shared_prompt, speed_paths, ulysses
from verl.utils.device import get_device
from verl.utils.experimental.torch_functional import fused_head_problem, fused_lm_head
from verl.utils.flops_counter import FlopsCounter, FlopsTally
from verl.utils.hf_forward import hf_model, model_forward
from verl.utils.logging_utils import get_logger
from verl.utils.remove_padding import packed_model_inputs, pad_input, unpad_input, unpad_position_ids
from verl.utils.shared_prompt import prompt_groups, shared_prompt_logits
from verl.utils.speed_paths import SpeedPath
from verl.utils.torch_functional import (
    entropy_from_logits_with_chunking,
    logprobs_from_logits,
    sum_pi_squared_from_logits,
)
from verl.utils.ulysses_keys import role_sp
from verl.utils.vision import input_only_token_ids, is_vision_language_config, mask_input_only_logits
from verl.workers.actor.ppo_actor import MODEL_INPUTS, PPOActor, require_temperature
from verl.workers.config import FSDPActorConfig
from verl.workers.dp_training import (
    append_to_dict,
    clip_grad_norm,
    dp_group_and_size,
    metrics_to_host,
    model_position_ids,
    multi_modal_kwargs,
    pad_response_columns,
    refuse_vision_language_ulysses,
    split_micro_batches,
    step_if_finite,
    token_window,
)
from verl.workers.model_memory import apply_model_memory_options

__all__ = ["TOKEN_STATS", "DataParallelPPOActor"]

logger = get_logger(__name__, "INFO")

TOKEN_STATS = {"entropy": entropy_from_logits_with_chunking, "sum_pi_squared": sum_pi_squared_from_logits}
"""Per-token statistics of the (temperature-scaled) logits [..., V] -> [...] the forward can return
beside the log-probs: `entropy` (differentiable) and `sum_pi_squared` (sum_v p_v^2, for the
optimal token baseline; no gradient)."""


class DataParallelPPOActor(PPOActor):
    """PPO/GRPO actor over an HF causal LM (FSDP2-sharded or plain)."""

    config_class = FSDPActorConfig
    supports_multi_modal = True

    def __init__(
        self,
        config,
        actor_module: torch.nn.Module,
        actor_optimizer: torch.optim.Optimizer | None = None,
        ulysses_group=None,
        use_fused_kernels: bool | None = None,
        model_config=None,
    ):
        """`ulysses_group`: the process group of this rank's sequence-parallel peers, needed when
        `ulysses_sequence_parallel_size` > 1 (see `verl.utils.ulysses`). `use_fused_kernels`: take
        log-probs and entropy from the hidden states (None: the config's `use_fused_kernels`; the
        worker passes the model section's too). `model_config`: the model section (None: the config's
        `model_config` attribute, as upstream's workers set it), whose `tiled_mlp` and
        `enable_activation_offload` apply to `actor_module` (`verl.workers.model_memory`)."""
        super().__init__(config, actor_optimizer)
        self.actor_module = actor_module
        cfg = self._cfg
        model_config = model_config if model_config is not None else getattr(cfg, "model_config", None)
        self.activation_offload = apply_model_memory_options(
            actor_module, model_config, cfg.strategy, trains=actor_optimizer is not None
        )
        self.use_remove_padding = cfg.use_remove_padding
        # a peft model forwards its keyword arguments to the HF model it wraps: ask that one
        hf_module = hf_model(actor_module)
        self.is_vision_language = is_vision_language_config(getattr(hf_module, "config", None))
        # the policy of a vision-language model is over the tokens it can emit: its input-only vision
        # markers are masked out of the logits, as the rollout engines never sample them
        # (verl.utils.vision.input_only_token_ids), so the actor's log-probs are the rollout's distribution
        self._unsampled = input_only_token_ids(hf_module.config) if self.is_vision_language else []
        sp_size, sp_key = role_sp(cfg, "actor")
        if self.is_vision_language:
            refuse_vision_language_ulysses(hf_module.config, sp_size, sp_key, "model")
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
            cfg.share_prompt_forward, hf_module, self.use_remove_padding, self._attn_implementation
        )
        if self.is_vision_language and self.shared_prompt_path.active:
            self.shared_prompt_path = SpeedPath(
                shared_prompt.SPEED_PATH,
                requested=True,
                active=False,
                reason="a vision-language model runs every row in full (its prompt pass would need the images "
                "and M-RoPE positions of each group's prompt)",
            )
        # use_fused_kernels: log-probs and entropy from the last hidden states and the head's weight
        # (verl.utils.experimental.torch_functional), on the padded and remove-padding forwards
        if use_fused_kernels is None:
            use_fused_kernels = bool(getattr(cfg, "use_fused_kernels", False))
        self.use_fused_kernels = use_fused_kernels
        if self.use_fused_kernels:
            problem = fused_head_problem(hf_module)
            if problem is None and self.sp_size > 1:
                problem = "the Ulysses sequence-parallel forward is not covered"
            if problem is not None:
                raise ValueError(f"actor.use_fused_kernels=true cannot run: {problem}; set use_fused_kernels=false")
        speed_paths.report([self.shared_prompt_path])
        # on even when the path is off for updates only (gradient checkpointing): log-probs still share
        self.share_prompt_forward = self.shared_prompt_path.requested and forward.cache_argument is not None
        self.share_prompt_forward = self.share_prompt_forward and not self.is_vision_language
        # the shared-prompt forward has no sequence-parallel form: sp > 1 runs every row in full
        self.share_prompt_forward = self.share_prompt_forward and self.sp_size == 1
        # both on: a micro-batch that shares its prompts takes that path (it runs each prompt once and computes
        # response logits only, no more than the padded path holds); every other micro-batch is fused
        self.fused_kernels_note = (
            "micro-batches that take the shared-prompt forward compute their response logits unfused "
            "(share_prompt_forward=false fuses every one)"
            if self.use_fused_kernels and self.share_prompt_forward
            else ""
        )
        self._dp_group, self._dp_size = dp_group_and_size(actor_module)
        # FSDP2 units gather and reduce per forward call: ranks must then agree on the calls they make
        self._calls_are_collective = isinstance(actor_module, FSDPModule) and self._dp_size > 1
        # with frozen weights (LoRA) the backward computes no weight gradients for them: the work of 2
        # forwards instead of 3 (any frozen parameter counts as such, so the count never exceeds the work)
        frozen = any(not p.requires_grad for p in actor_module.parameters())
        self.flops = FlopsTally(FlopsCounter.for_model(getattr(hf_module, "config", None)), passes=2 if frozen else 3)
        # a MoE model's router load-balancing loss, when its config asks for it (see verl.models.moe)
        self.router_aux = RouterAuxLoss(
            hf_module, self.use_remove_padding, self.sp_size, trains=actor_optimizer is not None
        )

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
        if self.use_fused_kernels:
            return self._fused_outputs(micro_batch, temperature, stats, start, end, kept)
        if self.use_remove_padding:
            packed_ids, packed_pos, indices = self._packed_inputs(micro_batch)
            if self.sp_size > 1:
                return self._sp_packed_outputs(packed_ids, packed_pos, indices, micro_batch, temperature, stats)
            inputs = packed_model_inputs(self._hf_module, packed_ids, packed_pos)
            logits = self.actor_module(**inputs, **self._multi_modal_kwargs(micro_batch), use_cache=False).logits[0]
            logits = self._policy_logits(logits, temperature)
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
        logits = self._policy_logits(self._padded_response_logits(micro_batch, start, end, kept), temperature)
        return self._response_outputs([logits], micro_batch["responses"], temperature, stats)

    def _policy_logits(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """`logits` with a vision-language model's input-only markers at a value that stays the dtype's
        lowest after the division by `temperature` (a probability of exactly 0, and finite, so p * logit
        stays 0 in the entropy); a text model's unchanged."""
        return mask_input_only_logits(logits, self._unsampled, temperature)

    def _multi_modal_kwargs(self, micro_batch) -> dict:
        """The model's image inputs for the rows of `micro_batch` ({} for text only; `multi_modal_kwargs`)."""
        group = self._dp_group if self._calls_are_collective else False
        return multi_modal_kwargs(
            micro_batch, self._multi_modal_inputs, self._hf_module, self.is_vision_language, group
        )

    @staticmethod
    def _packed_inputs(micro_batch):
        """(packed_ids [1, T], packed_pos, indices): the micro-batch's tokens without padding."""
        packed_ids, indices = unpad_input(micro_batch["input_ids"], micro_batch["attention_mask"])
        return packed_ids, unpad_position_ids(micro_batch["position_ids"], indices), indices

    def _padded_response_logits(self, micro_batch, start: int, end: int, kept: int) -> torch.Tensor:
        """The model's `.logits` [B, kept, ...] at the positions that predict the first `kept` response
        tokens, from one padded call on the columns [start, end) (see `token_window`)."""
        # Only the last R + 1 positions predict response tokens: skip the LM head everywhere else
        # (a large saving for real vocabularies, e.g. 152k for Qwen2.5).
        keep = {"logits_to_keep": kept + 1} if self._accepts_logits_to_keep else {}
        output = self.actor_module(
            input_ids=micro_batch["input_ids"][:, start:end],
            attention_mask=micro_batch["attention_mask"][:, start:end],
            position_ids=model_position_ids(micro_batch["position_ids"][..., start:end]),
            use_cache=False,
            **keep,
            **self._multi_modal_kwargs(micro_batch),
        )
        return output.logits[:, -kept - 1 : -1]

    def _fused_outputs(self, micro_batch, temperature: float, stats: tuple[str, ...], start: int, end: int, kept: int):
        """`_forward_with_stats` with `use_fused_kernels`: the LM head returns (log-prob, entropy) per position
        (`fused_lm_head`), computed chunk by chunk from the hidden states; the logits never exist whole."""
        # the entropy is trained only where the loss uses it; otherwise its backward is skipped
        entropy_grad = "entropy" in stats and torch.is_grad_enabled()
        input_ids = micro_batch["input_ids"]
        batch_size, seqlen = input_ids.shape
        responses = micro_batch["responses"]
        response_length = responses.shape[-1]
        if self.use_remove_padding:
            packed_ids, packed_pos, indices = self._packed_inputs(micro_batch)
            # as in the unfused path: a sequence's last label is wrong, and never a response token's
            labels = torch.roll(packed_ids, shifts=-1, dims=1)
            with fused_lm_head(self._hf_module, labels, temperature, entropy_grad, masked_ids=self._unsampled):
                inputs = packed_model_inputs(self._hf_module, packed_ids, packed_pos)
                out = self.actor_module(**inputs, **self._multi_modal_kwargs(micro_batch), use_cache=False).logits[0]
            values = pad_input(out, indices, batch_size, seqlen)[:, -response_length - 1 : -1]
            log_probs, entropy = values[..., 0], values[..., 1]
        else:
            width = end - start
            labels = input_ids.new_zeros((batch_size, width))
            labels[:, width - kept - 1 : width - 1] = responses[:, :kept]
            if self._accepts_logits_to_keep:  # the head sees only the last kept + 1 positions
                labels = labels[:, -kept - 1 :]
            with fused_lm_head(self._hf_module, labels, temperature, entropy_grad, masked_ids=self._unsampled):
                out = self._padded_response_logits(micro_batch, start, end, kept)
            log_probs = pad_response_columns(out[..., 0], response_length)
            entropy = pad_response_columns(out[..., 1], response_length)
        return ({"entropy": entropy} if "entropy" in stats else {}), log_probs

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
        if self.actor_module.training and shared_prompt.recomputes_layers(self._hf_module):
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

    # ------------------------------------------------------------------ the backend's part

    def _set_train_mode(self) -> None:
        self.actor_module.train()

    @torch.no_grad()
    def compute_log_prob_and_stats(self, data, stats: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict]:
        """(log-probs [B, R], {name: [B, R]}) for each `TOKEN_STATS` name in `stats` (`entropy`,
        `sum_pi_squared`); `data.meta_info` as for `PPOActor.compute_log_prob_and_stats`."""
        unknown = [name for name in stats if name not in TOKEN_STATS]
        if unknown:
            raise ValueError(f"unknown per-token statistics {unknown}; available: {sorted(TOKEN_STATS)}")
        unfusable = [name for name in stats if name != "entropy"]
        if self.use_fused_kernels and unfusable:
            raise ValueError(
                f"use_fused_kernels=true computes log-probs and entropy only, not {unfusable}; "
                "set actor_rollout_ref.model.use_fused_kernels=false to compute them"
            )
        self.actor_module.eval()
        meta = data.meta_info
        temperature = require_temperature(meta)
        batch = self._with_multi_modal_rows(data, data.batch.select(*MODEL_INPUTS))
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

    # ------------------------------------------------------------------ upstream's internals
    # for recipes whose `update_policy` is upstream's loop over `_forward_micro_batch` (SPPO's)

    @property
    def ulysses_sequence_parallel_size(self) -> int:
        return self.sp_size

    def _optimizer_step(self) -> torch.Tensor:
        """Clip the gradients to `grad_clip` and step, or skip the step (clearing the gradients) when
        their norm is not finite; returns the norm before clipping (a 0-d tensor), as upstream's."""
        grad_norm = clip_grad_norm(self.actor_module, self.grad_clip)
        step_if_finite(self.actor_optimizer, float(grad_norm))
        return grad_norm

    def _train_and_step(self, micro_batches: list, temperature: float, normaliser: float, metrics: dict):
        """Forward and backward every micro-batch, then clip and step (see `PPOActor._train_and_step`).

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

    def _backward_micro_batch(self, micro_batch, temperature: float, normaliser: float) -> dict:
        with self.router_aux.recording() as router_logits:
            entropy, log_prob = self._forward_micro_batch(micro_batch, temperature, self.needs_entropy(micro_batch))
        aux_loss = self.router_aux.loss(router_logits)
        # the coefficient exists only where the model's config asks for the load-balancing loss
        aux_coef = self.router_aux.coef if aux_loss is not None else 0.0
        loss, out = self._micro_batch_loss(micro_batch, log_prob, entropy, normaliser, aux_loss, aux_coef)
        loss.backward()
        return out


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value
