"""megatron-core support: model-parallel set-up, the CPU shim, vocab-parallel log-probs (imports megatron lazily)."""
