"""Token selection for the rollout engines: temperature, top-k, top-p, greedy, and log-probs.

Pure tensor functions, no host synchronisation (so a CUDA decode loop never stalls on them):

- Temperature divides the logits (`logits / temperature`), exactly as the trainer does when it
  recomputes log-probs, so `rollout_log_probs` and `old_log_probs` agree.
- Top-k then top-p filtering follow the semantics of transformers' warpers (the k-th largest
  logit and ties with it survive top-k; top-p drops the low tail whose cumulative probability is at
  most `1 - top_p` and always keeps the most likely token).
- Sampling inverts the CDF: one uniform number per row, `searchsorted` over the cumulative
  probabilities. It draws exactly from the filtered distribution (a token of probability 0 can
  never be chosen), costs B random numbers instead of B*V (CPU random fills are slow), and is free
  of host syncs, unlike some `multinomial` kernels.
- The log-prob returned for a token is taken from the temperature-scaled distribution *before*
  top-k/top-p filtering: that is the distribution the trainer evaluates, and using the filtered
  one would make the importance ratio of the first PPO step differ from 1 for no reason. Greedy
  decoding reports log-probs of the unscaled logits (temperature 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    do_sample: False means greedy (argmax); temperature/top_k/top_p are then ignored.
    temperature: logits are divided by it before filtering and sampling (> 0 when sampling).
    top_k: keep the k most likely tokens; -1 or 0 disables it.
    top_p: nucleus filtering; 1.0 disables it.
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature={self.temperature} with do_sample=True: sampling needs a temperature > 0; "
                "set do_sample=False for greedy decoding"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]; use 1.0 to disable nucleus filtering")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be a positive number of tokens, or -1/0 to disable it")

    @property
    def logprob_temperature(self) -> float:
        return self.temperature if self.do_sample else 1.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p filtering of `logits` [B, V]; removed entries become -inf."""
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1.0 - top_p)
        sorted_remove[..., -1] = False
        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def select_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    want_logprobs: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose one token per row of `logits` [B, V].

    Returns (tokens [B] int64, logprobs [B] float32 or None): the log-prob of each chosen token
    under `log_softmax(logits / temperature)` (see the module docstring).
    """
    logits = logits.float()
    if params.do_sample:
        scaled = logits / params.temperature if params.temperature != 1.0 else logits
        cdf = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1).cumsum(dim=-1)
        # u in (0, total]: the first index with cdf >= u exists and has cdf[i-1] < u <= cdf[i], so p[i] > 0
        u = (1.0 - torch.rand(cdf.shape[0], 1, device=cdf.device, generator=generator)) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u).squeeze(-1)
    else:
        scaled = logits
        tokens = logits.argmax(dim=-1)
    if not want_logprobs:
        return tokens, None
    logprobs = scaled.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs
