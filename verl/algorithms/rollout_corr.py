r"""Rollout correction: importance weights and rejection of tokens or sequences whose rollout
log-probs disagree with the trainer's (`algorithm.rollout_correction.*`, upstream's keys).

The rollout engine samples with its own kernels (vLLM in bf16, a quantised engine, an older
weight version when generation runs ahead), so the policy that produced a response, $\mu$, is
not exactly the policy being trained, $\pi$. With the engine's per-token log-probs
(`rollout.calculate_log_probs=true`, batch key `rollout_log_probs`) and the trainer's
(`old_log_probs`), the log-ratio $\delta_t = \log\pi(y_t) - \log\mu(y_t)$ drives two tools:

- **Importance sampling** (`rollout_is`): each token's policy loss is multiplied by a truncated
  weight, per token $w_t = \min(e^{\delta_t}, C)$ (`token`) or per sequence
  $w = \min(e^{\sum_t\delta_t}, C)$ (`sequence`), $C$ = `rollout_is_threshold`; optionally
  rescaled to mean 1 over the batch (`rollout_is_batch_normalize`). Weights carry no gradient.
- **Rejection sampling** (`rollout_rs`): tokens or whole sequences whose divergence estimate
  leaves a trust region are masked out of `response_mask` (so of the loss and the advantage).
  Estimators: k1 $= -\delta$ (bounded on both sides, as a ratio interval `lower_upper`), k2
  $= \delta^2/2$ and k3 $= e^{\delta} - 1 - \delta$ (upper bound only); each per token (`token_k*`)
  or per sequence as the sum, mean or max over its tokens (`seq_sum_k*`, `seq_mean_k*`,
  `seq_max_k*`). Several options joined by commas must all pass.

Two operating modes (`bypass_mode`):

- **Decoupled** (default, three policies): the trainer still recomputes `old_log_probs` as PPO's
  anchor; `compute_rollout_correction_and_add_to_batch` runs once per batch on the driver after
  the old log-probs and before the advantages, writing `rollout_is_weights` and the rejected
  `response_mask` into the batch; the actor multiplies its policy loss by the weights.
- **Bypass** (two policies): the old-log-prob forward is skipped, `old_log_probs` are the
  rollout's (`apply_bypass_mode`), and the actor's loss becomes `bypass_mode`
  (`core_algos.compute_policy_loss_bypass_mode`), which computes the weights and the rejection
  per micro-batch from the current policy: `loss_type=ppo_clip` is PPO's clipped surrogate on
  $\pi/\mu$ (the ratio already is the importance weight, so weights are logged, not applied);
  `loss_type=reinforce` is $-\mathrm{sg}(w)\,A\log\pi$.

Metrics (upstream's names, prefixed `rollout_corr/`): off-policy diagnostics whenever rollout
log-probs are present (`training_ppl`, `rollout_ppl`, `kl`, `k3_kl`, `log_ppl_diff*`,
`ppl_ratio`, `chi2_token`, `chi2_seq`, ...), the weights' statistics (`rollout_is_mean`,
`_max`, `_min`, `_std`, `_eff_sample_size`, `_ratio_fraction_high/low`, `_seq_*`) and the
rejection's (`rollout_rs_<option>_*`, `rollout_rs_masked_fraction`,
`rollout_rs_seq_masked_fraction`).

Design decisions:

- The math (`rollout_correction_tensors`, `_offpolicy_metrics`) returns 0-d tensors, so the actor can
  call it per micro-batch without waiting for the device; the public functions with upstream's
  names convert the metrics to floats once, on the driver.
- Defined, never NaN, never an error, for empty masks (an all-rejected micro-batch is normal):
  statistics over no tokens are 0, sequence statistics skip empty responses. Upstream raises on an
  empty mask; here the metrics of an empty batch are simply 0.
- The config is checked when it is built (`RolloutCorrectionConfig.__post_init__`), thresholds
  included, so a typo in `rollout_rs_threshold` fails before any worker starts; and what the
  config asks for must be possible (`check_rollout_correction`): no silent skip when the rollout
  returns no log-probs (upstream skips the correction without a word then).
- The dataclass defaults are the YAML's (`rollout_is: null`, i.e. off), not upstream's Python
  default (`"sequence"`): constructing the config from the composed YAML is what runs.
- `rollout_is_batch_normalize` in bypass mode normalises over the micro-batch the loss sees
  (upstream: over that micro-batch on all data-parallel ranks).

References: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(2025); Liu et al., "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch" (2025). Formulas: docs/algorithms.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from verl.algorithms.rollout_corr_presets import RolloutCorrectionPresets
from verl.protocol import DataProto
from verl.utils.torch_functional import masked_mean, masked_sum

__all__ = [
    "LOSS_TYPES",
    "ROLLOUT_IS_LEVELS",
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "RolloutCorrectionConfig",
    "apply_bypass_mode",
    "check_rollout_correction",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "configure_rollout_correction",
    "rollout_correction_config",
    "rollout_correction_tensors",
]

logger = logging.getLogger(__name__)

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to ±SAFETY_BOUND before exp(), so one far-off token cannot overflow."""

