"""Upstream's `verl.utils.kernel` package: `linear_cross_entropy` (log-probs and entropy straight from the
hidden states and the LM head's weight), here over this project's chunked torch function."""
