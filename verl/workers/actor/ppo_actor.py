"""The PPO actor's role logic, written once for every training backend, free of Ray.

`PPOActor` holds what an actor computes whatever the model's parallelism: the loss settings read
from the `actor_rollout_ref.actor` section, the PPO epochs over shuffled mini-batches, the guarded
steps (a mini-batch whose advantages are all zero on every rank is skipped; a non-finite gradient
norm skips the optimizer step), zero-advantage rows left out of the forward, the micro-batch loss
(policy loss, entropy bonus, KL loss, a MoE router's load-balancing term) and its weighting in the
mini-batch loss over all ranks (`verl.workers.dp_training`), and the metric names.

A backend's actor (`DataParallelPPOActor` on FSDP2 or plain modules, `MegatronPPOActor` on
megatron chunks) is a sibling subclass that supplies only what touches the model: the forward
pass (log-probs and per-token statistics), `compute_log_prob_and_stats`, and `_train_and_step`
(forward/backward of a mini-batch's micro-batches, gradient synchronisation, clipping, the step).

The section is built into its typed class once, when the actor is (`omega_conf_to_dataclass` to the
class its `_target_` names, else the backend's `config_class`), and read by attribute from then on: the
defaults live in one place, the dataclass, and a key the class lacks is an error, not a silent default.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from verl.algorithms.aggregation import agg_loss
from verl.algorithms.kl import kl_penalty
from verl.algorithms.policy_losses import LOSS_AGG_MODE_OVERRIDES, PolicyLossParams, get_policy_loss_fn
from verl.algorithms.rollout_corr import compute_rollout_corr_metrics_from_logprobs
from verl.models.moe import METRIC as LOAD_BALANCING_METRIC
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import collective_device
from verl.utils.logging_utils import get_logger
from verl.utils.optim import grad_clip
from verl.utils.seqlen_balancing import num_micro_batches_for_budget
from verl.workers.actor.base import BasePPOActor
from verl.workers.config import ActorConfig
from verl.workers.dp_training import (
    MULTI_MODAL_ROW,
    append_to_dict,
    loss_normaliser,
    micro_batch_weight,
    response_mask_of,
    split_micro_batches,
    with_multi_modal_rows,
)

__all__ = [
    "MODEL_INPUTS",
    "MULTI_MODAL_ROW",
    "PPOActor",
    "ROW_SEPARABLE_LOSSES",
    "require_temperature",
    "rows_with_advantage",
    "skips_zero_advantage_rows",
]

logger = get_logger(__name__, "INFO")

# policy losses whose per-row loss is exactly zero when the row's advantages are (see the module docstring)
ROW_SEPARABLE_LOSSES = ("vanilla", "gspo", "gpg", "cispo", "sapo")


def skips_zero_advantage_rows(actor_cfg) -> bool:
    """Whether an actor with this config (`actor_rollout_ref.actor`: an `ActorConfig`, or a DictConfig
    or dict it is built from) leaves zero-advantage rows out of its update: switched on, a row-separable
    policy loss, and no KL loss or entropy bonus that would give such rows a gradient of their own."""
    cfg = omega_conf_to_dataclass(actor_cfg, ActorConfig)
    return (
        cfg.skip_zero_advantage_rows
        and cfg.policy_loss.loss_mode in ROW_SEPARABLE_LOSSES
        and not cfg.use_kl_loss
        and not float(cfg.entropy_coeff)
    )


def rows_with_advantage(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows with a nonzero advantage on some response token (the rows an actor that
    `skips_zero_advantage_rows` trains)."""
    return ((advantages != 0) & (response_mask != 0)).any(dim=-1)


MODEL_INPUTS = ["responses", "input_ids", "attention_mask", "position_ids"]


def require_temperature(meta_info: dict) -> float:
    """The sampling temperature in `meta_info`, checked: log-probs must use the one the responses were sampled with."""
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