ROLLOUT_IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
_ESTIMATORS = ("k1", "k2", "k3")
SUPPORTED_ROLLOUT_RS_OPTIONS = (
    *(f"token_{k}" for k in _ESTIMATORS),
    *(f"seq_sum_{k}" for k in _ESTIMATORS),
    *(f"seq_mean_{k}" for k in _ESTIMATORS),
    "seq_max_k2",
    "seq_max_k3",
)
_PREFIX = "rollout_corr/"


# ==============================================================================================
# Config
# ==============================================================================================


@dataclass(frozen=True)
class _Bounds:
    """Keep a statistic s when lower <= s <= upper (lower None: no lower bound)."""

    lower: float | None
    upper: float


def _parse_rs_thresholds(options: list[str], spec: Any) -> dict[str, _Bounds]:
    """One `_Bounds` per rejection option from `rollout_rs_threshold` (see the config's docs)."""
    where = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None:
        raise ValueError(
            f"{where} is unset but rollout_rs={','.join(options)} asks for rejection sampling; give a threshold "
            "per option, e.g. rollout_rs_threshold=0.01 for a k2/k3 option or '0.5_2.0' (ratio bounds) for a k1 one"
        )
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{where}={spec!r} must be a number or a string of comma-separated thresholds")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) == 1:
        parts = parts * len(options)
    if len(parts) != len(options):
        raise ValueError(
            f"{where}={spec!r} gives {len(parts)} thresholds for {len(options)} rollout_rs options {options}; give "
            "one threshold shared by all options or exactly one per option, in the same order"
        )
    bounds = {}
    for option, part in zip(options, parts):
        try:
            values = [float(v) for v in part.split("_")]
        except ValueError:
            raise ValueError(f"{where}: {part!r} (for {option}) is not a number or a 'lower_upper' pair") from None
        if any(not math.isfinite(v) or v <= 0 for v in values) or len(values) > 2:
            raise ValueError(f"{where}: {part!r} (for {option}) must be one positive number or a 'lower_upper' pair")
        if option.endswith("k1"):
            # k1 bounds the ratio pi_rollout / pi_train on both sides; one number u means [1/u, u]
            lower, upper = values if len(values) == 2 else (1.0 / values[0], values[0])
            if lower > upper:
                raise ValueError(f"{where}: {part!r} (for {option}) has its lower bound above its upper bound")
            bounds[option] = _Bounds(math.log(lower), math.log(upper))
        else:
            if len(values) == 2:
                raise ValueError(
                    f"{where}: {part!r} (for {option}) gives two bounds, but a k2/k3 divergence is non-negative and "
                    "takes only an upper bound (e.g. 0.01)"
                )
            bounds[option] = _Bounds(None, values[0])
    return bounds


def _rs_options(rollout_rs: Any) -> list[str]:
    if not isinstance(rollout_rs, str):
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs={rollout_rs!r} must be null or a string of comma-separated "
            f"options from {list(SUPPORTED_ROLLOUT_RS_OPTIONS)}"
        )
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    unknown = [o for o in options if o not in SUPPORTED_ROLLOUT_RS_OPTIONS]
    if unknown or not options:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs={rollout_rs!r}: unknown option(s) {unknown or [rollout_rs]}; "
            f"valid options are {list(SUPPORTED_ROLLOUT_RS_OPTIONS)} (comma-separated to combine)"
        )
    return options


