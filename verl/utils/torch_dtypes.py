"""Precision names and their torch dtypes, upstream's `verl.utils.torch_dtypes`.

A precision may be spelt as an int (16, 32), a string ("16", "fp16", "float16", "bf16", ...) or a
torch dtype; `PrecisionType.to_dtype` maps any of them to the dtype and `to_str` a dtype back to the
short name. Config strings with the "torch.float32" style are `verl.utils.fsdp_utils.to_torch_dtype`'s.
"""

from __future__ import annotations

import torch

__all__ = ["BFLOAT_LIST", "FLOAT_LIST", "HALF_LIST", "PrecisionType"]

HALF_LIST = [16, "16", "fp16", "float16", torch.float16]
FLOAT_LIST = [32, "32", "fp32", "float32", torch.float32]
BFLOAT_LIST = ["bf16", "bfloat16", torch.bfloat16]


class PrecisionType:
    """The precision names upstream's configs use: HALF "16", FLOAT "32", FULL "64", BFLOAT "bf16",
    MIXED "mixed"; static helpers classify and convert any spelling."""

    HALF = "16"
    FLOAT = "32"
    FULL = "64"
    BFLOAT = "bf16"
    MIXED = "mixed"

    @staticmethod
    def supported_types() -> list[str]:
        """["16", "32", "64", "bf16", "mixed"]."""
        return [PrecisionType.HALF, PrecisionType.FLOAT, PrecisionType.FULL, PrecisionType.BFLOAT, PrecisionType.MIXED]

    @staticmethod
    def supported_type(precision: str | int) -> bool:
        """Whether `precision` (a name, or an int such as 16) is one of `supported_types()`."""
        return str(precision) in PrecisionType.supported_types()

    @staticmethod
    def is_fp16(precision) -> bool:
        return precision in HALF_LIST

    @staticmethod
    def is_fp32(precision) -> bool:
        return precision in FLOAT_LIST

    @staticmethod
    def is_bf16(precision) -> bool:
        return precision in BFLOAT_LIST

    @staticmethod
    def to_dtype(precision) -> torch.dtype:
        """torch.float16 / float32 / bfloat16 for any spelling in HALF_LIST / FLOAT_LIST / BFLOAT_LIST."""
        for names, dtype in ((HALF_LIST, torch.float16), (FLOAT_LIST, torch.float32), (BFLOAT_LIST, torch.bfloat16)):
            if precision in names:
                return dtype
        raise RuntimeError(f"unexpected precision: {precision!r}; use one of {HALF_LIST + FLOAT_LIST + BFLOAT_LIST}")

    @staticmethod
    def to_str(precision: torch.dtype) -> str:
        """ "fp16", "fp32" or "bf16" for torch.float16, float32, bfloat16."""
        names = {torch.float16: "fp16", torch.float32: "fp32", torch.bfloat16: "bf16"}
        if precision not in names:
            raise RuntimeError(f"unexpected precision: {precision!r}; one of {list(names)} is expected")
        return names[precision]