class PPOActor(BasePPOActor):
    """The PPO/GRPO actor's training loop and loss; a backend subclass supplies the model's part."""

    config_class: type[ActorConfig] = ActorConfig
    """The class a section without `_target_` (a plain dict) is built into; the backend's subclass."""
    supports_multi_modal: bool = False
    """Whether the backend's forward passes a batch's `multi_modal_inputs` (images) to the model; a
    backend that cannot refuses such a batch instead of training on its text alone."""

    def __init__(self, config, actor_optimizer: torch.optim.Optimizer | None = None):
        """`config`: the `actor_rollout_ref.actor` section (an `ActorConfig`, or a DictConfig or dict it
        is built from). `actor_optimizer`: None for a log-prob scorer (the reference policy), which
        cannot update."""
        if actor_optimizer is None:
            config = _scorer_section(config, self.config_class)
        cfg = omega_conf_to_dataclass(config, self.config_class)
        super().__init__(cfg)
        self.actor_optimizer = actor_optimizer
        self._cfg = cfg
        self.loss_mode = cfg.policy_loss.loss_mode
        self.loss_agg_mode = self._effective_loss_agg_mode(cfg.loss_agg_mode)
        self.policy_loss_fn = get_policy_loss_fn(self.loss_mode)
        # a user's loss written to upstream's signature takes (..., config, rollout_is_weights) only
        self._loss_takes_params = "params" in inspect.signature(self.policy_loss_fn).parameters
        self.policy_loss_params = PolicyLossParams.from_actor_config(cfg)
        self.loss_scale_factor = self.policy_loss_params.loss_scale_factor
        self.entropy_coeff = float(cfg.entropy_coeff)
        self.calculate_entropy = cfg.calculate_entropy
        self.grad_clip = grad_clip(cfg, "actor_rollout_ref.actor")
        self.use_kl_loss = cfg.use_kl_loss
        self.kl_loss_coef = float(cfg.kl_loss_coef)
        self.kl_loss_type = cfg.kl_loss_type
        self.skip_zero_advantage_step = cfg.skip_zero_advantage_step
        self.skip_zero_advantage_rows = skips_zero_advantage_rows(cfg)
        self._shuffle_generator = torch.Generator().manual_seed(int(cfg.data_loader_seed or 0))
        # the data-parallel group the mini-batch's loss is normalised over; the backend sets it
        self._dp_group, self._dp_size = None, 1
        # the `multi_modal_inputs` of the batch being processed, indexed by MULTI_MODAL_ROW (None: text only)
        self._multi_modal_inputs = None

    # ------------------------------------------------------------------ the backend's part

    def _set_train_mode(self) -> None:
        """Put the model in training mode before an update."""
        raise NotImplementedError

    def compute_log_prob_and_stats(self, data, stats: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict]:
        """(log-probs [B, R], {name: [B, R]}) of the responses, with the per-token statistics named
        in `stats` (`entropy`, and what else the backend offers). `data.meta_info` gives
        `temperature`, `micro_batch_size` (or `use_dynamic_bsz` + `max_token_len`). Every rank
        must call it with the same number of samples."""
        raise NotImplementedError

    def _train_and_step(self, micro_batches: list, temperature: float, normaliser: float, metrics: dict):
        """Forward and backward every micro-batch of one mini-batch (each loss from
        `_micro_batch_loss`), then synchronise, clip and step: (grad norm, whether the optimizer
        stepped). Per-micro-batch metrics go into `metrics`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the role logic, once

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

    def compute_log_prob(self, data, calculate_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, R] of the responses (and entropies [B, R] when `calculate_entropy`).

        `data.meta_info` gives `temperature`, `micro_batch_size` (or `use_dynamic_bsz` +
        `max_token_len`). Every rank must call it with the same number of samples.
        """
        log_probs, stats = self.compute_log_prob_and_stats(data, ("entropy",) if calculate_entropy else ())
        return log_probs, stats.get("entropy")

    def _training_keys(self, batch) -> list[str]:
        present = set(batch.keys())
        # Without old_log_probs the update is strictly on-policy: the current log-probs, detached,
        # stand in for them (see `update_policy`).
        keys = [*MODEL_INPUTS, *(["old_log_probs"] if "old_log_probs" in present else []), "advantages"]
        missing = [k for k in keys if k not in present]
        if self.use_kl_loss:
            keys.append("ref_log_prob")
            if "ref_log_prob" not in present:
                missing.append("ref_log_prob (actor.use_kl_loss is on: compute reference log-probs first)")
        if missing:
            raise KeyError(f"update_policy needs batch keys {missing}; the batch has {sorted(present)}")
        keys += [k for k in ("response_mask", "rollout_log_probs", "rollout_is_weights") if k in present]
        return keys

    def _with_multi_modal_rows(self, data, batch):
        """`batch` with `MULTI_MODAL_ROW` added when `data` carries `multi_modal_inputs` (kept for the
        forward, see `verl.workers.dp_training.with_multi_modal_rows`)."""
        batch, self._multi_modal_inputs = with_multi_modal_rows(data, batch, "actor", self.supports_multi_modal)
        return batch

    def update_policy(self, data) -> dict[str, list[float]]:
        """PPO epochs x mini-batches x micro-batches on `data`; returns metric lists (the worker reduces).

        Metrics: actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl,
        actor/entropy (entropy_coeff != 0), actor/kl_loss + actor/kl_coef (use_kl_loss) per
        micro-batch; actor/grad_norm, actor/lr, actor/skipped_nonfinite_grad, actor/skipped_zero_adv
        per mini-batch.
        """
        if self.actor_optimizer is None:
            raise RuntimeError("this actor was built without an optimizer (a reference policy?); it cannot be updated")
        self._set_train_mode()
        temperature = require_temperature(data.meta_info)
        batch = self._with_multi_modal_rows(data, data.batch.select(*self._training_keys(data.batch)))
        mini_batch_size = int(self._cfg.ppo_mini_batch_size)
        if mini_batch_size <= 0 or len(batch) % mini_batch_size != 0:
            raise ValueError(
                f"this rank holds {len(batch)} samples, which is not a positive multiple of the per-rank "
                f"ppo_mini_batch_size={mini_batch_size} (ppo_mini_batch_size * rollout.n / data-parallel size); "
                "make data.train_batch_size a multiple of actor.ppo_mini_batch_size"
            )
        epochs = int(self._cfg.ppo_epochs)
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
            if self._cfg.shuffle:
                epoch_batch = batch[torch.randperm(len(batch), generator=self._shuffle_generator)]
            for mini_batch in epoch_batch.split(mini_batch_size):
                self._update_on_mini_batch(mini_batch, temperature, metrics)
        self.actor_optimizer.zero_grad()
        return metrics

    def _update_on_mini_batch(self, mini_batch, temperature: float, metrics: dict) -> None:
        response_mask = response_mask_of(mini_batch)
        keep = rows_with_advantage(mini_batch["advantages"], response_mask)
        use_dynamic_bsz = self._cfg.use_dynamic_bsz
        local_micro = self._local_micro_batch_count(mini_batch, keep, use_dynamic_bsz)
        normaliser, num_ranks_with_adv, num_micro = self._agree_over_ranks(
            loss_normaliser(response_mask, self.loss_agg_mode), keep.any(), local_micro
        )
        only_pg_loss = not self.use_kl_loss and self.entropy_coeff == 0
        if self.skip_zero_advantage_step and only_pg_loss and num_ranks_with_adv == 0:
            append_to_dict(metrics, {"actor/skipped_zero_adv": 1.0})
            return

        if local_micro is not None:
            rows = len(mini_batch)
            mini_batch = self._rows_to_train(mini_batch, keep, num_micro)
            append_to_dict(metrics, {"actor/zero_adv_rows_skipped": 1.0 - len(mini_batch) / rows})
        if local_micro is not None and not use_dynamic_bsz:
            # as many micro-batches as the busiest rank, each within the size limit
            base, extra = divmod(len(mini_batch), num_micro)
            micro_batches = list(mini_batch.split([base + (i < extra) for i in range(num_micro)]))
        else:  # the dynamic split agrees on its own count, which the kept rows cannot raise (each fits the budget)
            micro_batches, _ = split_micro_batches(
                mini_batch,
                micro_batch_size=self._cfg.ppo_micro_batch_size_per_gpu,
                use_dynamic_bsz=use_dynamic_bsz,
                max_token_len=self._cfg.ppo_max_token_len_per_gpu,
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

    def _agree_over_ranks(
        self, normaliser: torch.Tensor, has_advantage: torch.Tensor, local_micro: int | None
    ) -> tuple[float, float, int]:
        """(loss normaliser summed over the ranks, number of ranks with a nonzero advantage, the most
        micro-batches any rank needs) from this rank's values, in one collective: the three values
        are gathered from every rank (float64: the counts stay exact) and reduced here, where a sum
        and a max would otherwise take an all-reduce each. The mini-batch is on the host, and so is
        the gather where the group allows it (no device sync)."""
        mine = torch.stack(
            [normaliser, has_advantage.to(torch.float64), normaliser.new_tensor(float(local_micro or 0))]
        )
        if self._dp_size == 1:
            every = mine[None]
        else:
            mine = mine.to(collective_device(self._dp_group))
            parts = [torch.empty_like(mine) for _ in range(self._dp_size)]
            dist.all_gather(parts, mine, group=self._dp_group)
            every = torch.stack(parts)
        normaliser_sum, ranks_with_adv = every[:, :2].sum(dim=0).tolist()
        return normaliser_sum, ranks_with_adv, int(every[:, 2].max())

    def _local_micro_batch_count(self, mini_batch, keep: torch.Tensor, use_dynamic_bsz: bool) -> int | None:
        """How many micro-batches this rank needs for the rows it trains when zero-advantage rows are
        left out (`keep` [B] bool: the rows with an advantage); None when rows are not left out, or
        the fixed micro-batch size is unset (`split_micro_batches` then explains the setting)."""
        if not self.skip_zero_advantage_rows:
            return None
        kept = int(keep.sum())
        if use_dynamic_bsz:
            budget = int(self._cfg.ppo_max_token_len_per_gpu or 0)
            seqlens = mini_batch["attention_mask"][keep].sum(dim=-1).tolist()
            return num_micro_batches_for_budget(seqlens, budget) if kept and budget > 0 else 1
        size = int(self._cfg.ppo_micro_batch_size_per_gpu or 0)
        if size <= 0:  # the same on every rank
            return None
        return -(-max(kept, 1) // size)

    @staticmethod
    def _rows_to_train(mini_batch, keep: torch.Tensor, num_micro: int):
        """The rows of `mini_batch` with a nonzero advantage on some response token (`keep`), in order.
        Zero-advantage rows are kept back where this rank would otherwise have fewer rows than the
        busiest rank has micro-batches (`num_micro`): every rank runs that many."""
        kept = int(keep.sum())
        if kept < num_micro:
            filler = torch.nonzero(~keep)[: num_micro - kept, 0]
            keep = keep.clone()
            keep[filler] = True
        if bool(keep.all()):
            return mini_batch
        return mini_batch[torch.nonzero(keep)[:, 0]]

    def needs_entropy(self, micro_batch) -> bool:
        """Whether the loss of `micro_batch` needs the entropy (bonus, `calculate_entropy`, or
        reported on-policy)."""
        return self.entropy_coeff != 0 or self.calculate_entropy or "old_log_probs" not in micro_batch

    def _micro_batch_loss(
        self,
        micro_batch,
        log_prob,
        entropy,
        normaliser: float,
        aux_loss: torch.Tensor | None = None,
        aux_coef: float = 0.0,
    ) -> tuple[torch.Tensor, dict]:
        """(loss to backpropagate, metrics) of one micro-batch from its log-probs and entropy [b, R]:
        policy loss, entropy bonus, KL loss and a MoE router's load-balancing `aux_loss` (0-d, or None;
        weighted by `aux_coef`),
        scaled by the micro-batch's weight in the mini-batch loss over all ranks (see
        verl.workers.dp_training). Shared by every backend's actor.

        The metrics are detached 0-d tensors (or plain numbers), read by `metrics_to_host` once per
        mini-batch; nothing here waits for the device."""
        response_mask = response_mask_of(micro_batch)
        on_policy = "old_log_probs" not in micro_batch
        rollout_log_probs = micro_batch.get("rollout_log_probs", None)
        # passed only when present, so a user's loss written without the argument keeps working
        weights = micro_batch.get("rollout_is_weights", None)
        extra = {} if weights is None else {"rollout_is_weights": weights}
        if self._loss_takes_params:
            extra.update(params=self.policy_loss_params, rollout_log_probs=rollout_log_probs)
        else:  # upstream's call, as upstream's actor makes it
            extra = {"config": self.config, "rollout_is_weights": weights}
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=log_prob.detach() if on_policy else micro_batch["old_log_probs"],
            log_prob=log_prob,
            advantages=micro_batch["advantages"],
            response_mask=response_mask,
            loss_agg_mode=self.loss_agg_mode,
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
            entropy_loss = agg_loss(
                entropy, response_mask, self.loss_agg_mode, loss_scale_factor=self.loss_scale_factor
            )
            loss = loss - self.entropy_coeff * entropy_loss
            out["actor/entropy"] = entropy_loss.detach()
        elif on_policy or self.calculate_entropy:  # reported; on-policy runs skip compute_log_prob, which reports it
            out["actor/entropy"] = agg_loss(
                entropy.detach(), response_mask, self.loss_agg_mode, loss_scale_factor=self.loss_scale_factor
            )
        if self.use_kl_loss:
            kld = kl_penalty(log_prob, micro_batch["ref_log_prob"], self.kl_loss_type)
            kl_loss = agg_loss(kld, response_mask, self.loss_agg_mode, loss_scale_factor=self.loss_scale_factor)
            loss = loss + self.kl_loss_coef * kl_loss
            out["actor/kl_loss"] = kl_loss.detach()
            out["actor/kl_coef"] = self.kl_loss_coef
        if aux_loss is not None:
            loss = loss + aux_coef * aux_loss
            out[LOAD_BALANCING_METRIC] = aux_loss.detach()
        return loss * micro_batch_weight(response_mask, self.loss_agg_mode, normaliser, self._dp_size, loss), out


def _scorer_section(config, config_class: type):
    """The section a log-prob scorer (an actor built without an optimizer) is built from.

    Upstream's workers (and recipes written the same way) build the reference policy's scorer from the
    `ref` section (`DataParallelPPOActor(config=self.config.ref, ...)`); its `log_prob_*` keys are the
    worker's (`compute_ref_log_prob` batches with them), so the scorer takes the keys the actor's class
    declares (sequence parallelism, remove padding, ...) and its defaults for the rest.

    A scorer never trains: its forward passes are batched by the batch's meta_info. The actor's class still
    requires a training micro-batching (upstream's rule, which upstream's scorers skip by never building the
    class), so a section that sets none gets the forward one (`log_prob_micro_batch_size_per_gpu`), or token
    packing. A built section is returned as it is."""
    if dataclasses.is_dataclass(config) or not isinstance(config, Mapping):
        return config
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    if "log_prob_micro_batch_size_per_gpu" in config and "ppo_mini_batch_size" not in config:  # the ref section
        declared = {f.name for f in dataclasses.fields(config_class)}
        section = {key: value for key, value in config.items() if key in declared and key != "_target_"}
        per_gpu = config.get("log_prob_micro_batch_size_per_gpu")
        dynamic = bool(config.get("log_prob_use_dynamic_bsz")) or per_gpu is None
        return {**section, "ppo_micro_batch_size_per_gpu": per_gpu, "use_dynamic_bsz": dynamic}
    if config.get("use_dynamic_bsz") or any(config.get(k) is not None for k in _TRAIN_MICRO_KEYS):
        return config
    return {**config, "use_dynamic_bsz": True}


_TRAIN_MICRO_KEYS = ("ppo_micro_batch_size_per_gpu", "ppo_micro_batch_size")


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value
