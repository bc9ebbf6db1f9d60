"""Model FLOPs of a training step, for `perf/mfu/actor` (and `perf/mfu/critic`).

Counted analytically from the HF config of a decoder-only transformer (Llama/Qwen2/Mistral
shapes: attention with grouped KV heads, a gated MLP, an output head):

- matmul FLOPs: 2 per multiply-accumulate, so a forward costs 2 x (matmul parameters) per token;
  a training step (forward + backward, the backward being twice the forward) costs 3 forwards;
- attention scores and the weighted sum add 2 x 2 x heads x head_dim per (query, key) pair and
  layer in the forward; a sequence of length s attending to itself counts s^2 pairs (the causal
  half is counted in full, the usual convention, which keeps MFU comparable with other
  frameworks' reports and with torch's operator count);
- the output head (the vocabulary projection, or a critic's one-output value head) costs
  2 x hidden x outputs per position it is applied to;
- embeddings are lookups (no FLOPs); norms, activations and the optimizer are ignored.

What an update counts (`FlopsCounter.rows_training_flops`): the work the actor actually ran, on real
tokens only. On the shared-prompt path (`verl.utils.shared_prompt`) each distinct prompt goes
through the model once per micro-batch and each response on top of it, instead of every row's
prompt + response; zero-advantage rows and mini-batches the actor skips are not run, so not
counted; the output head counts only the positions that predict a response token. Padding, a
gradient-checkpointing recompute and the dense T^2 mask of packed sequences are work the device
does but the model does not need, so they are left out: the count is a lower bound of the
operator-level count (`torch.utils.flop_counter.FlopCounterMode`), and MFU never overstates. (A
count of 6 x parameters x (prompt + response) for every row overstated it by ~40% at n=8 with
128 + 256 tokens.)

MFU = counted FLOPs / seconds / (peak FLOP/s of one device x devices), the seconds measured
between two device synchronisations around the update itself (not the parameter offload around
it). The peak is the dense bf16 figure of the local GPU (`verl.utils.device.peak_flops_per_device`);
on CPU or an unlisted device there is no meaningful peak, so no MFU is reported unless
`VERL_PEAK_FLOPS` (FLOP/s per device, e.g. `2e12`) says what to measure against.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from verl.utils.device import collective_device, peak_flops_per_device


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


class FlopsCounter:
    """FLOPs of forward and training passes, from a transformers `PretrainedConfig`.

    `head_outputs` is the width of the output head: the vocabulary (default) for a causal LM, 1 for
    a value model."""

    def __init__(self, config, head_outputs: int | None = None):
        text = getattr(config, "text_config", None) or config
        self.hidden = int(_get(text, "hidden_size", "n_embd"))
        self.layers = int(_get(text, "num_hidden_layers", "n_layer"))
        self.heads = int(_get(text, "num_attention_heads", "n_head"))
        self.kv_heads = int(_get(text, "num_key_value_heads", default=self.heads))
        self.head_dim = int(_get(text, "head_dim", default=self.hidden // self.heads))
        self.intermediate = int(_get(text, "intermediate_size", default=4 * self.hidden))
        self.vocab = int(_get(text, "vocab_size"))
        self.head_outputs = self.vocab if head_outputs is None else int(head_outputs)
        self.gated_mlp = _get(text, "model_type", default="") not in ("gpt2", "gpt_neox", "opt")

    @classmethod
    def for_model(cls, config, head_outputs: int | None = None) -> FlopsCounter | None:
        """A counter for an HF config, or None when `config` is None or not an HF decoder config
        (no hidden size, layer or head count, vocabulary): such a model reports no MFU."""
        if config is None:
            return None
        try:
            return cls(config, head_outputs)
        except (TypeError, ValueError):  # int(None): a field the shape needs is missing
            return None

    @property
    def layer_matmul_params(self) -> int:
        """Parameters of the attention and MLP projections of every layer (one matmul each per token)."""
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        attention = self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attention + mlp)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: the layers' projections plus the output head
        (tied to the embeddings or not, it is a matmul)."""
        return self.layer_matmul_params + self.hidden * self.head_outputs

    def forward_flops(self, num_tokens, attended_pairs, head_positions):
        """FLOPs of one forward: `num_tokens` tokens through the layers, `attended_pairs` (query, key)
        pairs in each layer's attention, the output head at `head_positions` positions. Numbers or
        tensors (then a tensor, on their device)."""
        return (
            2.0 * self.layer_matmul_params * num_tokens
            + 4.0 * self.heads * self.head_dim * self.layers * attended_pairs
            + 2.0 * self.hidden * self.head_outputs * head_positions
        )

    def training_flops(self, seqlens: Sequence[int]) -> float:
        """FLOPs of one forward + backward over sequences of these (unpadded) lengths, the head applied
        at every position."""
        tokens = sum(seqlens)
        return 3.0 * self.forward_flops(tokens, sum(s * s for s in seqlens), tokens)

    def rows_training_flops(self, prompt_lengths, response_lengths, groups=None, passes: int = 3):
        """FLOPs of one forward + backward over rows as the actor runs them (see the module docstring).

        `prompt_lengths`, `response_lengths`: [B] real token counts (tensors). `groups`: None for rows
        run whole (prompt + response each), or `(first_rows [U], inverse [B])` from
        `verl.utils.shared_prompt.prompt_groups` when the shared-prompt path ran them: each group's
        prompt once, then each response's inputs (all but its last token, which predicts nothing) on
        top of it, and the head on each group's last prompt position plus those inputs. `passes`:
        forward + backward cost 3 forwards (the backward computes input and weight gradients), 2
        when the weights are frozen (LoRA: the backward computes input gradients only). Returns a
        float64 0-d tensor on the lengths' device (no host sync).
        """
        prompt = prompt_lengths.to(torch.float64)
        response = response_lengths.to(torch.float64)
        if groups is None:
            whole = prompt + response
            return passes * self.forward_flops(whole.sum(), (whole * whole).sum(), response.sum())
        first_rows, inverse = groups
        group_prompt = prompt[first_rows]
        inputs = (response - 1).clamp(min=0)
        tokens = group_prompt.sum() + inputs.sum()
        attended = (group_prompt * group_prompt).sum() + (inputs * (group_prompt[inverse] + inputs)).sum()
        return passes * self.forward_flops(tokens, attended, len(first_rows) + inputs.sum())

    def estimate_flops(self, batch_seqlens: Sequence[int], delta_time: float, **kwargs) -> tuple[float, float]:
        """Upstream's MFU helper: (achieved TFLOP/s, the device's peak TFLOP/s) for a training step
        over sequences of `batch_seqlens` real tokens that took `delta_time` seconds.

        Achieved counts `training_flops(batch_seqlens)` (this module's conventions: every position
        through the output head, the full s^2 attention pairs, no embedding FLOPs), so it can differ
        from upstream's per-model-type formulas by those terms. The peak is `peak_flops()`
        (`VERL_PEAK_FLOPS` or the known GPU's bf16 figure) and, as upstream reports an unknown device,
        infinity when there is none (an MFU computed from it is then 0). Keyword arguments of
        upstream's per-architecture estimators (e.g. multimodal `images_seqlens`) are not used here
        and are refused rather than ignored.
        """
        if kwargs:
            raise TypeError(f"FlopsCounter.estimate_flops got unsupported arguments {sorted(kwargs)}")
        if not delta_time > 0:
            raise ValueError(f"delta_time must be positive seconds, got {delta_time!r}")
        achieved = self.training_flops([int(s) for s in batch_seqlens]) / delta_time / 1e12
        peak = peak_flops()
        return achieved, (peak / 1e12 if peak is not None else float("inf"))


