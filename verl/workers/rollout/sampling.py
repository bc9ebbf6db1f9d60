"""Token selection for the rollout engines: temperature, top-k, top-p, greedy, and log-probs.

Pure tensor functions, no host synchronisation (so a CUDA decode loop never stalls on them):

- Temperature divides the logits (`logits / temperature`), exactly as the trainer does when it
  recomputes log-probs, so `rollout_log_probs` and `old_log_probs` agree (the fused kernel
  multiplies by 1/T instead: at most one ulp apart, exact at T = 1).
- Top-k then top-p filtering follow the semantics of transformers' warpers (the k-th largest
  logit and ties with it survive top-k; top-p drops the low tail whose cumulative probability is at
  most `1 - top_p` and always keeps the most likely token). Both reduce to one threshold per row
  (`filter_threshold`): a token survives when its tempered logit is at least the threshold. Unlike
  transformers, tokens tied with the smallest survivor of top-p all survive (its sort may split
  exact ties arbitrarily).
- The fp32 inverse-CDF sampler this replaces (fp32 cumsum over the vocabulary + searchsorted)
  could not reach a token of p < 3e-8 once the running sum passed 0.5 (it added less than half an
  ulp); with a 152k vocabulary that moved up to ~0.5% of the mass onto the wrong tokens. Two exact
  samplers replace it, one per kind of device:
  - CUDA (`fused_sampling`): an exponential race, `argmax_i p_i / E_i` with E_i ~ Exp(1), which is
    token i with probability exactly p_i, computed as `argmax_i (logit_i / T - log E_i)` (no
    softmax, no scan). One Triton kernel does temperature, the race, the filter threshold and the
    log-prob in a single pass over the logits, reading them once in their own dtype and drawing
    its random numbers in registers: the eager sampler (fp32 cast, softmax, cumsum, log-softmax)
    moved ~1 GB per decode step at batch 256 and a 152k vocabulary, about half a decode step. The
    race is decided for an unlikely token i when E_i is below about p_i / p_max, so E must be
    resolved finely near 0: the kernel maps 32-bit Philox words u to E = -log1p(-u) at cell
    midpoints (never 0), right down to 2^-32 (tokens above ~1e-9 are drawn at their rate; the
    mass of tokens far below that is off by at most a fraction of it). Its Philox seed comes from
    `generator` (or the default generator), so a seeded generator reproduces the tokens.
  - CPU (and CUDA without triton): the inverse CDF in float64 (`sample_from_cdf`), exact to ~1e-16.
    The race would need B*V random numbers where the CDF needs B, and CPU random fills are slow:
    the race measured 3-4x slower than the whole float64 CDF path at batch 64-256 and vocabularies
    of 263-4096 tokens.
- The value returned per sampled token follows `rollout.logprobs_mode`, with vLLM's meanings
  (vLLM 0.32 `Sampler`): `processed_logprobs` (the default) is the log-prob under the distribution
  the token was drawn from, `log_softmax` of the tempered logits after top-k/top-p (the removed
  tokens at -inf, so the survivors are renormalised); `processed_logits` the tempered logit itself;
  `raw_logprobs` / `raw_logits` the same before temperature and filtering (the model's own
  distribution). Without top-k/top-p, processed_logprobs is exactly what the trainer recomputes
  (`log_softmax(logits / temperature)`); with them it is not (the trainer evaluates the unfiltered
  distribution), as with vLLM. Greedy decoding has no temperature or filter: processed equals raw.
  The values are computed from the logits alone (a log-softmax or a gather), never from the noise.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

import torch

from verl.workers.config._fields import LOGPROBS_MODES  # vLLM's names (LogprobsMode)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    do_sample: False means greedy (argmax); temperature/top_k/top_p are then ignored.
    temperature: logits are divided by it before filtering and sampling (> 0 when sampling).
    top_k: keep the k most likely tokens; -1 or 0 disables it.
    top_p: nucleus filtering; 1.0 disables it.
    logprobs_mode: what `select_tokens` returns per token when asked (LOGPROBS_MODES, see the module
        docstring).
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    logprobs_mode: str = "processed_logprobs"

    def __post_init__(self):
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode={self.logprobs_mode!r} is not one of {', '.join(LOGPROBS_MODES)} "
                "(actor_rollout_ref.rollout.logprobs_mode)"
            )
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


def sample_from_cdf(
    scaled: torch.Tensor, threshold: torch.Tensor | None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row of the tempered logits `scaled` [B, V], drawn with probability
    softmax(scaled) restricted to `scaled >= threshold[:, None]` (all tokens when None).

    The eager sampler (CPU, and CUDA without triton): the inverse CDF summed in float64, one uniform
    per row. The float64 sum is what makes it exact: it resolves tokens down to ~1e-16 of the mass
    (fp32 lost every token below 3e-8 once the sum passed 0.5). u lies in (0, total], so the first
    index with cdf >= u has cdf[i-1] < u <= cdf[i]: a token of probability 0 is never drawn."""
    if threshold is not None:
        scaled = scaled.masked_fill(scaled < threshold[:, None], float("-inf"))
    # fp32 probabilities (each exact to ~1e-7 relative), summed in float64
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)
    u = (1.0 - torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device, generator=generator)) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(-1)


