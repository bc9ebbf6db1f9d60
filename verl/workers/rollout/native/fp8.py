"""Block-wise fp8 weights for the built-in engine (`rollout.quantization=fp8`).

The format is upstream's online fp8 rollout (vLLM with `quantization=fp8` and the
`quantization_config` `{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`): each linear weight [out, in] is cut into 128 x 128 blocks
(the last ones partial; upstream pads with zeros, which changes no block's maximum), every block
gets one float32 scale `scale_inv = 1 / (448 / max|w|)` (448: the largest finite `float8_e4m3fn`;
an all-zero block gets 1), and the stored weight is `round_to_e4m3(w * 448 / max|w|)` clamped to
+-448. Dequantised: `w8 * scale_inv`. The scales of a weight are `[ceil(out/128), ceil(in/128)]`,
upstream's `weight_scale_inv` layout.

What is quantised is what upstream's vLLM fp8 path quantises: the linear layers of the decoder
layers (q/k/v/o projections, gate/up/down). Embeddings, the LM head, norms and biases stay in the
engine's dtype.

Each HF tensor is quantised on its own, as upstream quantises each weight it streams into vLLM,
even where the native decoder stacks several (q, k, v into `qkv`; gate and up into `gate_up`):
a stacked buffer keeps one run of scale rows per part, and `Fp8Linear` knows which scale row
every weight row reads (`row_scale`). The forward dequantises one layer's weight right before its
matmul (into the engine's compute dtype; a per-layer temporary), which is exact to the stored
values and runs on every device; a `torch._scaled_mm` path (fp8 tensor cores) is not built.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
WEIGHT_BLOCK_SIZE = (128, 128)  # upstream's weight_block_size
# upstream's hf_overrides["quantization_config"] for vLLM's online fp8 rollout
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(WEIGHT_BLOCK_SIZE),
}


def num_blocks(size: int, block: int) -> int:
    return math.ceil(size / block)


def quantize_blockwise(
    weight: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [M, N] (any float dtype) -> (`float8_e4m3fn` [M, N], float32 scale_inv [ceil(M/bm), ceil(N/bn)])."""
    if weight.dim() != 2:
        raise ValueError(f"block-wise fp8 quantises 2-D linear weights, got shape {tuple(weight.shape)}")
    bm, bn = block
    M, N = weight.shape
    rows, cols = num_blocks(M, bm), num_blocks(N, bn)
    padded = torch.zeros(rows * bm, cols * bn, dtype=torch.float32, device=weight.device)
    padded[:M, :N] = weight
    blocks = padded.view(rows, bm, cols, bn)
    amax = blocks.abs().amax(dim=(1, 3))  # [rows, cols]
    # upstream's arithmetic: multiply by 448 / amax, store its reciprocal (1 ulp from amax / 448)
    scale = torch.where((amax > 0) & (amax < torch.inf), FP8_MAX / amax, torch.ones_like(amax))
    q = (blocks * scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale_inv = scale.reciprocal()
    return q.view(rows * bm, cols * bn)[:M, :N].contiguous(), scale_inv


def dequantize_blockwise(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = WEIGHT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The inverse map of `quantize_blockwise` (exact to the stored values): `w8 * scale_inv`, in `dtype`."""
    M, N = weight.shape
    rows = torch.arange(M, device=weight.device) // block[0]
    cols = torch.arange(N, device=weight.device) // block[1]
    return (weight.float() * scale_inv[rows][:, cols]).to(dtype)


class Fp8Linear:
    """A stack of `layers` fp8 linear weights [out, in], each the concatenation along `out` of parts
    (e.g. q, k, v) that were quantised separately, with their block scales.

    `data` [L, out, in] fp8, `scale_inv` [L, sum of each part's row blocks, ceil(in/128)] float32;
    `row_scale` [out]: the scale row each weight row reads, `col_scale` [in]: the scale column."""

    def __init__(self, layers: int, part_rows: list[int], in_features: int, device: torch.device):
        bm, bn = WEIGHT_BLOCK_SIZE
        self.part_rows = list(part_rows)
        out = sum(part_rows)
        self.data = torch.empty(layers, out, in_features, dtype=FP8_DTYPE, device=device)
        scale_rows = sum(num_blocks(r, bm) for r in part_rows)
        self.scale_inv = torch.ones(layers, scale_rows, num_blocks(in_features, bn), dtype=torch.float32, device=device)
        row_scale, first = [], 0
        for rows in part_rows:
            row_scale.append(first + torch.arange(rows, device=device) // bm)
            first += num_blocks(rows, bm)
        self.row_scale = torch.cat(row_scale)
        self.col_scale = torch.arange(in_features, device=device) // bn

    def part(self, layer: int, index: int) -> Fp8Part:
        """The load target of part `index` of layer `layer` (its rows of `data` and of `scale_inv`)."""
        bm = WEIGHT_BLOCK_SIZE[0]
        lo = sum(self.part_rows[:index])
        s_lo = sum(num_blocks(r, bm) for r in self.part_rows[:index])
        rows = self.part_rows[index]
        return Fp8Part(self.data[layer, lo : lo + rows], self.scale_inv[layer, s_lo : s_lo + num_blocks(rows, bm)])

    def dequantize(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """Layer `layer`'s weight [out, in] in `dtype` (the forward's per-layer temporary)."""
        scales = self.scale_inv[layer].index_select(0, self.row_scale).index_select(1, self.col_scale)
        return (self.data[layer].float() * scales).to(dtype)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()


class Fp8Part:
    """Where one HF linear weight lands: its fp8 rows and its scale rows; `copy_` quantises."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor):
        self.data = data
        self.scale_inv = scale_inv
        self.shape = data.shape

    def copy_(self, weight: torch.Tensor) -> None:
        q, scale_inv = quantize_blockwise(weight.to(self.data.device))
        self.data.copy_(q)
        self.scale_inv.copy_(scale_inv)