class FlopsTally:
    """The training FLOPs of the micro-batches one update ran (`counter` None: nothing is counted).

    `add` keeps each micro-batch's count as a 0-d tensor on the device of its attention mask (the
    same device for every micro-batch of one update), so counting never waits for the device;
    `total` sums them once, when the worker computes MFU after the update."""

    def __init__(self, counter: FlopsCounter | None, passes: int = 3):
        self.counter = counter
        self.passes = passes  # see FlopsCounter.rows_training_flops
        self._terms: list[torch.Tensor] = []

    def reset(self) -> None:
        self._terms = []

    def add(self, attention_mask: torch.Tensor, response_length: int, groups=None) -> None:
        """Count one micro-batch from its [B, P + R] attention mask (prompt columns first, then the
        `response_length` response columns); `groups` as for `FlopsCounter.rows_training_flops`."""
        if self.counter is None:
            return
        prompt = attention_mask[:, : attention_mask.shape[1] - response_length].sum(-1)
        response = attention_mask[:, attention_mask.shape[1] - response_length :].sum(-1)
        self._terms.append(self.counter.rows_training_flops(prompt, response, groups, self.passes))

    def total(self) -> float | None:
        """FLOPs counted since the last `reset` (waits for the device once); None without a counter."""
        if self.counter is None:
            return None
        if not self._terms:
            return 0.0
        return float(torch.stack(self._terms).sum())


def peak_flops(dtype=None) -> float | None:
    """Peak FLOP/s of one device: `VERL_PEAK_FLOPS` when set, else the known GPU table, else None."""
    override = os.environ.get("VERL_PEAK_FLOPS")
    if override:
        try:
            value = float(override)
        except ValueError:
            raise ValueError(
                f"VERL_PEAK_FLOPS={override!r} is not a number; give FLOP/s per device, e.g. 2e12"
            ) from None
        return value if value > 0 else None
    return peak_flops_per_device(dtype or torch.bfloat16)


def mfu_over_ranks(flops: float, seconds: float, dp_size: int) -> float | None:
    """MFU of one update over all ranks of the default group (a collective when there are several).

    `flops` is what this rank counted (`rows_training_flops` of the rows it ran), `seconds` its
    synchronised update time, `dp_size` the number of data-parallel replicas: every rank of a
    replica (tensor / pipeline / context parallel ranks) counts the same rows, so each contributes
    `flops * dp_size / world`, and the sum over all ranks is the replicas' total. The slowest rank's
    time counts (the others waited for it in the collectives). None when the peak is unknown (the
    same on every rank, so either all ranks take part or none).
    """
    peak = peak_flops()
    if peak is None:
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    total, slowest = float(flops) * dp_size / world, float(seconds)
    if world > 1:
        device = collective_device()
        total_t = torch.tensor([total], dtype=torch.float64, device=device)
        slowest_t = torch.tensor([slowest], dtype=torch.float64, device=device)
        dist.all_reduce(total_t)
        dist.all_reduce(slowest_t, op=dist.ReduceOp.MAX)
        total, slowest = float(total_t), float(slowest_t)
    if slowest <= 0:
        return None
    return total / slowest / (peak * world)
