"""The foundation every policy loss shares (`verl.algorithms.policy_losses` re-exports it): the loss
parameters `PolicyLossParams` read from the actor's config, the clamped log-ratio, the truncated-IS and
rollout-correction weighting, and the common ending `finish_policy_loss` (weights, aggregation, the
`pg_clipfrac` / `pg_clipfrac_lower` / `ppo_kl` metrics). Kept apart so the loss modules
(`policy_losses`, `dppo_losses`) build on it without importing each other."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl.algorithms._common import _LOG_RATIO_CLAMP, _check_shapes
from verl.algorithms.aggregation import agg_loss
from verl.algorithms.rollout_corr import RolloutCorrectionConfig
from verl.utils.torch_functional import masked_mean


@dataclass(frozen=True)
class PolicyLossParams:
    """The numbers a policy loss needs (pure numbers, read from `actor_rollout_ref.actor.*` by the actor).

    Defaults are upstream verl's.
    """

    clip_ratio: float = 0.2
    """PPO's clip range epsilon (`actor.clip_ratio`): the ratio is clipped to [1-eps, 1+eps]."""
    clip_ratio_low: float | None = None
    """Lower clip range (`actor.clip_ratio_low`); None means `clip_ratio`."""
    clip_ratio_high: float | None = None
    """Upper clip range (`actor.clip_ratio_high`); None means `clip_ratio`. DAPO's clip-higher
    sets it above `clip_ratio_low` (e.g. 0.28 vs 0.2)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant c > 1 (`actor.clip_ratio_c`): for negative advantages the loss is
    capped at -c*A (Ye et al., arXiv:1912.09729)."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: fraction of valid tokens whose gradient is cut (`actor.policy_loss.clip_cov_ratio`)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance band eligible for cutting (`policy_loss.clip_cov_lb`)."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of that band (`policy_loss.clip_cov_ub`)."""
    kl_cov_ratio: float = 0.0002
    """KL-Cov: fraction of valid tokens (largest covariance) that get the KL term (`policy_loss.kl_cov_ratio`)."""
    ppo_kl_coef: float = 0.1
    """KL-Cov: coefficient of |log ratio| on the selected tokens (`policy_loss.ppo_kl_coef`)."""
    dro_beta: float | None = None
    """DRO: weight of the squared log-ratio penalty (`policy_loss.dro_beta`; must be > 0 for `dro`)."""
    tis_imp_ratio_cap: float | None = None
    """Truncated importance sampling against the rollout engine's log-probs
    (`actor.tis_imp_ratio_cap`): each token's loss is weighted by min(pi_old/pi_rollout, cap).
    None (or a value <= 0, upstream's -1) turns it off."""
    tau_pos: float = 1.0
    """SAPO: temperature of the soft gate for tokens with a positive advantage (`actor.tau_pos`);
    larger is closer to PPO's hard clip (arXiv:2511.20347)."""
    tau_neg: float = 1.05
    """SAPO: temperature for tokens with a zero or negative advantage (`actor.tau_neg`); above
    tau_pos so negative updates are damped faster."""
    loss_scale_factor: float | None = None
    """`seq-mean-token-sum-norm`'s constant length L (`actor.loss_scale_factor`); None: the padded
    response length."""
    dp_size: int = 1
    batch_num_tokens: Any = None
    global_batch_size: Any = None
    """Global normalisation (`agg_loss`'s keywords of the same names): the actor config's
    `global_batch_info`, which upstream's engine loss (`verl.workers.utils.losses.ppo_loss`) fills per
    micro-batch; defaults: this micro-batch alone."""
    rollout_correction: RolloutCorrectionConfig | None = None
    """Bypass mode's settings (`algorithm.rollout_correction`, handed to the actor as
    `policy_loss.rollout_correction`); None: PPO-clip on pi/pi_rollout, no weights, no rejection."""

    def __post_init__(self):
        if self.clip_ratio < 0 or (self.clip_ratio_low or 0) < 0 or (self.clip_ratio_high or 0) < 0:
            raise ValueError(
                f"actor.clip_ratio={self.clip_ratio}, clip_ratio_low={self.clip_ratio_low} and "
                f"clip_ratio_high={self.clip_ratio_high} must be >= 0 (typical: 0.2, DAPO: low 0.2, high 0.28)"
            )
        if not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1: dual-clip caps the loss of negative "
                "advantages at clip_ratio_c * |A|, which only makes sense above the unclipped ratio 1 (default 3.0)"
            )
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"actor.policy_loss.{name}={getattr(self, name)} must be a fraction in (0, 1]")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"actor.policy_loss.clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}"
            )
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(
                f"actor.tau_pos={self.tau_pos} and actor.tau_neg={self.tau_neg} must be > 0: they are the temperatures "
                "of SAPO's sigmoid gate (upstream defaults 1.0 and 1.05)"
            )
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ValueError(
                f"actor.loss_scale_factor={self.loss_scale_factor} must be > 0 (the constant length that "
                "seq-mean-token-sum-norm divides by) or null for the padded response length"
            )
        if isinstance(self.rollout_correction, Mapping):
            object.__setattr__(self, "rollout_correction", RolloutCorrectionConfig.from_config(self.rollout_correction))

    @classmethod
    def from_actor_config(cls, actor_config: Any) -> PolicyLossParams:
        """Read the numbers from an `actor_rollout_ref.actor` config (a mapping or an attribute-style
        object, e.g. a DictConfig or a dataclass); keys it lacks keep their defaults.

        Upstream's keys: `clip_ratio`, `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`,
        `tis_imp_ratio_cap`, `tau_pos`, `tau_neg`, `loss_scale_factor` and
        `policy_loss.{clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef}`, plus
        `policy_loss.rollout_correction` (set by the trainer in rollout correction's bypass mode).
        """

        def read(node: Any, key: str) -> Any:
            if node is None:
                return None
            value = node.get(key) if hasattr(node, "get") else None
            # an attribute that is not a key (ActorConfig.global_batch_info)
            return value if value is not None else getattr(node, key, None)

        policy_loss = read(actor_config, "policy_loss")
        found = {key: read(actor_config, key) for key in _ACTOR_KEYS}
        found.update({key: read(policy_loss, key) for key in _POLICY_LOSS_KEYS})
        found.update({key: read(read(actor_config, "global_batch_info"), key) for key in _GLOBAL_BATCH_KEYS})
        return cls(**{key: value for key, value in found.items() if value is not None})

    @property
    def low(self) -> float:
        """The effective lower clip range."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """The effective upper clip range."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def agg_kwargs(self) -> dict[str, Any]:
        """`agg_loss`'s keyword arguments beyond the mode: the length constant and the global batch's counts."""
        return {
            "loss_scale_factor": self.loss_scale_factor,
            "dp_size": self.dp_size,
            "batch_num_tokens": self.batch_num_tokens,
            "global_batch_size": self.global_batch_size,
        }

    @property
    def tis_enabled(self) -> bool:
        return self.tis_imp_ratio_cap is not None and self.tis_imp_ratio_cap > 0


