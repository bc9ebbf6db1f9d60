"""A compact inference forward for Llama-family decoders (Llama, Qwen2, Mistral) with a static KV cache.

Why it exists: per decode step, transformers' `generate()` runs ~1,000 ATen calls through ~60
module calls and re-concatenates every layer's K/V cache (`DynamicCache` uses `torch.cat`: on the
1M-parameter model at batch 64 on one CPU thread that copy alone is ~5 of its ~12 ms per step).
This module is the whole model as ~25 tensor ops per layer over a few flat buffers, with a cache
that is written in place.

Design decisions:
- Weights live in a handful of fused buffers: per layer `qkv` (q, k, v stacked on the output dim,
  with Qwen2's biases), `gate_up` (gate and up stacked), `o`, `down`, two norms; layers are stacked
  on a leading dim so the whole model is ~10 allocations. Every HF parameter name maps to a view
  into these buffers (`_target_views`), so a weight sync is one in-place `copy_` per incoming
  tensor, in any order, streamed one at a time (no second full copy) and converted to the engine's
  dtype/device by the copy itself. Per-layer (transposed) views for the decode step are built once.
- The KV cache is preallocated `[layers, batch, kv_heads, max_len, head_dim]`; prompts are
  left-padded so every row writes cache column `t` at step `t`. Padding is an additive key bias
  `[batch, max_len]` (0 or a large negative), updated in place as columns fill, which serves both
  the prefill mask and every decode step; per-row rotary positions come from the caller.
- The decode step keeps hidden states 2-D `[batch, hidden]` and rides residual adds on `addmm`.
  Attention: on CPU one SDPA call (its flash kernel handles GQA and the additive mask; measured
  faster than explicit matmuls); on accelerators two batched matmuls over grouped query heads
  (`[B, kv, group, D]` against `[B, kv, len, D]`), which read each K/V once, do not depend on which
  SDPA backend accepts a mask, and are valid inside a CUDA graph (the step index is a device
  tensor; `kv_len` is a Python int that the graph runner buckets). The scores QK^T come out of the
  first matmul in fp32 (`bmm(..., out_dtype=float32)`, no fp32 copy of the cache): rounding them
  to bf16 first, as a plain bf16 matmul does, shifts the softmax by up to ~0.4% per score and
  widens the gap to the trainer's log-probs, whose SDPA keeps fp32 scores.
- Prefill attention: K/V are expanded to all query heads and the padding/causal mask is passed
  as a boolean mask, a combination the memory-efficient SDPA kernel accepts (it rejects grouped
  K/V, flash rejects masks; both together fell back to the math kernel, which materialises fp32
  [B, heads, P, P] scores: ~60 GB per layer at 256 prompts of 2048 tokens). A chunk without left
  padding skips the mask (`is_causal`, flash). Prompts are prefilled `prefill_tokens` tokens at a
  time (whole rows, at least one), which bounds the activations and the mask; the default is
  upstream's `max_num_batched_tokens` (8192).
- Row bookkeeping for the engine: `prefill(..., rows=)` writes each distinct prompt's K/V to every
  cache row that repeats it, straight from the layer's fresh K/V (chunk by chunk of distinct
  prompts, each chunk's cache rows found once up front; when the rows repeat each prompt n times
  in blocks, GRPO's layout, one broadcast copy per layer instead of an indexed gather + scatter:
  ~4x less CPU time for that write on the bundled task); `select_rows` gathers the rows
  still generating to the front, one layer at a time (a whole-cache temporary measured ~2x slower
  on CPU: page faults and cache misses).
- Where a CPU decode step goes (tiny model, batch 64, one thread): matmuls ~48% (at ~73 GFLOP/s,
  MKL's per-core rate; pre-packed MKL/oneDNN weights were no faster), attention ~28% (reading the
  KV cache, memory-bound), everything else ~24%. Tried and not kept, within noise: in-place
  SiLU-and-multiply, and RoPE as one in-place complex multiply with one combined K/V write (~2%).
- No torch.compile: on torch 2.13 CPU the inductor-compiled decode step measured ~5x slower than
  eager (it turns the in-place cache writes into whole-cache copies and emits loop code for the
  tiny per-head matmuls), after ~20 s of compilation per shape. CUDA graphs are the accelerator's
  answer to per-op overhead.
- RMSNorm, rotary embedding and softmax reproduce transformers' numerics (fp32 norm statistics,
  cos/sin computed in fp32 then cast, fp32 softmax), so greedy tokens equal the HF model's.
- `quantization="fp8"` (rollout.quantization) stores the decoder layers' linear weights as
  `float8_e4m3fn` with upstream's 128 x 128 block scales (`native.fp8`): a weight sync quantises
  each incoming HF tensor into its slice of the fused buffer, and the forward dequantises one
  layer's weight right before its matmul.
- Anything not accepted by `unsupported_reason` (sliding windows, dynamic/long RoPE, partial
  rotary, MLP biases, non-SiLU activations) is refused here; the engine then uses the generic HF path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verl.workers.rollout.native.fp8 import Fp8Linear

NATIVE_MODEL_TYPES = ("llama", "qwen2", "mistral")
QUANTIZATIONS = (None, "fp8")  # rollout.quantization values the native decoder runs (module `fp8`)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Buffers that HF state dicts may carry but that the native forward recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")
_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.|_orig_mod\.)")
_NEG = -1e30  # additive bias for masked keys; finite so a fully masked (padding) row never turns NaN
DEFAULT_PREFILL_TOKENS = 8192  # upstream's rollout.max_num_batched_tokens default
_MIN_ROPE_POSITIONS = 4096  # the rotary table grows geometrically from here (each growth recaptures graphs)


@dataclass(frozen=True)
class LlamaSpec:
    """Shape and numerics of a Llama-family decoder, read from an HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def num_parameters(self) -> int:
        per_layer = (
            self.qkv_size * self.hidden_size
            + (self.qkv_size if self.qkv_bias else 0)
            + self.num_heads * self.head_dim * self.hidden_size
            + (self.hidden_size if self.o_bias else 0)
            + 3 * self.intermediate_size * self.hidden_size
            + 2 * self.hidden_size
        )
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x layout
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        scaling["rope_theta"] = getattr(config, "rope_theta", 10000.0)
        params = scaling
    return dict(params)