@dataclass(frozen=True)
class RolloutCorrectionConfig(RolloutCorrectionPresets):
    """`algorithm.rollout_correction`: how the trainer corrects for the rollout policy differing
    from the trained one (see the module docstring). Defaults are those of upstream's YAML (off)."""

    rollout_is: str | None = None
    """Importance-weight level: null (no weights), `token` (per token, biased, low variance) or
    `sequence` (one weight per response, the product of its token ratios: unbiased, high variance)."""
    rollout_is_threshold: float | str = 2.0
    """Upper truncation C of the weights (typical: 1.5-5 per token, 2-10 per sequence); a string
    `lower_upper` (e.g. "0.5_4.0") is IcePop instead: weights outside [lower, upper] become 0, the
    others are kept as they are."""
    rollout_is_batch_normalize: bool = False
    """Rescale the truncated weights to mean 1 over the batch (over tokens, or over responses for
    `sequence`)."""
    rollout_rs: str | None = None
    """Rejection options, comma-separated, all must pass: `token_k1|k2|k3`, `seq_sum_k1|k2|k3`,
    `seq_mean_k1|k2|k3`, `seq_max_k2|k3`. null: no rejection."""
    rollout_rs_threshold: str | float | None = None
    """One threshold per rejection option (or one for all), comma-separated. k1 options take ratio
    bounds `lower_upper` (a single number u means [1/u, u]); k2/k3 options an upper bound."""
    bypass_mode: bool = False
    """False: decoupled (recompute old log-probs; weights from pi_old/pi_rollout, once per batch).
    True: bypass (old log-probs := rollout log-probs, no recompute; the actor's loss becomes
    `bypass_mode`, weights from pi_current/pi_rollout)."""
    loss_type: str = "ppo_clip"
    """Bypass mode's loss: `ppo_clip` (PPO on pi/pi_rollout; weights logged, not applied) or
    `reinforce` (-sg(w) * A * log pi)."""

    def __post_init__(self):
        key = "algorithm.rollout_correction"
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"{key}.rollout_is={self.rollout_is!r} must be null or one of {list(ROLLOUT_IS_LEVELS)}")
        threshold = self.rollout_is_threshold
        if self.rollout_is is not None:
            try:
                parse_rollout_is_threshold(threshold)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"{key}.rollout_is_threshold={threshold!r}: {e} (a positive number, the weights' truncation, "
                    "typically 2.0, or 'lower_upper' for IcePop) when rollout_is is set"
                ) from None
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"{key}.loss_type={self.loss_type!r} must be one of {list(LOSS_TYPES)}")
        if self.rollout_rs is not None:
            _parse_rs_thresholds(_rs_options(self.rollout_rs), self.rollout_rs_threshold)

    # ----------------------------------------------------------------------------- reading
    @classmethod
    def from_config(cls, node: Any) -> RolloutCorrectionConfig | None:
        """Build from an `algorithm.rollout_correction` node (DictConfig, dict, dataclass or None);
        None stays None. Unknown keys are an error naming them."""
        if node is None or isinstance(node, cls):
            return node
        if hasattr(node, "items"):
            values = dict(node.items())
        else:
            values = {k: getattr(node, k) for k in cls.__dataclass_fields__ if hasattr(node, k)}
        values.pop("_target_", None)
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in algorithm.rollout_correction; valid keys: {sorted(cls.__dataclass_fields__)}"
            )
        if values.get("rollout_is_threshold") is None:
            values.pop("rollout_is_threshold", None)
        return cls(**values)

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style read, as code written against upstream's config object does."""
        return getattr(self, key, default)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def rs_bounds(self) -> dict[str, _Bounds]:
        """The parsed rejection thresholds, one per option (empty without rejection)."""
        if self.rollout_rs is None:
            return {}
        return _parse_rs_thresholds(_rs_options(self.rollout_rs), self.rollout_rs_threshold)

    @property
    def corrects(self) -> bool:
        """Whether the config changes training (weights, rejection or bypass), not only metrics."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


def rollout_correction_config(config: Any) -> RolloutCorrectionConfig | None:
    """The `algorithm.rollout_correction` of a whole PPO config, or None when the section is absent."""
    algorithm = config.get("algorithm") if hasattr(config, "get") else getattr(config, "algorithm", None)
    if algorithm is None:
        return None
    node = algorithm.get("rollout_correction") if hasattr(algorithm, "get") else None
    return RolloutCorrectionConfig.from_config(node)


def check_rollout_correction(
    rc: RolloutCorrectionConfig | None,
    calculate_log_probs: bool,
    loss_mode: str = "vanilla",
    tis_imp_ratio_cap: float | None = None,
) -> None:
    """Refuse a rollout correction the run cannot carry out, with the setting that fixes it.

    calculate_log_probs: `actor_rollout_ref.rollout.calculate_log_probs`; loss_mode:
    `actor.policy_loss.loss_mode`; tis_imp_ratio_cap: `actor.tis_imp_ratio_cap` (the older
    per-token truncated IS, which would weight the loss a second time).
    """
    if rc is None or not rc.corrects:
        return
    asked = ", ".join(
        f"{k}={v}" for k, v in (("rollout_is", rc.rollout_is), ("rollout_rs", rc.rollout_rs)) if v is not None
    ) or ("bypass_mode=true" if rc.bypass_mode else "")
    if not calculate_log_probs:
        raise ValueError(
            f"algorithm.rollout_correction ({asked}) needs the rollout engine's log-probs, which are not computed; set "
            "actor_rollout_ref.rollout.calculate_log_probs=true (or turn the correction off)"
        )
    if rc.bypass_mode and loss_mode not in ("vanilla", "bypass_mode"):
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true replaces the policy loss with its own "
            f"(loss_type={rc.loss_type}), so actor.policy_loss.loss_mode={loss_mode} would not be used; set "
            "loss_mode=vanilla or bypass_mode=false"
        )
    if tis_imp_ratio_cap is not None and tis_imp_ratio_cap > 0:
        if rc.bypass_mode:
            raise ValueError(
                f"actor.tis_imp_ratio_cap={tis_imp_ratio_cap} weights by pi_old/pi_rollout, which is 1 in "
                "algorithm.rollout_correction.bypass_mode (the old log-probs are the rollout's); use "
                "rollout_correction.rollout_is with loss_type=reinforce instead and set tis_imp_ratio_cap=-1"
            )
        if rc.rollout_is is not None:
            raise ValueError(
                f"algorithm.rollout_correction.rollout_is={rc.rollout_is} and actor.tis_imp_ratio_cap="
                f"{tis_imp_ratio_cap} both weight the loss by pi/pi_rollout, so every token would be weighted twice; "
                "keep one (set tis_imp_ratio_cap=-1, or rollout_is=null)"
            )
    if rc.bypass_mode and rc.loss_type == "ppo_clip" and rc.rollout_is is not None:
        logger.warning(
            "algorithm.rollout_correction: bypass_mode with loss_type=ppo_clip logs the rollout_is=%s weights but does "
            "not apply them (the PPO ratio is already pi/pi_rollout); use loss_type=reinforce to apply them",
            rc.rollout_is,
        )


def configure_rollout_correction(config: Any) -> RolloutCorrectionConfig | None:
    """Read and check `algorithm.rollout_correction` of a PPO config, and for bypass mode hand the
    settings to the actor's loss (in place, before the workers are built): the actor's
    `policy_loss.loss_mode` becomes `bypass_mode` and `policy_loss.rollout_correction` holds the
    settings (`PolicyLossParams.from_actor_config` reads them). Returns the config, or None."""
    from omegaconf import open_dict

    rc = rollout_correction_config(config)
    if rc is None:
        return None
    actor = config.actor_rollout_ref.actor
    policy_loss = actor.get("policy_loss") or {}
    check_rollout_correction(
        rc,
        calculate_log_probs=bool(config.actor_rollout_ref.rollout.get("calculate_log_probs", False)),
        loss_mode=policy_loss.get("loss_mode", "vanilla"),
        tis_imp_ratio_cap=actor.get("tis_imp_ratio_cap"),
    )
    if rc.bypass_mode:
        with open_dict(actor):
            actor.policy_loss.loss_mode = "bypass_mode"
            actor.policy_loss.rollout_correction = rc.to_dict()
    return rc


# ==============================================================================================
# The math (0-d tensor metrics)
# ==============================================================================================


def _valid_rows(mask: torch.Tensor) -> torch.Tensor:
    return (mask != 0).any(dim=-1)


def _masked_max(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Max over unmasked positions (0 where there are none)."""
    filled = values.masked_fill(mask == 0, -torch.inf)
    out = filled.max() if axis is None else filled.max(dim=axis).values
    return torch.where(torch.isneginf(out), 0.0, out)