_ACTOR_KEYS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tis_imp_ratio_cap",
    "tau_pos",
    "tau_neg",
    "loss_scale_factor",
)
# the keys of the actor config's `global_batch_info` dict (upstream's) a loss's aggregation reads
_GLOBAL_BATCH_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size")
_POLICY_LOSS_KEYS = (
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "dro_beta",
    "rollout_correction",
)
_DEFAULT_PARAMS = PolicyLossParams()


def policy_loss_params(config: Any = None, params: PolicyLossParams | None = None) -> PolicyLossParams:
    """The numbers a loss uses: `params` when given, else read from `config` (upstream's argument: the
    actor's config, an `ActorConfig` or a mapping, or already a `PolicyLossParams`), else upstream's
    defaults."""
    if params is not None:
        return params
    if config is None:
        return _DEFAULT_PARAMS
    if isinstance(config, PolicyLossParams):
        return config
    return PolicyLossParams.from_actor_config(config)


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _apply_tis(
    pg_losses: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    params: PolicyLossParams,
    rollout_is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight each token's loss by min(pi_old / pi_rollout, cap) (`tis_imp_ratio_cap`) and by the
    rollout correction's importance weights (`rollout_is_weights`, computed by the trainer); no
    gradient flows through either weight."""
    if rollout_is_weights is not None:
        _check_shapes(pg_losses=pg_losses, rollout_is_weights=rollout_is_weights)
        pg_losses = pg_losses * rollout_is_weights.detach()
    if rollout_log_probs is None or not params.tis_enabled:
        return pg_losses
    log_w = torch.clamp(old_log_prob - rollout_log_probs, -_LOG_RATIO_CLAMP, math.log(params.tis_imp_ratio_cap))
    return pg_losses * torch.exp(log_w).detach()


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def policy_loss_metrics(
    response_mask: torch.Tensor,
    kl_per_token: torch.Tensor,
    clipped: torch.Tensor | None = None,
    clipped_lower: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The metrics every policy loss reports, as masked means over the valid tokens [B, R]:
    `pg_clipfrac` (fraction of `clipped` tokens), `pg_clipfrac_lower` (of `clipped_lower`) and
    `ppo_kl` (mean of `kl_per_token`). A loss that never clips passes None and reports 0."""
    dtype = kl_per_token.dtype

    def fraction(flags: torch.Tensor | None) -> torch.Tensor:
        if flags is None:
            return _zero(kl_per_token)
        return masked_mean(flags.to(dtype), response_mask).detach()

    return {
        "pg_clipfrac": fraction(clipped),
        "pg_clipfrac_lower": fraction(clipped_lower),
        "ppo_kl": masked_mean(kl_per_token, response_mask).detach(),
    }


def finish_policy_loss(
    pg_losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    params: PolicyLossParams,
    *,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    rollout_is_weights: torch.Tensor | None,
    kl_per_token: torch.Tensor,
    clipped: torch.Tensor | None = None,
    clipped_lower: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The shared ending of the token-level policy losses.

    Weights each token's loss `pg_losses` [B, R] by the rollout correction's `rollout_is_weights`
    and the truncated-IS weight min(pi_old / pi_rollout, `params.tis_imp_ratio_cap`) (no gradient
    through either), aggregates it with `agg_loss(loss_agg_mode, **params.agg_kwargs())` and
    returns (scalar loss, `policy_loss_metrics(...)`).
    """
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, params, rollout_is_weights)
    metrics = policy_loss_metrics(response_mask, kl_per_token, clipped, clipped_lower)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **params.agg_kwargs()), metrics