def unsupported_reason(config) -> str | None:
    """Why the native forward cannot run this HF config, or None when it can."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "vision_config", None) is not None:
        # checked first: the text config inside a Qwen2.5-VL config would otherwise pass as a Qwen2
        return (
            f"{model_type!r} is a vision-language model (vision tower, multimodal M-RoPE positions), which the native "
            "decoder does not run; the generic HF path generates with its images"
        )
    if model_type not in NATIVE_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {NATIVE_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r} (only silu)"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias=True"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return f"Mistral sliding_window={config.sliding_window}"
    if model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        return "Qwen2 use_sliding_window=True"
    rope = _rope_parameters(config)
    if any(isinstance(v, dict) for v in rope.values()):
        return "per-layer-type RoPE parameters"
    if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rope_type={rope.get('rope_type')!r} (static types only: {STATIC_ROPE_TYPES})"
    return None


def spec_from_hf_config(config) -> LlamaSpec:
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"the native decoder does not support this model: {reason}")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    rope = _rope_parameters(config)
    if rope.get("rope_type", "default") == "default":
        base = float(rope.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        attention_scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
    model_type = config.model_type
    return LlamaSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(getattr(config, "attention_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rope_inv_freq=tuple(inv_freq.float().tolist()),
        rope_attention_scaling=float(attention_scaling),
    )


def _bmm_writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.bmm(a, b, out_dtype=torch.float32)` runs for `dtype` inputs on `device`
    (torch >= 2.8 on CUDA: the GEMM accumulates and writes fp32; CPU has no such kernel)."""
    if dtype == torch.float32:
        return False
    # the decode step's layout: grouped queries against a transposed slice of a longer cache
    q = torch.zeros(2, 3, 8, dtype=dtype, device=device)
    keys = torch.zeros(2, 1, 16, 8, dtype=dtype, device=device)[:, :, :5].reshape(2, 5, 8)
    try:
        scores = torch.bmm(q, keys.transpose(1, 2), out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return scores.dtype == torch.float32 and scores.shape == (2, 3, 5)


def repeats_in_blocks(rows: torch.Tensor, num_prompts: int) -> int | None:
    """n when `rows` [N] is [0]*n + [1]*n + ... + [num_prompts-1]*n (n > 1), else None (one host sync)."""
    n = rows.shape[0] // max(num_prompts, 1)
    if n < 2 or n * num_prompts != rows.shape[0]:
        return None
    blocks = torch.arange(num_prompts, device=rows.device).repeat_interleave(n)
    return n if bool(torch.equal(rows, blocks)) else None


def canonical_name(name: str) -> str:
    """Strip wrapper prefixes that FSDP, activation checkpointing and torch.compile add to names."""
    name = _WRAPPER_PREFIXES.sub("", name)
    return name[len("module.") :] if name.startswith("module.") else name


class LlamaDecoder:
    """Weights, static KV cache and the prefill/decode forward of one Llama-family model.

    Lifecycle: `allocate_weights()` + `load_weights(...)`, then per batch `reserve(batch, max_len)`,
    `prefill(...)`, `decode_step(...)` per token. `release_cache()` / `release_weights()` free the
    memory (for `sleep`); the object stays usable after re-allocation.
    """

    def __init__(
        self,
        spec: LlamaSpec,
        device: torch.device,
        dtype: torch.dtype,
        prefill_tokens: int | None = DEFAULT_PREFILL_TOKENS,
        quantization: str | None = None,
    ):
        if quantization not in QUANTIZATIONS:
            raise ValueError(
                f"rollout quantization={quantization!r}: the built-in engine runs {QUANTIZATIONS} "
                "(actor_rollout_ref.rollout.quantization)"
            )
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        # fp8: the decoder layers' linear weights are stored block-quantised (`fp8` module docstring)
        self.quantization = quantization
        self.fp8: dict[str, Fp8Linear] = {}
        # prompt tokens per prefill forward (whole rows, at least one); None: every row at once
        self.prefill_tokens = prefill_tokens
        self.weights: dict[str, torch.Tensor] = {}
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.key_bias: torch.Tensor | None = None
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._layers: list[tuple] = []
        self._batch_views: dict[int, tuple] = {}
        # Decode attention. CPU: SDPA, one call (its flash kernel handles GQA and the additive mask).
        # Accelerators: explicit grouped matmuls, which read each K/V once and are graph-safe.
        self.fused_attention = self.device.type == "cpu"
        # Set by an engine that replays the decode step in CUDA graphs (`DecodeGraphRunner`). Without
        # graphs nothing reads a cache cell before writing it (prefill writes columns [0, P) of every
        # row, each decode step its column before attending to it, `select_rows` copies written
        # columns), so the cache is allocated uninitialised and the rotary table holds only the
        # positions asked for: re-allocated after every `sleep`, zeroing the cache and a 4096-position
        # table cost ~20% of a CPU generate of the bundled task.
        self.cuda_graphs = False
        self._bmm_out_dtype = _bmm_writes_fp32(self.device, dtype)

    # ----------------------------------------------------------------------------------- weights
    def allocate_weights(self) -> None:
        s, dev, dt = self.spec, self.device, self.dtype
        L, Hd, I = s.num_layers, s.hidden_size, s.intermediate_size  # noqa: E741
        attn_out = s.num_heads * s.head_dim

        def empty(*shape):
            return torch.empty(*shape, device=dev, dtype=dt)

        w = {
            "embed": empty(s.vocab_size, Hd),
            "norm": empty(Hd),
            "ln1": empty(L, Hd),
            "ln2": empty(L, Hd),
            "qkv": empty(L, s.qkv_size, Hd),
            "o": empty(L, Hd, attn_out),
            "gate_up": empty(L, 2 * I, Hd),
            "down": empty(L, Hd, I),
        }
        if s.qkv_bias:
            w["qkv_b"] = empty(L, s.qkv_size)
        if s.o_bias:
            w["o_b"] = empty(L, Hd)
        if not s.tie_word_embeddings:
            w["lm_head"] = empty(s.vocab_size, Hd)
        if self.quantization == "fp8":
            kv = s.num_kv_heads * s.head_dim
            parts = {
                "qkv": ([attn_out, kv, kv], Hd),
                "o": ([Hd], attn_out),
                "gate_up": ([I, I], Hd),
                "down": ([Hd], I),
            }
            self.fp8 = {kind: Fp8Linear(L, rows, cols, dev) for kind, (rows, cols) in parts.items()}
            for kind, linear in self.fp8.items():  # fp8 payloads and scales (counted by weight_bytes)
                w[kind], w[kind + "_scale_inv"] = linear.data, linear.scale_inv
        self.weights = w
        self._targets = self._target_views(w)
        # fp8: the decode step dequantises each layer's views as it goes (`_dequantized_layer_views`)
        self._layers = [] if self.fp8 else [self._layer_views(w, i) for i in range(L)]

    @staticmethod
    def _layer_views(w: dict[str, torch.Tensor], i: int) -> tuple:
        """Per-layer weight views for the decode step, transposed for `addmm` (built once, not per token)."""
        return (
            w["ln1"][i],
            w["qkv"][i].t(),
            w["qkv_b"][i] if "qkv_b" in w else None,
            w["o"][i],
            w["o"][i].t(),
            w["o_b"][i] if "o_b" in w else None,
            w["ln2"][i],
            w["gate_up"][i].t(),
            w["down"][i].t(),
        )

    def _target_views(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = self.spec
        q_end = s.num_heads * s.head_dim
        k_end = q_end + s.num_kv_heads * s.head_dim
        views = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"]}
        views["lm_head.weight"] = w["embed"] if s.tie_word_embeddings else w["lm_head"]
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            views[p + "input_layernorm.weight"] = w["ln1"][i]
            views[p + "post_attention_layernorm.weight"] = w["ln2"][i]
            for kind, key in (("weight", "qkv"), ("bias", "qkv_b")):
                if key in w:
                    views[p + f"self_attn.q_proj.{kind}"] = w[key][i, :q_end]
                    views[p + f"self_attn.k_proj.{kind}"] = w[key][i, q_end:k_end]
                    views[p + f"self_attn.v_proj.{kind}"] = w[key][i, k_end:]
            views[p + "self_attn.o_proj.weight"] = w["o"][i]
            if "o_b" in w:
                views[p + "self_attn.o_proj.bias"] = w["o_b"][i]
            views[p + "mlp.gate_proj.weight"] = w["gate_up"][i, : s.intermediate_size]
            views[p + "mlp.up_proj.weight"] = w["gate_up"][i, s.intermediate_size :]
            views[p + "mlp.down_proj.weight"] = w["down"][i]
            if self.fp8:  # the linear weights land quantised, each HF tensor on its own (its own scales)
                linear_parts = {
                    "self_attn.q_proj": ("qkv", 0),
                    "self_attn.k_proj": ("qkv", 1),
                    "self_attn.v_proj": ("qkv", 2),
                    "self_attn.o_proj": ("o", 0),
                    "mlp.gate_proj": ("gate_up", 0),
                    "mlp.up_proj": ("gate_up", 1),
                    "mlp.down_proj": ("down", 0),
                }
                for module, (kind, index) in linear_parts.items():
                    views[p + module + ".weight"] = self.fp8[kind].part(i, index)
        return views

    def parameter_names(self) -> list[str]:
        """HF names a full weight sync must deliver (`lm_head.weight` is optional when tied)."""
        return [n for n in self._targets if not (self.spec.tie_word_embeddings and n == "lm_head.weight")]

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the fused buffers in place; returns the names consumed."""
        if not self.weights:
            raise RuntimeError("the decoder's weights are released (sleep); call wake_up() before update_weights()")
        loaded = set()
        for raw_name, tensor in named_tensors:
            name = canonical_name(raw_name)
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            target = self._targets.get(name)
            if target is None and ("model." + name) in self._targets:
                name = "model." + name
                target = self._targets[name]
            if target is None:
                raise KeyError(
                    f"weight {raw_name!r} has no place in the native {self.spec.num_layers}-layer decoder; "
                    "expected HF Llama/Qwen2/Mistral names such as 'model.layers.0.self_attn.q_proj.weight'"
                )
            if hasattr(tensor, "full_tensor"):  # a DTensor shard from FSDP2: gather this one tensor
                tensor = tensor.full_tensor()
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"weight {raw_name!r} has shape {tuple(tensor.shape)} but the rollout model expects "
                    f"{tuple(target.shape)}; the synced model must have the same config as the rollout's"
                )
            target.copy_(tensor)
            loaded.add(name)
        return loaded

    def release_weights(self) -> None:
        self.weights = {}
        self.fp8 = {}
        self._targets = {}
        self._layers = []

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    # ------------------------------------------------------------------------------------- cache
    def cache_capacity(self) -> tuple[int, int]:
        if self.k_cache is None:
            return 0, 0
        return self.k_cache.shape[1], self.k_cache.shape[3]

    def reserve(self, batch: int, max_len: int, max_position: int) -> bool:
        """Make room for `batch` rows of `max_len` tokens; returns True when buffers were (re)allocated."""
        s = self.spec
        cap_b, cap_t = self.cache_capacity()
        grown = False
        if batch > cap_b or max_len > cap_t:
            self.release_cache()
            shape = (s.num_layers, batch, s.num_kv_heads, max_len, s.head_dim)
            # zeros with CUDA graphs: their bucket-padding rows read cache rows never written
            alloc = torch.zeros if self.cuda_graphs else torch.empty
            self.k_cache = alloc(shape, device=self.device, dtype=self.dtype)
            self.v_cache = alloc(shape, device=self.device, dtype=self.dtype)
            self.key_bias = torch.zeros(batch, max_len, device=self.device, dtype=self._key_bias_dtype())
            self._batch_views = {}
            grown = True
        if self._cos is None or self._cos.shape[0] < max_position:
            # grow geometrically: every rebuild moves the table, which invalidates captured graphs
            current = 0 if self._cos is None else self._cos.shape[0]
            floor = _MIN_ROPE_POSITIONS if self.cuda_graphs else 0
            self._build_rope_table(max(max_position, self.cache_capacity()[1], 2 * current, floor))
            grown = True
        return grown

    def _key_bias_dtype(self) -> torch.dtype:
        """fp32 for fp32/bf16/fp16 (the scores' precision), the model's own dtype for float64: torch
        2.13's CPU SDPA kernel reads a float32 mask under float64 queries as if it were float64 once
        the keys span more than 8 columns (garbage scores, wrong tokens; a test compares against
        transformers' float64 generate)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def _build_rope_table(self, num_positions: int) -> None:
        s = self.spec
        inv_freq = torch.tensor(s.rope_inv_freq, dtype=torch.float32, device=self.device)
        freqs = torch.arange(num_positions, device=self.device, dtype=torch.float32)[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * s.rope_attention_scaling).to(self.dtype)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin, exactly
        sin = (emb.sin() * s.rope_attention_scaling).to(self.dtype)
        sin[:, : s.head_dim // 2].neg_()
        self._sin = sin

    def _views_for(self, batch: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Key bias and per-layer (K, V) cache views for the first `batch` rows, built once per size."""
        views = self._batch_views.get(batch)
        if views is None:
            layers = [(self.k_cache[i, :batch], self.v_cache[i, :batch]) for i in range(self.spec.num_layers)]
            views = self._batch_views[batch] = (self.key_bias[:batch], layers)
        return views

    def select_rows(self, index: torch.Tensor, columns: int) -> None:
        """Cache rows [0, len(index)) become copies of rows `index` (cache columns [0, columns)).

        Drops finished rows (a subset, in order). Rows past len(index) keep stale but finite
        contents, which CUDA-graph bucket padding may read. Gathered one layer at a time: on CPU a
        whole-cache temporary costs ~2x more (page faults, cache misses) than per-layer ones."""
        n = index.shape[0]
        for cache in (self.k_cache, self.v_cache):
            for layer in cache:
                layer[:n, :, :columns] = layer[:, :, :columns].index_select(0, index)
        self.key_bias[:n, :columns] = self.key_bias[:, :columns].index_select(0, index)

    def release_cache(self) -> None:
        self._batch_views = {}
        self.k_cache = self.v_cache = self.key_bias = None
        self._cos = self._sin = None

    def cache_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.k_cache, self.v_cache, self.key_bias, self._cos, self._sin)
            if t is not None
        )

    def cache_row_bytes(self, max_len: int) -> int:
        """Bytes one cache row of `max_len` columns takes: K and V of every layer plus its key bias."""
        s = self.spec
        kv = 2 * s.num_layers * s.num_kv_heads * s.head_dim * max_len * self.dtype.itemsize
        return kv + self._key_bias_dtype().itemsize * max_len

    def decode_row_bytes(self) -> int:
        """Working memory of one row in a decode step: its logits in the model dtype and in fp32
        (the sampler), plus the step's largest activations (qkv, gate/up, residuals)."""
        s = self.spec
        activations = s.qkv_size + 2 * s.intermediate_size + 4 * s.hidden_size
        return s.vocab_size * (self.dtype.itemsize + 4) + activations * self.dtype.itemsize

    def prefill_bytes(self, rows: int, prompt_len: int) -> int:
        """Peak working memory of prefilling `rows` prompts of `prompt_len` tokens in one forward:
        per token the residual stream, qkv, K/V expanded to all heads, attention output and the
        gate/up activations; per row the boolean mask and its additive copy, and the logits; with fp8
        weights also one layer's dequantisation (`dequantize_bytes`)."""
        s = self.spec
        per_token = 4 * s.hidden_size + s.qkv_size + 3 * s.num_heads * s.head_dim + 3 * s.intermediate_size
        mask = rows * prompt_len * prompt_len * (1 + self.dtype.itemsize)
        activations = rows * prompt_len * per_token * self.dtype.itemsize + mask + rows * s.vocab_size * 4
        return activations + self.dequantize_bytes()

    def dequantize_bytes(self) -> int:
        """fp8: the transient memory of dequantising the largest layer weight (its fp32 copy, the
        expanded scales and the result in the compute dtype); 0 otherwise."""
        if self.quantization != "fp8":
            return 0
        s = self.spec
        largest = s.hidden_size * max(s.qkv_size, s.num_heads * s.head_dim, 2 * s.intermediate_size)
        return largest * (4 + 4 + self.dtype.itemsize)

    def prefill_rows(self, prompt_len: int) -> int:
        """Prompts per prefill forward: `prefill_tokens // prompt_len`, at least one."""
        if self.prefill_tokens is None:
            return 1 << 62
        return max(1, self.prefill_tokens // max(prompt_len, 1))

    # ----------------------------------------------------------------------------------- forward
    def _linear(self, kind: str, layer: int) -> torch.Tensor:
        """Layer `layer`'s `kind` weight ('qkv', 'o', 'gate_up', 'down') in the compute dtype."""
        if self.fp8:
            return self.fp8[kind].dequantize(layer, self.dtype)
        return self.weights[kind][layer]

    def _dequantized_layer_views(self, i: int) -> tuple:
        """`_layer_views` of layer `i` with its fp8 linear weights dequantised (one layer at a time)."""
        w = self.weights
        o = self._linear("o", i)
        return (
            w["ln1"][i],
            self._linear("qkv", i).t(),
            w["qkv_b"][i] if "qkv_b" in w else None,
            o,
            o.t(),
            w["o_b"][i] if "o_b" in w else None,
            w["ln2"][i],
            self._linear("gate_up", i).t(),
            self._linear("down", i).t(),
        )

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.spec.rms_norm_eps)
        # transformers normalises in fp32, casts back, then scales by the weight in the model dtype
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.spec.rms_norm_eps).to(x.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x*cos + rotate_half(x)*sin; `sin` comes from the signed table (see _build_rope_table)
        return x * cos + torch.roll(x, self.spec.head_dim // 2, dims=-1) * sin

    def _mlp(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        w = self.weights
        h = self._norm(x, w["ln2"][layer])
        gate, up = F.linear(h, self._linear("gate_up", layer)).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self._linear("down", layer))

    def _logits(self, x_last: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weights
        head = w.get("lm_head", w["embed"])
        if out is None:
            return F.linear(self._norm(x_last, w["norm"]), head)
        return torch.mm(self._norm(x_last, w["norm"]), head.t(), out=out)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """fp32 attention scores q @ keys^T for q [N, G, D] and keys [N, T, D] (a view of the cache)."""
        keys_t = keys.transpose(1, 2)
        if self.dtype == torch.float32:
            return torch.bmm(q, keys_t)
        if self._bmm_out_dtype:
            return torch.bmm(q, keys_t, out_dtype=torch.float32)
        return torch.bmm(q.float(), keys_t.float())  # an fp32 copy of the keys: slower, same numbers

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the left-padded prompts [B, P], fill cache columns [0, P); returns last-position logits [B, V].

        `rows` [N] (optional) fans the prompts out: cache row r gets prompt `rows[r]`'s keys and
        values, for rows [0, N), written straight from each layer's fresh K/V (no second pass).
        Prompts run `prefill_rows(P)` at a time; the result does not depend on the chunking.
        """
        B, P = input_ids.shape
        valid = attention_mask.bool()
        N = B if rows is None else rows.shape[0]
        self.key_bias.fill_(_NEG)
        self.key_bias[N:, 0] = 0.0  # rows beyond N (CUDA-graph bucket padding) must not be fully masked
        self.key_bias[:N, :P].masked_fill_(valid if rows is None else valid[rows], 0.0)

        chunk = min(B, self.prefill_rows(P))
        repeats = None if rows is None else repeats_in_blocks(rows, B)
        if repeats is not None:
            # rows [0]*n + [1]*n + ...: a chunk's prompts own cache rows [lo*n, hi*n), written by a
            # broadcast copy (a strided memcpy) instead of an indexed gather and scatter
            logits = [
                self._prefill_chunk(
                    input_ids[lo : lo + chunk],
                    valid[lo : lo + chunk],
                    position_ids[lo : lo + chunk],
                    slice(lo * repeats, min(lo + chunk, B) * repeats),
                    None,
                    repeats,
                )
                for lo in range(0, B, chunk)
            ]
            return logits[0] if len(logits) == 1 else torch.cat(logits)
        if rows is not None:
            # cache rows grouped by the prompt they repeat, so a chunk of prompts owns one contiguous
            # run of `order` (one host sync for all chunks)
            order = torch.argsort(rows, stable=True)
            ends = torch.bincount(rows, minlength=B).cumsum(0).tolist()
        logits = []
        for lo in range(0, B, chunk):
            hi = min(lo + chunk, B)
            if rows is None:
                targets, sources = slice(lo, hi), None
            else:
                first = ends[lo - 1] if lo else 0
                targets = order[first : ends[hi - 1]]
                sources = rows[targets] - lo
            logits.append(self._prefill_chunk(input_ids[lo:hi], valid[lo:hi], position_ids[lo:hi], targets, sources))
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _prefill_chunk(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        position_ids: torch.Tensor,
        targets: slice | torch.Tensor,
        sources: torch.Tensor | None,
        repeats: int = 1,
    ) -> torch.Tensor:
        """Prefill prompts [b, P]; cache rows `targets` get the K/V of prompts `sources` (None: the
        prompts themselves, in order, each on `repeats` consecutive rows). Returns last-position
        logits [b, V]."""
        s, w = self.spec, self.weights
        B, P = input_ids.shape
        H, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
        G = H // KV
        if bool(valid.all()):  # no left padding: plain causal attention, no mask (flash on accelerators)
            mask = None
        else:
            # causal over real keys; a padding query attends to itself only, so it stays finite
            causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()
            mask = (causal & valid[:, None, None, :]) | torch.eye(P, dtype=torch.bool, device=self.device)
        cos = self._cos[position_ids][:, :, None, :]
        sin = self._sin[position_ids][:, :, None, :]

        x = F.embedding(input_ids, w["embed"])
        for i in range(s.num_layers):
            h = self._norm(x, w["ln1"][i])
            qkv = F.linear(h, self._linear("qkv", i), w["qkv_b"][i] if "qkv_b" in w else None)
            qk = self._rotate(qkv[..., : (H + KV) * D].view(B, P, H + KV, D), cos, sin)
            q = qk[:, :, :H].transpose(1, 2)
            k = qk[:, :, H:].transpose(1, 2)
            v = qkv[..., (H + KV) * D :].view(B, P, KV, D).transpose(1, 2)
            if repeats > 1:
                self.k_cache[i, targets, :, :P].unflatten(0, (B, repeats)).copy_(k[:, None])
                self.v_cache[i, targets, :, :P].unflatten(0, (B, repeats)).copy_(v[:, None])
            else:
                self.k_cache[i, targets, :, :P] = k if sources is None else k.index_select(0, sources)
                self.v_cache[i, targets, :, :P] = v if sources is None else v.index_select(0, sources)
            if G > 1:  # every query head its own K/V: the memory-efficient kernel takes no grouped K/V
                k = k[:, :, None].expand(B, KV, G, P, D).reshape(B, H, P, D)
                v = v[:, :, None].expand(B, KV, G, P, D).reshape(B, H, P, D)
            causal_flag = mask is None
            if i == s.num_layers - 1:  # past the last K/V write only the last position matters
                q, x = q[:, :, -1:], x[:, -1:]
                if mask is not None:
                    mask = mask[:, :, -1:]
                causal_flag = False  # the last query sees every key (torch aligns is_causal top-left)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal_flag, scale=D**-0.5)
            o = o.transpose(1, 2).reshape(B, q.shape[2], H * D)
            x = x + F.linear(o, self._linear("o", i), w["o_b"][i] if "o_b" in w else None)
            x = self._mlp(x, i)
        return self._logits(x[:, -1])

    @torch.no_grad()
    def decode_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step_index: torch.Tensor,
        kv_len: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per row: `tokens`/`positions` [B], written at cache column `step_index` ([1] int64
        device tensor); attends over the first `kv_len` columns. Returns logits [B, V], written into
        `out` when given (the CUDA-graph runner's one static output buffer).

        Capture-safe for CUDA graphs: no host syncs and no data-dependent shapes. Hidden states stay
        2-D [B, hidden] and residual adds ride on `addmm`, to keep the op count per layer minimal.
        """
        s = self.spec
        B = tokens.shape[0]
        H, KV, D, I = s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size  # noqa: E741
        G, qk_size, scale = H // KV, (H + KV) * D, D**-0.5
        key_bias, caches = self._views_for(B)
        key_bias.index_fill_(1, step_index, 0.0)
        bias = key_bias[:, None, None, :kv_len]
        cos = self._cos[positions][:, None, :]
        sin = self._sin[positions][:, None, :]

        x = F.embedding(tokens, self.weights["embed"])
        layers = self._layers if not self.fp8 else map(self._dequantized_layer_views, range(s.num_layers))
        for (ln1, qkv_t, qkv_b, o_w, o_t, o_b, ln2, gate_up_t, down_t), (k_cache, v_cache) in zip(layers, caches):
            h = self._norm(x, ln1)
            qkv = torch.addmm(qkv_b, h, qkv_t) if qkv_b is not None else h @ qkv_t
            qk = self._rotate(qkv[:, :qk_size].view(B, H + KV, D), cos, sin)
            k_cache.index_copy_(2, step_index, qk[:, H:, None])
            v_cache.index_copy_(2, step_index, qkv[:, qk_size:].view(B, KV, 1, D))
            keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
            if self.fused_attention:
                o = F.scaled_dot_product_attention(
                    qk[:, :H, None], keys, values, attn_mask=bias, scale=scale, enable_gqa=G > 1
                ).view(B, H * D)
            else:
                scores = self._scores(qk[:, :H].reshape(B * KV, G, D), keys.reshape(B * KV, kv_len, D))
                # in place: one fewer [B, heads, kv_len] fp32 temporary in the CUDA-graph pool
                scores = scores.view(B, KV, G, kv_len).mul_(scale).add_(bias)
                probs = scores.softmax(dim=-1).to(self.dtype)
                o = torch.matmul(probs, values).view(B, H * D)
            x = x + F.linear(o, o_w, o_b) if o_b is not None else torch.addmm(x, o, o_t)
            gate_up = self._norm(x, ln2) @ gate_up_t
            x = torch.addmm(x, F.silu(gate_up[:, :I]) * gate_up[:, I:], down_t)
        return self._logits(x, out)