def _masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return -_masked_max(-values, mask)


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.to(torch.get_default_dtype()), mask)


def _masked_std(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population standard deviation over unmasked positions (0 for fewer than two)."""
    mean = masked_mean(values, mask)
    var = torch.clamp(masked_mean(values.square(), mask) - mean.square(), min=0.0)
    return torch.where((mask != 0).sum() > 1, var.sqrt(), 0.0)


def _seq_stats(prefix: str, seq_values: torch.Tensor, rows: torch.Tensor, ideal: float, high, low) -> dict:
    """`<prefix>_seq_{mean,std,max,min,max_deviation,fraction_high,fraction_low}` over non-empty rows."""
    n = rows.sum()
    std = torch.where(
        n > 1,
        (masked_sum((seq_values - masked_mean(seq_values, rows)).square(), rows) / (n - 1).clamp(min=1)).sqrt(),
        0,
    )
    out = {
        f"{prefix}_seq_mean": masked_mean(seq_values, rows),
        f"{prefix}_seq_std": std.to(seq_values.dtype),
        f"{prefix}_seq_max": _masked_max(seq_values, rows),
        f"{prefix}_seq_min": _masked_min(seq_values, rows),
        f"{prefix}_seq_max_deviation": _masked_max((seq_values - ideal).abs(), rows),
        f"{prefix}_seq_fraction_high": _fraction(seq_values > high, rows),
    }
    if low is not None:
        out[f"{prefix}_seq_fraction_low"] = _fraction(seq_values < low, rows)
    return out


def parse_rollout_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """(upper, lower) of a `rollout_is_threshold`: a number (or a numeric string) is the truncation
    (lower None); `"lower_upper"` is IcePop's band. Both bounds positive, lower <= upper."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_is_threshold={spec!r} must be a number or a 'lower_upper' string")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "_" in text:
                low_text, high_text = text.split("_", 1)
                lower, upper = float(low_text), float(high_text)
            else:
                upper = float(text)
        except ValueError:
            raise ValueError(f"rollout_is_threshold={spec!r} is neither a number nor 'lower_upper'") from None
    else:
        upper = float(spec)
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold={spec!r}: the upper bound must be positive")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"rollout_is_threshold={spec!r}: the lower bound must be positive and at most the upper one")
    return upper, lower


def _importance_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float | str, batch_normalize: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(truncated weights [B, R], 0 at padding, no gradient; metrics without prefix). A
    `lower_upper` threshold (IcePop) zeroes the weights outside the band instead of truncating."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={level!r} must be one of {list(ROLLOUT_IS_LEVELS)}")
    threshold, icepop_low = parse_rollout_is_threshold(threshold)
    log_ratio = log_ratio.detach()
    valid = (mask != 0).to(log_ratio.dtype)
    rows = _valid_rows(mask)
    low = 1.0 / threshold if icepop_low is None else icepop_low

    def band(w: torch.Tensor) -> torch.Tensor:
        if icepop_low is None:
            return w.clamp(max=threshold)
        return torch.where((w >= icepop_low) & (w <= threshold), w, torch.zeros_like(w))

    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * valid
        per_unit, unit_mask = raw, valid
    else:
        seq_log = masked_sum(log_ratio, mask, axis=-1)
        seq_w = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        raw = seq_w.unsqueeze(-1) * valid
        per_unit, unit_mask = seq_w, rows
    metrics = {
        # the mean is over tokens at both levels (a sequence's weight counts once per token), as upstream
        "rollout_is_mean": masked_mean(raw, valid),
        "rollout_is_max": _masked_max(per_unit, unit_mask),
        "rollout_is_min": _masked_min(per_unit, unit_mask),
        "rollout_is_ratio_fraction_high": _fraction(per_unit > threshold, unit_mask),
        "rollout_is_ratio_fraction_low": _fraction(per_unit < low, unit_mask),
    }
    bounded = raw.clamp(low, threshold)
    metrics["rollout_is_std"] = _masked_std(bounded, valid)
    normalised = bounded / (masked_mean(bounded, valid) + 1e-8)
    second_moment = masked_mean(normalised.square(), valid)
    metrics["rollout_is_eff_sample_size"] = torch.where(second_moment > 0, 1.0 / second_moment, 0.0)
    metrics.update(_seq_stats("rollout_is", masked_mean(raw, valid, axis=-1), rows, ideal=1.0, high=threshold, low=low))
    weights = band(raw)
    if icepop_low is not None:
        metrics["rollout_is_oob_ratio"] = _fraction((raw < icepop_low) | (raw > threshold), valid)
    if batch_normalize:
        # the mean over what the level weights: tokens, or responses (one weight each)
        if level == "token":
            mean = masked_mean(weights, valid)
        else:
            mean = masked_mean(band(per_unit), rows)
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token k1, k2, k3 estimates of KL(pi_rollout || pi) from delta = log pi - log pi_rollout."""
    d = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -d, "k2": 0.5 * d.square(), "k3": torch.exp(d) - 1.0 - d}


def _rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, bounds: dict[str, _Bounds]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(kept mask [B, R] in `mask`'s dtype, metrics without prefix)."""
    valid = mask != 0
    valid_f = valid.to(log_ratio.dtype)
    rows = _valid_rows(mask)
    token_stats = _divergences(log_ratio)
    keep_all = torch.ones_like(valid)
    metrics: dict[str, torch.Tensor] = {}
    for option, b in bounds.items():
        stat = token_stats[option[-2:]]
        prefix = f"rollout_rs_{option}"
        if option.startswith("token_"):
            per_token = stat
            seq_values = masked_mean(stat, valid_f, axis=-1)
        else:
            if option.startswith("seq_sum_"):
                seq_values = masked_sum(stat, valid_f, axis=-1)
            elif option.startswith("seq_mean_"):
                seq_values = masked_mean(stat, valid_f, axis=-1)
            else:
                seq_values = _masked_max(stat, valid, axis=-1)
            per_token = seq_values.unsqueeze(-1).expand_as(stat)
        keep = per_token <= b.upper
        if b.lower is not None:
            keep = keep & (per_token >= b.lower)
        keep_all = keep_all & keep
        lower = 0.0 if b.lower is None else b.lower
        # sequence-level options report per-sequence extremes and fractions, token-level ones per token
        units, unit_mask = (stat, valid) if option.startswith("token_") else (seq_values, rows)
        metrics[f"{prefix}_mean"] = masked_mean(per_token, valid_f)
        metrics[f"{prefix}_max"] = _masked_max(units, unit_mask)
        metrics[f"{prefix}_min"] = _masked_min(units, unit_mask)
        metrics[f"{prefix}_fraction_high"] = _fraction(units > b.upper, unit_mask)
        metrics[f"{prefix}_fraction_low"] = (
            _fraction(units < b.lower, unit_mask)
            if b.lower is not None
            else torch.zeros_like(metrics[f"{prefix}_mean"])
        )
        metrics[f"{prefix}_std"] = _masked_std(per_token.clamp(lower, b.upper), valid_f)
        metrics.update(_seq_stats(prefix, seq_values, rows, ideal=0.0, high=b.upper, low=b.lower))
        metrics[f"{prefix}_masked_fraction"] = _fraction(~keep, valid_f)
        metrics[f"{prefix}_seq_masked_fraction"] = _fraction((~keep & valid).any(dim=-1), rows)
    metrics["rollout_rs_masked_fraction"] = _fraction(~keep_all, valid_f)
    metrics["rollout_rs_seq_masked_fraction"] = _fraction((~keep_all & valid).any(dim=-1), rows)
    return mask * keep_all.to(mask.dtype), metrics


