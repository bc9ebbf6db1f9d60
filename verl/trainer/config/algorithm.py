"""The `algorithm` section as typed runtime configs, with upstream verl's class names and defaults.

    from verl.trainer.config import AlgoConfig
    from verl.utils.config import omega_conf_to_dataclass
    algo = omega_conf_to_dataclass(cfg.algorithm)  # `_target_: verl.trainer.config.AlgoConfig`

Design decisions:
- One definition per key: each field carries both its runtime default (upstream's) and the
  metadata the validator and the reference-docs generator read (`doc(...)`); `schema.py` composes
  these classes into the whole tree instead of declaring the section again.
- Section-valued fields hold a section instance by default rather than upstream's `None`
  (`filter_groups`, `rollout_correction`): the YAML always provides them, so a reader never has to
  test for None, and each reads like a mapping for code written against upstream's dict.
- `pf_ppo` keeps upstream's default, an empty dict ("not set", falsy: upstream's tests and users
  check `if not algo.pf_ppo`). A dict given directly is built into a checked `PFPPOConfig`, and
  with `use_pf_ppo` on an unset `pf_ppo` becomes `PFPPOConfig()` (the YAML's `pow`/2.0, where
  upstream would fail mid-run on a None method), so PF-PPO always reads a `PFPPOConfig`.
- `RolloutCorrectionConfig` here is the config section (keys, docs, defaults of the YAML). The
  algorithm layer's `verl.algorithms.rollout_corr.RolloutCorrectionConfig` is the checked value
  the loss reads; `from_config` builds it from this section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from verl.algorithms.rollout_corr_presets import RolloutCorrectionPresets
from verl.base_config import BaseConfig
from verl.workers.config._fields import (
    KL_CTRL_TYPES,
    KL_PENALTIES,
    PF_PPO_METHODS,
    UNSUPPORTED,
    adv_estimator_choices,
    doc,
)

__all__ = ["AlgoConfig", "FilterGroupsConfig", "KLControlConfig", "PFPPOConfig", "RolloutCorrectionConfig"]


def _section(cls: type, text: str):
    return doc(text, default_factory=cls)


def _check_choice(section: str, key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{key}={value!r} is not a valid choice; use one of: {', '.join(map(str, choices))}")


@dataclass
class KLControlConfig(BaseConfig):
    """Controller of the in-reward KL coefficient."""

    type: str = doc(
        "fixed: constant coefficient; adaptive: steer towards `target_kl`.", choices=KL_CTRL_TYPES, default="fixed"
    )
    kl_coef: float = doc("(Initial) KL coefficient.", default=0.001)
    horizon: int = doc("Adaptive controller horizon in samples.", default=10000)
    target_kl: float = doc("Adaptive controller target KL.", default=0.1)

    def __post_init__(self):
        _check_choice("algorithm.kl_ctrl", "type", self.type, KL_CTRL_TYPES)
        if self.kl_coef < 0:
            raise ValueError(
                f"algorithm.kl_ctrl.kl_coef={self.kl_coef} is negative, which would reward drifting away from "
                "the reference policy; set it >= 0 (0 turns the penalty off)"
            )
        if self.type == "adaptive" and (self.target_kl <= 0 or self.horizon <= 0):
            raise ValueError(
                f"algorithm.kl_ctrl.type=adaptive needs target_kl > 0 and horizon > 0 (got target_kl={self.target_kl}, "
                f"horizon={self.horizon}): the controller steers the coefficient towards target_kl over horizon "
                "samples; set both positive (upstream defaults 0.1 and 10000)"
            )


@dataclass
class PFPPOConfig(BaseConfig):
    """Policy-filtration PPO: resample the batch by reward weight."""

    reweight_method: str = doc("Weighting of samples.", choices=PF_PPO_METHODS, default="pow")
    weight_pow: float = doc("Exponent of the `pow` method.", default=2.0)

    def __post_init__(self):
        _check_choice("algorithm.pf_ppo", "reweight_method", self.reweight_method, PF_PPO_METHODS)


@dataclass
class FilterGroupsConfig(BaseConfig):
    """DAPO dynamic sampling: drop groups whose samples all score the same and generate more."""

    enable: bool = doc("Drop zero-variance groups and refill the batch.", default=False)
    metric: str | None = doc("Per-sample metric whose spread decides (e.g. acc, score, seq_reward).", default=None)
    max_num_gen_batches: int = doc("Generation rounds per step before giving up (<= 0: unlimited).", default=0)
    max_inflight_gen_batches: int = doc(
        "Prompt batches upstream's v1 trainer keeps generating at once while it fills a batch (its replay buffer "
        "carries finished groups over to the next step). Here the rounds run one after another and the surplus of "
        "the last one is dropped, which is upstream's behaviour at 1.",
        status=UNSUPPORTED,
        neutral=1,
        default=1,
    )

    def __post_init__(self):
        if self.enable and not self.metric:
            raise ValueError(
                "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric (e.g. acc or score): "
                "groups are kept by the spread of that per-sample metric"
            )


@dataclass
class RolloutCorrectionConfig(RolloutCorrectionPresets, BaseConfig):
    """Importance weights and rejection of samples by the ratio of the training policy's probabilities to the
    rollout engine's (upstream's rollout_corr_helper). Upstream's presets (`decoupled_token_is()`, ...)
    build one."""

    rollout_is: str | None = doc("Importance-weight level: null (off), token or sequence.", default=None)
    rollout_is_threshold: float | str | None = doc(
        "Upper truncation of the importance weights (with rollout_is); a 'lower_upper' string (e.g. '0.5_4.0') "
        "is IcePop: weights outside [lower, upper] become 0 (rollout_corr/rollout_is_oob_ratio counts them).",
        default=2.0,
    )
    rollout_rs: str | None = doc("Rejection-sampling mode: null (off) or a level.", default=None)
    rollout_rs_threshold: float | str | None = doc("Rejection threshold(s) (with rollout_rs).", default=None)
    bypass_mode: bool = doc(
        "Use the rollout's log-probs as the old policy's (no separate old-log-prob pass).", default=False
    )
    loss_type: str = doc("Policy loss of bypass mode (ppo_clip or reinforce).", default="ppo_clip")
    rollout_is_batch_normalize: bool = doc("Normalise the importance weights to mean 1 over the batch.", default=False)


@dataclass
class AlgoConfig(BaseConfig):
    """Advantage estimation and the KL penalty in the reward."""

    gamma: float = doc("Discount factor.", default=1.0)
    lam: float = doc("GAE lambda.", default=1.0)
    adv_estimator: str = doc("Advantage estimator.", choices=adv_estimator_choices, default="gae")
    norm_adv_by_std_in_grpo: bool = doc("GRPO: divide by the group's std (False: Dr. GRPO).", default=True)
    use_kl_in_reward: bool = doc(
        "Subtract a KL(policy || reference) penalty from the reward; needs the reference.", default=False
    )
    kl_penalty: str = doc("KL estimator of the in-reward penalty.", choices=KL_PENALTIES, default="kl")
    kl_ctrl: KLControlConfig = _section(KLControlConfig, "KL coefficient controller.")
    use_pf_ppo: bool = doc(
        "Policy-filtration PPO: after GAE, redraw the batch (same size, with replacement) weighted by each "
        "response's score (adv_estimator=gae only, as upstream).",
        default=False,
    )
    # The YAML's `pf_ppo` is a section (PFPPOConfig); built without one it is upstream's empty dict.
    pf_ppo: PFPPOConfig = doc("PF-PPO parameters.", default_factory=dict)
    filter_groups: FilterGroupsConfig = _section(FilterGroupsConfig, "Ours. DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = _section(
        RolloutCorrectionConfig, "Correction of the rollout-vs-training probability gap."
    )
    gdpo_reward_keys: list[str] | None = doc(
        "GDPO's reward components (adv_estimator=gdpo): the reward function's extra-info keys (its returned "
        "dict's) normalised apart within each group, e.g. [format_reward, accuracy_reward]. Upstream's dataclass "
        "field, set with `+`.",
        optional=True,
        default=None,
    )
    gdpo_reward_weights: list[float] | None = doc(
        "GDPO's weight of each component, in gdpo_reward_keys' order; null weighs them equally.",
        optional=True,
        default=None,
    )

    def __post_init__(self):
        for key in ("gamma", "lam"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"algorithm.{key}={value} is outside [0, 1]: it weights future rewards (gamma) or "
                    "future TD errors (lam); set a value between 0 and 1 (upstream default 1.0)"
                )
        _check_choice("algorithm", "kl_penalty", self.kl_penalty, KL_PENALTIES)
        if getattr(self.adv_estimator, "value", self.adv_estimator) == "gdpo" and not self.gdpo_reward_keys:
            raise ValueError(
                "algorithm.adv_estimator=gdpo normalises each reward component apart and needs their names: set "
                "+algorithm.gdpo_reward_keys=[...] to keys of the dict your reward function returns"
            )
        weights = self.gdpo_reward_weights
        if weights is not None and len(weights) != len(self.gdpo_reward_keys or []):
            raise ValueError(
                f"algorithm.gdpo_reward_weights has {len(weights)} weights for "
                f"{len(self.gdpo_reward_keys or [])} gdpo_reward_keys; give one per key"
            )
        if isinstance(self.pf_ppo, dict) and (self.pf_ppo or self.use_pf_ppo):
            keys = {f.name for f in dataclasses.fields(PFPPOConfig)}
            unknown = sorted(set(self.pf_ppo) - keys)
            if unknown:
                raise ValueError(
                    f"algorithm.pf_ppo has unknown key(s) {unknown}; its keys are reweight_method and weight_pow"
                )
            object.__setattr__(self, "pf_ppo", PFPPOConfig(**self.pf_ppo))
