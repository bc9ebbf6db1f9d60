"""The sampler as one Triton kernel: temperature, exponential race, filter threshold and log-prob in
one pass over the logits (see `sampling` for the semantics, which this reproduces).

Why a hand-written kernel: at batch 256 and a 152k vocabulary the logits are 78 MB in bf16, and the
eager sampler (fp32 copy, softmax, cumsum, log-softmax, each a full read and write) moved ~1 GB per
decode step, about half the step of a 0.5B model. The kernel reads the logits once in their own
dtype and keeps everything else in registers. `torch.compile` would fuse the arithmetic too, but its
random numbers come from a per-element Philox call (four times the work of the one used here) and
ignore a user's `torch.Generator`, and it costs a compile per process.

Design decisions:
- Temperature multiplies by 1/T (a division per element costs ~10 instructions): at most one ulp
  from `logits / T`, i.e. ~1e-7 relative in a log-prob; exact for T = 1.
- One program per row walks the vocabulary in blocks of 4 x QUARTER; each lane keeps its own
  running best score/index and online log-sum-exp, reduced across lanes at the end (the smallest
  index among equal scores wins, as `torch.argmax` does).
- Randomness: one Philox4x32-10 call per lane and block gives four 32-bit words, one per quarter
  block; the counter is (element index / 4, row), the key a 62-bit seed drawn from the caller's
  generator (one tiny `randint` per call, on the device: no host sync). A word r maps to
  u = (r + 1/2) / 2^32, never 0 or 1, and E = -log1p(-u): a cubic series below u = 2^-7 (error
  < 1e-7 relative), `-log` of the complement (computed from ~r, so it never rounds to 0) above.
- The kernel launches under the logits' device context, so a caller on another current device
  (the agent loop's engine thread) still runs it where the tensors live.
- Works unchanged under `TRITON_INTERPRET=1` on CPU tensors, which is how the CPU tests exercise
  its arithmetic without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verl.utils.device import device_context

_MAX_QUARTER = 1024


_TWO_POW_NEG32 = tl.constexpr(2.3283064365386963e-10)
_SERIES_BELOW = tl.constexpr(0.0078125)  # 2^-7: below it E = -log1p(-u) comes from its cubic series


@triton.jit
def _update(
    row_ptr,
    offs,
    vocab,
    inv_temperature,
    threshold,
    r,
    best,
    best_idx,
    best_x,
    run_max,
    run_sum,
    SAMPLE: tl.constexpr,
    FILTERED: tl.constexpr,
    LOGPROBS: tl.constexpr,
):
    """One quarter block of a row: fold its tokens into each lane's best score and log-sum-exp."""
    valid = offs < vocab
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
    if LOGPROBS:
        new_max = tl.maximum(run_max, x)
        # a lane that has seen only -inf keeps a zero sum (and avoids -inf - -inf)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
        run_max = new_max
    score = x
    if SAMPLE:
        u = (r.to(tl.float32) + 0.5) * _TWO_POW_NEG32
        complement = ((~r).to(tl.float32) + 0.5) * _TWO_POW_NEG32
        e_series = u * (1.0 + u * (0.5 + u * (1.0 / 3.0)))
        e = tl.where(u < _SERIES_BELOW, e_series, -tl.log(complement))
        score = x - tl.log(e)
    if FILTERED:
        score = tl.where(x >= threshold, score, float("-inf"))
    score = tl.where(valid, score, float("-inf"))
    better = score > best
    best = tl.where(better, score, best)
    best_idx = tl.where(better, offs, best_idx)
    best_x = tl.where(better, x, best_x)
    return best, best_idx, best_x, run_max, run_sum