def _offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Diagnostics of the gap between the trainer's and the rollout's log-probs (no prefix); per-
    sequence quantities are averaged over non-empty responses."""
    old = old_log_prob.detach()
    valid = (mask != 0).to(old.dtype)
    rows = _valid_rows(mask)
    train_nll = -masked_mean(old, valid, axis=-1)
    metrics = {
        "training_ppl": masked_mean(torch.exp(train_nll), rows),
        "training_log_ppl": masked_mean(train_nll, rows),
    }
    if rollout_log_prob is None:
        return metrics
    rollout = rollout_log_prob.detach()
    delta = old - rollout
    rollout_nll = -masked_mean(rollout, valid, axis=-1)
    log_ppl_diff = train_nll - rollout_nll
    safe = delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_delta = masked_sum(delta, valid, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    metrics.update(
        {
            "kl": masked_mean(rollout - old, valid),
            "k3_kl": masked_mean(torch.exp(safe) - safe - 1.0, valid),
            "rollout_ppl": masked_mean(torch.exp(rollout_nll), rows),
            "rollout_log_ppl": masked_mean(rollout_nll, rows),
            "log_ppl_diff": masked_mean(log_ppl_diff, rows),
            "log_ppl_abs_diff": masked_mean(log_ppl_diff.abs(), rows),
            "log_ppl_diff_max": _masked_max(log_ppl_diff, rows),
            "log_ppl_diff_min": _masked_min(log_ppl_diff, rows),
            "ppl_ratio": masked_mean(torch.exp(log_ppl_diff), rows),
            "chi2_token": torch.where(valid.sum() > 0, masked_mean(torch.exp(2 * safe), valid) - 1.0, 0.0),
            "chi2_seq": torch.where(rows.any(), masked_mean(torch.exp(2 * seq_delta), rows) - 1.0, 0.0),
        }
    )
    return metrics


def rollout_correction_tensors(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rc: RolloutCorrectionConfig,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(IS weights [B, R] or None, response mask after rejection, metrics prefixed `rollout_corr/`,
    as 0-d tensors). `old_log_prob` is the training policy's side of the ratio."""
    shapes = {tuple(t.shape) for t in (old_log_prob, rollout_log_prob, response_mask)}
    if len(shapes) != 1:
        raise ValueError(
            "old_log_prob, rollout_log_prob and response_mask must all be [batch, response_length], got "
            f"{tuple(old_log_prob.shape)}, {tuple(rollout_log_prob.shape)}, {tuple(response_mask.shape)}"
        )
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if rc.rollout_is is not None:
        weights, is_metrics = _importance_weights(
            log_ratio, response_mask, rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize
        )
        metrics.update(is_metrics)
    mask = response_mask
    if rc.rollout_rs is not None:
        mask, rs_metrics = _rejection_mask(log_ratio, response_mask, rc.rs_bounds)
        metrics.update(rs_metrics)
    metrics.update(_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"{_PREFIX}{k}": v.detach() for k, v in metrics.items()}


