"""Token selection for the rollout engines: temperature, top-k, top-p, greedy, and log-probs.

Pure tensor functions, no host synchronisation (so a CUDA decode loop never stalls on them):

- Temperature divides the logits (`logits / temperature`), exactly as the trainer does when it
  recomputes log-probs, so `rollout_log_probs` and `old_log_probs` agree.
- Top-k then top-p filtering follow the semantics of transformers' warpers (the k-th largest
  logit and ties with it survive top-k; top-p drops the low tail whose cumulative probability is at
  most `1 - top_p` and always keeps the most likely token). Both reduce to one threshold per row
  (`filter_threshold`): a token survives when its tempered logit is at least the threshold. Unlike
  transformers, tokens tied with the smallest survivor of top-p all survive (its sort may split
  exact ties arbitrarily).
- Sampling is an exponential race: with E_i ~ Exp(1) independent, `argmax_i p_i / E_i` is token
  i with probability exactly p_i, computed as `argmax_i (logit_i / T - log E_i)` (no softmax, no
  normalisation). What makes it exact for tiny probabilities is the resolution of E near 0: token i
  wins when E_i is below about p_i / p_max, so a token of probability 1e-9 needs E drawn finely
  down to ~1e-10. The previous inverse-CDF sampler (fp32 cumsum over the vocabulary + searchsorted)
  could not reach a token of p < 3e-8 once the running sum passed 0.5 (it added less than half
  an ulp); with a 152k vocabulary that moved up to ~0.5% of the mass onto the wrong tokens.
  Here the uniforms behind E are float64 in the eager race (`exponential_race`, two levels: the
  same distribution with far fewer random numbers) and 32-bit counter-based (Philox) inside the
  fused CUDA kernel, mapped to E through `-log1p(-u)` at cell midpoints, so E is never 0 and its
  CDF is right down to 2^-32 (tokens above ~1e-9 are drawn at their rate; the mass of tokens far
  below that is off by at most a fraction of it).
- On CUDA one Triton kernel (`fused_sampling`) does temperature, the race, the filter threshold
  and the log-prob in a single pass over the logits, reading them once in their own dtype and
  drawing its random numbers in registers: the eager version (fp32 cast, softmax, cumsum,
  log-softmax) moved ~1 GB per decode step at batch 256 and a 152k vocabulary, about half a
  decode step. The kernel takes its Philox seed from `generator` (or the default generator), so a
  seeded generator reproduces the same tokens.
- The log-prob returned for a token is taken from the temperature-scaled distribution *before*
  top-k/top-p filtering: that is the distribution the trainer evaluates, and using the filtered
  one would make the importance ratio of the first PPO step differ from 1 for no reason. It is
  computed from the logits alone (a log-softmax), never from the noise. Greedy decoding reports
  log-probs of the unscaled logits (temperature 1).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


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

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p removes anything (a vocabulary larger than top_k is assumed)."""
        return self.top_k > 0 or self.top_p < 1.0


def filter_threshold(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """The smallest logit each row of `logits` [B, V] keeps under top-k then top-p, [B]; None when
    neither filter is on. Every token whose logit is at least its row's threshold survives."""
    threshold = None
    if top_k > 0 and top_k < logits.size(-1):
        threshold = torch.topk(logits, top_k, dim=-1).values[:, -1]
        if top_p < 1.0:
            logits = logits.masked_fill(logits < threshold[:, None], float("-inf"))
    if top_p < 1.0:
        sorted_logits = torch.sort(logits, dim=-1).values
        # ascending: the removed low tail is a prefix (cumulative mass <= 1 - top_p); the last
        # (most likely) token always stays, so at most V - 1 entries are removed
        removed = (sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p)[:, :-1].sum(dim=-1)
        threshold = sorted_logits.gather(-1, removed[:, None]).squeeze(-1)
    return threshold


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p filtering of `logits` [B, V]; removed entries become -inf."""
    threshold = filter_threshold(logits, top_k, top_p)
    if threshold is None:
        return logits
    return logits.masked_fill(logits < threshold[:, None], float("-inf"))


RACE_BLOCK = 256  # tokens per block of the two-level race


def exponential_race(
    scaled: torch.Tensor, threshold: torch.Tensor | None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row of the tempered logits `scaled` [B, V], drawn with probability
    softmax(scaled) restricted to `scaled >= threshold[:, None]` (all tokens when None).

    The eager implementation (CPU, and CUDA without triton) races in two levels: blocks of
    `RACE_BLOCK` tokens race with their total weight, then the tokens of the winning block race.
    The minimum of independent exponential clocks is exponential with the summed rate, so this
    draws exactly the distribution of the flat race, with V/256 + 256 random numbers per row
    instead of V (CPU random fills are slow). Weights are exp(logit - max) in fp32 (tokens down to
    1e-38 of the top one keep their relative precision), clocks come from float64 uniforms."""
    B, V = scaled.shape
    if threshold is not None:
        scaled = scaled.masked_fill(scaled < threshold[:, None], float("-inf"))
    weights = torch.sub(scaled, scaled.amax(dim=-1, keepdim=True)).exp_()  # 0 for removed tokens
    full = V // RACE_BLOCK * RACE_BLOCK
    block_weights = weights[:, :full].view(B, -1, RACE_BLOCK).sum(dim=-1)
    if full < V:
        block_weights = torch.cat((block_weights, weights[:, full:].sum(dim=-1, keepdim=True)), dim=1)
    block = _race(block_weights.double(), generator)
    columns = block[:, None] * RACE_BLOCK + torch.arange(RACE_BLOCK, device=scaled.device)
    inner = weights.gather(1, columns.clamp(max=V - 1)).masked_fill_(columns >= V, 0.0)
    return block * RACE_BLOCK + _race(inner.double(), generator)


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """argmax_i weights_i / E_i over the last dim of float64 `weights`, E_i ~ Exp(1) independent.

    E = -log1p(-u) with u a float64 uniform: exact for small E, where an unlikely entry wins
    (u = 0, probability 2^-53, is clamped so a zero weight never scores NaN)."""
    clocks = torch.rand(weights.shape, dtype=torch.float64, device=weights.device, generator=generator)
    clocks.neg_().log1p_().neg_().clamp_(min=torch.finfo(torch.float64).tiny)
    return (weights / clocks).argmax(dim=-1)


def _use_fused_kernel(logits: torch.Tensor) -> bool:
    return logits.is_cuda and _triton_available()


@functools.cache
def _triton_available() -> bool:
    if importlib.util.find_spec("triton") is not None:
        return True
    logger.warning(
        "triton is not importable: the rollout samples with the eager exponential race, which reads the "
        "logits several times per step (install the triton that matches your torch build)"
    )
    return False


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
    temperature = params.logprob_temperature
    if _use_fused_kernel(logits):
        from verl.workers.rollout.fused_sampling import fused_select

        threshold = None
        if params.do_sample and params.filters:
            # the kernel tempers by multiplying with 1/T: the same product here, so the k-th token
            # sits exactly at the threshold and survives
            threshold = filter_threshold(logits.float() * (1.0 / temperature), params.top_k, params.top_p)
        return fused_select(logits, temperature, params.do_sample, threshold, want_logprobs, generator)

    scaled = _tempered(logits.float(), temperature)
    if params.do_sample:
        tokens = exponential_race(scaled, filter_threshold(scaled, params.top_k, params.top_p), generator)
    else:
        tokens = scaled.argmax(dim=-1)
    if not want_logprobs:
        return tokens, None
    logprobs = scaled.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature if temperature != 1.0 else logits