@triton.jit
def _race_kernel(
    logits_ptr,
    row_stride,
    vocab,
    inv_temperature,
    threshold_ptr,
    seed_ptr,
    token_ptr,
    logprob_ptr,
    SAMPLE: tl.constexpr,
    FILTERED: tl.constexpr,
    LOGPROBS: tl.constexpr,
    QUARTER: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    lanes = tl.arange(0, QUARTER)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32)
    best_x = tl.zeros([QUARTER], tl.float32)
    run_max = tl.full([QUARTER], float("-inf"), tl.float32)
    run_sum = tl.zeros([QUARTER], tl.float32)
    threshold = 0.0
    if FILTERED:
        threshold = tl.load(threshold_ptr + row)
    seed = 0
    if SAMPLE:
        seed = tl.load(seed_ptr)
    row_word = tl.zeros([QUARTER], tl.uint32) + row.to(tl.uint32)
    zero_word = tl.zeros([QUARTER], tl.uint32)
    for start in range(0, vocab, 4 * QUARTER):
        counter = (start // 4 + lanes).to(tl.uint32)
        if SAMPLE:
            r0, r1, r2, r3 = tl.philox(seed, counter, row_word, zero_word, zero_word)
        else:
            r0, r1, r2, r3 = counter, counter, counter, counter
        offs = start + lanes
        best, best_idx, best_x, run_max, run_sum = _update(
            row_ptr, offs, vocab, inv_temperature, threshold, r0, best, best_idx, best_x, run_max, run_sum,
            SAMPLE, FILTERED, LOGPROBS,
        )  # fmt: skip
        best, best_idx, best_x, run_max, run_sum = _update(
            row_ptr, offs + QUARTER, vocab, inv_temperature, threshold, r1, best, best_idx, best_x, run_max,
            run_sum, SAMPLE, FILTERED, LOGPROBS,
        )  # fmt: skip
        best, best_idx, best_x, run_max, run_sum = _update(
            row_ptr, offs + 2 * QUARTER, vocab, inv_temperature, threshold, r2, best, best_idx, best_x, run_max,
            run_sum, SAMPLE, FILTERED, LOGPROBS,
        )  # fmt: skip
        best, best_idx, best_x, run_max, run_sum = _update(
            row_ptr, offs + 3 * QUARTER, vocab, inv_temperature, threshold, r3, best, best_idx, best_x, run_max,
            run_sum, SAMPLE, FILTERED, LOGPROBS,
        )  # fmt: skip
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    tl.store(token_ptr + row, token.to(tl.int64))
    if LOGPROBS:
        # lanes that never improved hold index 0 with x 0, so they add nothing to the sum
        x_token = tl.sum(tl.where(best_idx == token, best_x, 0.0), axis=0)
        m = tl.max(run_max, axis=0)
        total = tl.sum(run_sum * tl.exp(run_max - m), axis=0)
        tl.store(logprob_ptr + row, x_token - m - tl.log(total))


def fused_select(
    logits: torch.Tensor,
    temperature: float,
    sample: bool,
    threshold: torch.Tensor | None,
    want_logprobs: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens [B] int64 (and log-probs [B] float32 of log_softmax(logits / temperature) when
    `want_logprobs`) for `logits` [B, V]: an exponential race over the tokens whose tempered logit is
    at least `threshold` [B] (all when None) if `sample`, else the argmax (pass temperature 1)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    device = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=device)
    logprobs = torch.empty(B, dtype=torch.float32, device=device) if want_logprobs else tokens
    # a 62-bit Philox key from the caller's generator, drawn on the device (no host sync)
    seed = torch.randint(0, 1 << 62, (1,), dtype=torch.int64, device=device, generator=generator) if sample else tokens
    if threshold is not None:
        threshold = threshold.to(torch.float32).contiguous()
    quarter = min(_MAX_QUARTER, triton.next_power_of_2(max(16, -(-V // 4))))
    with device_context(device):
        _race_kernel[(B,)](
            logits,
            logits.stride(0),
            V,
            1.0 / float(temperature),
            threshold if threshold is not None else logits,
            seed,
            tokens,
            logprobs,
            SAMPLE=sample,
            FILTERED=threshold is not None,
            LOGPROBS=want_logprobs,
            QUARTER=quarter,
            num_warps=8 if quarter >= 512 else 4,
        )
    return tokens, (logprobs if want_logprobs else None)
