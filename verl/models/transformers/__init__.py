"""Upstream's `verl.models.transformers` package: `monkey_patch.apply_monkey_patch` for workers that load
a Hugging Face model themselves."""
