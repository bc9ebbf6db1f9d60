"""Kernels kept at upstream's import path `verl.utils.experimental` (the fused log-prob and entropy)."""
