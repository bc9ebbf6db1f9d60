"""Upstream's reward-loop `DAPORewardManager` ("dapo"): the naive loop plus DAPO's overlong penalty.

Settings, as upstream's reward loop reads them: `reward_model.reward_kwargs.overlong_buffer_cfg`
(`{enable, len, penalty_factor, log}`) and `reward_model.reward_kwargs.max_resp_len`; where
`reward_kwargs` has none, the trainer's own keys are read as the driver's `dapo` manager reads them
(`reward_model.overlong_buffer`, `data.max_response_length`), so both score a batch alike. The penalty
and its checks are the driver's (verl.workers.reward_manager.dapo.OverlongShaping); with `log` each
sample reports `overlong_reward` and `overlong`. As upstream's DAPO loop, `extra_info` gets nothing
from the rollout beyond the row's own.
"""

from __future__ import annotations

from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.experimental.reward_loop.reward_manager.registry import register
from verl.workers.reward_manager.abstract import Sample
from verl.workers.reward_manager.dapo import OverlongShaping

__all__ = ["DAPORewardManager"]


def _overlong_settings(config) -> tuple:
    rm = config.get("reward_model") or {}
    kwargs = rm.get("reward_kwargs") or {}
    buffer_cfg = kwargs.get("overlong_buffer_cfg")
    if buffer_cfg is None:
        buffer_cfg = rm.get("overlong_buffer")
    max_resp_len = kwargs.get("max_resp_len")
    if max_resp_len is None:
        max_resp_len = (config.get("data") or {}).get("max_response_length")
    return buffer_cfg, max_resp_len


@register("dapo")
class DAPORewardManager(NaiveRewardManager):
    """The naive loop plus the overlong penalty (see the module docstring)."""

    ROLLOUT_EXTRA_INFO: tuple[str, ...] = ()

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        buffer_cfg, max_resp_len = _overlong_settings(config)
        self.overlong = OverlongShaping.from_config(buffer_cfg, None if max_resp_len is None else int(max_resp_len))
        self.max_resp_len = self.overlong.max_resp_len

    def shape(self, sample: Sample, score: float, extra: dict) -> float:
        if not self.overlong.enable:
            return score
        penalty = self.overlong.penalty(sample.valid_response_length)
        if self.overlong.log:
            extra["overlong_reward"] = penalty
            extra["overlong"] = penalty < 0
        return score + penalty