def _floats(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    if not metrics:
        return {}
    keys = list(metrics)
    values = torch.stack([metrics[k].to(torch.float64) for k in keys]).tolist()  # one host copy
    return dict(zip(keys, values))


# ==============================================================================================
# Upstream's public functions (float metrics)
# ==============================================================================================


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights from log(pi_train / pi_rollout) [B, R] -> (weights [B, R],
    0 at padding and without gradient; `rollout_is_*` metrics as floats). A `"lower_upper"`
    threshold is IcePop: weights outside [lower, upper] are 0 (`rollout_is_oob_ratio` counts them)."""
    weights, metrics = _importance_weights(
        log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
    )
    return weights, _floats(metrics)


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
) -> dict[str, float]:
    """The `rollout_is_*` statistics of the weights a log-ratio [B, R] gives (before truncation).
    `rollout_is_weights` is accepted for upstream's signature; the statistics are computed from the
    log-ratio, which is exact where the truncated weights are not."""
    del rollout_is_weights
    if log_ratio_for_metrics.shape != response_mask.shape:
        raise ValueError(
            "log_ratio_for_metrics must be the per-token log-ratio [batch, response_length] (the sequence level sums "
            f"it itself), got {tuple(log_ratio_for_metrics.shape)} for a mask of {tuple(response_mask.shape)}"
        )
    _, metrics = _importance_weights(log_ratio_for_metrics, response_mask, rollout_is, rollout_is_threshold, False)
    return _floats(metrics)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reject tokens/sequences outside the trust region: (response_mask with rejected positions 0,
    `rollout_rs_*` metrics as floats). See `RolloutCorrectionConfig.rollout_rs` for the options."""
    bounds = _parse_rs_thresholds(_rs_options(rollout_rs), rollout_rs_threshold)
    mask, metrics = _rejection_mask(log_ratio, response_mask, bounds)
    return mask, _floats(metrics)


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, response_mask: torch.Tensor
) -> dict[str, float]:
    """Off-policy diagnostics (perplexities, KL, chi-squared) as floats, without prefix."""
    return _floats(_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[DataProto | None, torch.Tensor, dict[str, float]]:
    """Weights and rejection together: (DataProto with `rollout_is_weights` or None, response mask
    after rejection, all metrics prefixed `rollout_corr/` as floats). Shapes [B, R]."""
    rc = RolloutCorrectionConfig(
        rollout_is=rollout_is if rollout_is_threshold is not None else None,
        rollout_is_threshold=2.0 if rollout_is_threshold is None else rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
    )
    weights, mask, metrics = rollout_correction_tensors(old_log_prob, rollout_log_prob, response_mask, rc)
    proto = None if weights is None else DataProto.from_dict(tensors={"rollout_is_weights": weights})
    return proto, mask, _floats(metrics)


def compute_rollout_correction_and_add_to_batch(
    batch: DataProto, rollout_corr_config: RolloutCorrectionConfig | Mapping
) -> tuple[DataProto, dict[str, float]]:
    """Decoupled mode, once per batch on the driver: replace `response_mask` by the rejected mask,
    add `rollout_is_weights` when `rollout_is` is set; return (batch, `rollout_corr/*` metrics).

    Reads `old_log_probs`, `rollout_log_probs` and `response_mask` from the batch.
    """
    rc = RolloutCorrectionConfig.from_config(rollout_corr_config)
    missing = [k for k in ("old_log_probs", "rollout_log_probs", "response_mask") if k not in batch.batch]
    if missing:
        raise KeyError(
            f"rollout correction needs batch keys {missing}: rollout_log_probs come from the rollout with "
            "actor_rollout_ref.rollout.calculate_log_probs=true, old_log_probs from the actor's compute_log_prob"
        )
    weights, mask, metrics = rollout_correction_tensors(
        batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"], rc
    )
    batch.batch["response_mask"] = mask
    if weights is not None:
        batch.batch["rollout_is_weights"] = weights
    return batch, _floats(metrics)


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The off-policy diagnostics of the *current* policy against the rollout, prefixed
    `rollout_corr/`, as detached 0-d tensors (the actor calls it per micro-batch and reads them
    with its other metrics, in one copy per mini-batch)."""
    return {f"{_PREFIX}{k}": v for k, v in _offpolicy_metrics(log_prob, rollout_log_prob, response_mask).items()}


def apply_bypass_mode(
    batch: DataProto, rollout_corr_config: RolloutCorrectionConfig | Mapping | None = None, policy_loss_config=None
) -> None:
    """Bypass mode, on the driver: `old_log_probs` := `rollout_log_probs` (no recompute).

    When `policy_loss_config` (an actor's `policy_loss` node) is given, it is switched to the
    `bypass_mode` loss with these settings, as upstream does; the trainer does that once before the
    workers are built instead (`configure_rollout_correction`), since workers hold their own copy.
    """
    if "rollout_log_probs" not in batch.batch:
        raise ValueError(
            "bypass_mode=True requires rollout_log_probs in batch: algorithm.rollout_correction.bypass_mode=true uses "
            "the rollout's log-probs as the old log-probs; set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    if policy_loss_config is not None:
        from omegaconf import open_dict

        rc = RolloutCorrectionConfig.from_config(rollout_corr_config) or RolloutCorrectionConfig(bypass_mode=True)
        with open_dict(policy_loss_config):
            policy_loss_config["loss_mode"] = "bypass_mode"
            policy_loss_config["rollout_correction"] = rc.to_dict()
