"""DAPO's reward manager: per-sample scores plus the overlong-buffer length penalty.

With ``overlong_buffer_cfg.enable``, a response longer than ``max_resp_len - len`` loses
``penalty_factor`` times the fraction of the buffer it runs into, linearly, down to ``-penalty_factor``
at ``max_resp_len`` (DAPO paper, "soft overlong punishment"). With ``log``, the penalty and whether it
applied are reported per sample (``overlong_reward``, ``overlong``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config.reward_model import OverlongBufferConfig
from verl.workers.reward_manager.abstract import AbstractRewardManager, Sample, ScoreOutcome
from verl.workers.reward_manager.registry import register


def overlong_penalty(valid_response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment of one response (<= 0): 0 up to `max_resp_len - buffer_len` tokens,
    then falling linearly by `penalty_factor / buffer_len` per token, to `-penalty_factor` at `max_resp_len`."""
    exceed = valid_response_length - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


@dataclass(frozen=True)
class OverlongShaping:
    """The overlong buffer's settings, checked (`from_config`); `penalty(n)` is `overlong_penalty` of a
    response of n valid tokens. Shared by this manager and the reward loop's DAPORewardManager."""

    enable: bool
    len: int
    penalty_factor: float
    log: bool
    max_resp_len: int | None

    @classmethod
    def from_config(cls, overlong_buffer_cfg: OverlongBufferConfig | Mapping | None, max_resp_len: int | None):
        cfg = omega_conf_to_dataclass(overlong_buffer_cfg, OverlongBufferConfig)
        shaping = cls(bool(cfg.enable), int(cfg.len), float(cfg.penalty_factor), bool(cfg.log), max_resp_len)
        if shaping.enable:
            if max_resp_len is None:
                raise ValueError(
                    "the overlong buffer (reward_model.overlong_buffer.enable=True) needs max_resp_len; pass "
                    "max_resp_len=data.max_response_length to the reward manager"
                )
            if not 0 < shaping.len <= max_resp_len:
                raise ValueError(
                    f"reward_model.overlong_buffer.len={shaping.len} must be in (0, max_resp_len={max_resp_len}]; "
                    "otherwise every response would be penalised. Lower the buffer or raise data.max_response_length"
                )
        return shaping

    def penalty(self, valid_response_length: int) -> float:
        return overlong_penalty(valid_response_length, self.max_resp_len, self.len, self.penalty_factor)


@register("dapo")
class DAPORewardManager(AbstractRewardManager):
    """NaiveRewardManager + overlong penalty.

    Args (beyond the base class):
        max_resp_len: the rollout's maximum response length in tokens (``data.max_response_length``).
        overlong_buffer_cfg: ``reward_model.overlong_buffer``: an ``OverlongBufferConfig``, or a mapping of
            its keys ``{enable, len, penalty_factor, log}`` (missing keys take the YAML's defaults).
    """

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        max_resp_len: int | None = None,
        overlong_buffer_cfg: OverlongBufferConfig | Mapping | None = None,
        on_error: str = "raise",
    ):
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, on_error)
        self.overlong = OverlongShaping.from_config(overlong_buffer_cfg, max_resp_len)
        self.max_resp_len = max_resp_len

    def compute_scores(self, samples: list[Sample]) -> list[ScoreOutcome]:
        return [self.call_one(sample) for sample in samples]

    def adjust_scores(self, samples: list[Sample], scores: list[float], extra_info: dict[str, list]) -> list[float]:
        # upstream's rule: a function that returns a bare number has it reported as the sample's `acc`
        # (what DAPO's group filter reads with filter_groups.metric=acc); a dict reports its own keys
        from_dict = extra_info["score"] if "score" in extra_info else [None] * len(scores)
        for sample in samples:
            i = sample.index
            if from_dict[i] is None and not extra_info["reward_error"][i]:
                extra_info["acc"][i] = scores[i]
        if not self.overlong.enable:
            return scores
        adjusted = []
        for sample, score in zip(samples, scores):
            penalty = self.overlong.penalty(sample.valid_response_length)
            adjusted.append(score + penalty)
            if self.overlong.log:
                extra_info["overlong_reward"][sample.index] = penalty
                extra_info["overlong"][sample.index] = penalty < 0
        return adjusted
