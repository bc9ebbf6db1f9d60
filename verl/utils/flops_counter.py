"""Model FLOPs of a training step, for `perf/mfu/actor` (and `perf/mfu/critic`).

Counted analytically from the HF config of a decoder-only transformer (Llama/Qwen2/Mistral
shapes: attention with grouped KV heads, a gated MLP, a vocabulary projection):

- matmul FLOPs: 2 per multiply-accumulate, so a forward costs 2 x (matmul parameters) per token;
  a training step (forward + backward, the backward being twice the forward) costs 6 x that;
- attention scores and the weighted sum add 2 x 2 x seqlen x (heads x head_dim) per token and
  layer in the forward, i.e. 12 x sum(seqlen^2) x heads x head_dim x layers per training step
  when each sequence attends to itself causally counted in full (the usual convention, which
  keeps MFU comparable with other frameworks' reports);
- embeddings are lookups (no FLOPs); norms, activations and the optimizer are ignored.

MFU = counted FLOPs / seconds / (peak FLOP/s of one device x devices). The peak is the dense
bf16 figure of the local GPU (`verl.utils.device.peak_flops_per_device`); on CPU or an unlisted
device there is no meaningful peak, so no MFU is reported unless `VERL_PEAK_FLOPS` (FLOP/s per
device, e.g. `2e12`) says what to measure against.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


class FlopsCounter:
    """FLOPs of one training pass over a batch, from a transformers `PretrainedConfig`."""

    def __init__(self, config):
        text = getattr(config, "text_config", None) or config
        self.hidden = int(_get(text, "hidden_size", "n_embd"))
        self.layers = int(_get(text, "num_hidden_layers", "n_layer"))
        self.heads = int(_get(text, "num_attention_heads", "n_head"))
        self.kv_heads = int(_get(text, "num_key_value_heads", default=self.heads))
        self.head_dim = int(_get(text, "head_dim", default=self.hidden // self.heads))
        self.intermediate = int(_get(text, "intermediate_size", default=4 * self.hidden))
        self.vocab = int(_get(text, "vocab_size"))
        self.gated_mlp = _get(text, "model_type", default="") not in ("gpt2", "gpt_neox", "opt")

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: attention and MLP projections of every
        layer plus the output projection to the vocabulary (tied or not, it is a matmul)."""
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        attention = self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + self.hidden * self.vocab

    def training_flops(self, seqlens: Sequence[int]) -> float:
        """FLOPs of one forward + backward over sequences of these (unpadded) lengths."""
        tokens = sum(seqlens)
        dense = 6.0 * self.matmul_params * tokens
        attention = 12.0 * sum(s * s for s in seqlens) * self.heads * self.head_dim * self.layers
        return dense + attention


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
    import torch

    from verl.utils.device import peak_flops_per_device

    return peak_flops_per_device(dtype or torch.bfloat16)


def mfu(counter: FlopsCounter, seqlens: Sequence[int], seconds: float, n_devices: int, passes: int = 1) -> float | None:
    """Model FLOPs utilisation of `passes` training passes over the global batch `seqlens` that
    took `seconds` on `n_devices` devices; None when the device's peak is unknown."""
    peak = peak_flops()
    if peak is None or seconds <= 0 or n_devices <= 0:
        return None
    return counter.training_flops(seqlens) * passes / seconds / (peak * n_devices)
