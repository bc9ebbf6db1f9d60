"""Upstream's named rollout-correction presets, one mixin for both config classes."""

from __future__ import annotations


class RolloutCorrectionPresets:
    """Upstream's named presets (`RolloutCorrectionConfig.decoupled_token_is()`, ...), shared by this
    module's config and the config tree's `verl.trainer.config.algorithm.RolloutCorrectionConfig`: each
    builds `cls(...)` from the same field names."""

    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0):
        """Token-level truncated IS (token TIS) against recomputed old log-probs."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0):
        """Sequence-level truncated IS (sequence TIS)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5):
        """Token-level IcePop: token weights outside [threshold_lower, threshold] become 0, the mask is kept."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.5_2.0"):
        """Sequence TIS plus rejection of responses whose whole-sequence ratio leaves the bounds."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_sum_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: str | float = "0.999_1.001"):
        """Rejection by the per-token geometric mean of the ratio (length-normalised), no weights."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5):
        """Bypass mode with REINFORCE weighted by token-level IcePop weights (0 outside the band)."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=f"{threshold_lower}_{threshold}",
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_ppo_clip(cls):
        """Bypass mode, PPO's clipped surrogate on pi / pi_rollout."""
        return cls(bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: str | float = "0.999_1.001"):
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01):
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0):
        """Bypass mode, REINFORCE with sequence-level truncated IS."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: str | float = "0.999_1.001"):
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"):
        """Geometric-mean rejection plus sequence-level truncated IS."""
        return cls._tis_with_rs("sequence", is_threshold, "seq_mean_k1", rs_threshold)

    @classmethod
    def decoupled_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"):
        """Geometric-mean rejection plus token-level truncated IS."""
        return cls._tis_with_rs("token", is_threshold, "seq_mean_k1", rs_threshold)

    @classmethod
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"):
        """Bypass mode, REINFORCE with geometric-mean rejection and sequence-level truncated IS."""
        return cls._tis_with_rs("sequence", is_threshold, "seq_mean_k1", rs_threshold, bypass="reinforce")

    @classmethod
    def bypass_pg_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"):
        """Bypass mode, REINFORCE with geometric-mean rejection and token-level truncated IS."""
        return cls._tis_with_rs("token", is_threshold, "seq_mean_k1", rs_threshold, bypass="reinforce")

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01):
        """Rejection of responses whose mean per-token k3 divergence exceeds the threshold, no weights."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01):
        """Mean-k3 rejection plus sequence-level truncated IS."""
        return cls._tis_with_rs("sequence", is_threshold, "seq_mean_k3", rs_threshold)

    @classmethod
    def decoupled_k3_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01):
        """Mean-k3 rejection plus token-level truncated IS."""
        return cls._tis_with_rs("token", is_threshold, "seq_mean_k3", rs_threshold)

    @classmethod
    def disabled(cls):
        """No weights, no rejection, no bypass (the off-policy metrics are still logged)."""
        return cls(rollout_is=None, rollout_rs=None)

    @classmethod
    def _tis_with_rs(
        cls, level: str, is_threshold: float, rs: str, rs_threshold: str | float, bypass: str | None = None
    ):
        modes = {} if bypass is None else {"bypass_mode": True, "loss_type": bypass}
        return cls(
            rollout_is=level,
            rollout_is_threshold=is_threshold,
            rollout_rs=rs,
            rollout_rs_threshold=rs_threshold,
            **modes,
        )