def _use_fused_kernel(logits: torch.Tensor) -> bool:
    return logits.is_cuda and _triton_available()


@functools.cache
def _triton_available() -> bool:
    if importlib.util.find_spec("triton") is not None:
        return True
    logger.warning(
        "triton is not importable: the rollout samples with the eager float64 inverse CDF, which reads the "
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

    Returns (tokens [B] int64, logprobs [B] float32 or None): for each chosen token the value
    `params.logprobs_mode` names (see the module docstring).
    """
    temperature = params.logprob_temperature
    filtered = params.do_sample and params.filters
    # the one case the sampler's own log-prob answers: the tempered, unfiltered distribution
    sampler_logprobs = want_logprobs and params.logprobs_mode == "processed_logprobs" and not filtered
    if _use_fused_kernel(logits):
        from verl.workers.rollout.fused_sampling import fused_select

        threshold = None
        if filtered:
            # the kernel tempers by multiplying with 1/T: the same product here, so the k-th token
            # sits exactly at the threshold and survives
            threshold = filter_threshold(logits.float() * (1.0 / temperature), params.top_k, params.top_p)
        tokens, logprobs = fused_select(logits, temperature, params.do_sample, threshold, sampler_logprobs, generator)
        if want_logprobs and not sampler_logprobs:
            logprobs = token_logprobs(logits, tokens, params, threshold)
        return tokens, logprobs

    scaled = _tempered(logits.float(), temperature)
    threshold = None
    if params.do_sample:
        threshold = filter_threshold(scaled, params.top_k, params.top_p)
        tokens = sample_from_cdf(scaled, threshold, generator)
    else:
        tokens = scaled.argmax(dim=-1)
    if not want_logprobs:
        return tokens, None
    if sampler_logprobs:
        return tokens, scaled.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, token_logprobs(logits, tokens, params, threshold)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams, threshold: torch.Tensor | None = None
) -> torch.Tensor:
    """The value `params.logprobs_mode` names for token `tokens[b]` of row b of `logits` [B, V]: [B]
    float32 (vLLM's definitions, see the module docstring). `threshold` [B]: the sampler's top-k/top-p
    threshold of the tempered logits when it has one (computed here otherwise)."""
    mode = params.logprobs_mode
    values = logits.float()
    if mode.startswith("processed"):
        values = _tempered(values, params.logprob_temperature)
        if threshold is None and params.do_sample:
            threshold = filter_threshold(values, params.top_k, params.top_p)
        if threshold is not None:
            # the chosen token survived the sampler's filter; keep it even if a rounding difference
            # (the fused kernel multiplies by 1/T) put it a hair under this threshold
            removed = (values < threshold[:, None]).scatter_(1, tokens[:, None], False)
            values = values.masked_fill(removed, float("-inf"))
    if mode.endswith("logprobs"):
        values = values.log_softmax(dim=-1)
    return values.gather(-1, tokens[:, None]).squeeze(-1)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature if temperature != 1.0 else logits
