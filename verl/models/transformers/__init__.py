"""Upstream's `verl.models.transformers` package: `monkey_patch.apply_monkey_patch` for workers that load
a Hugging Face model themselves, `tiled_mlp`, and `qwen2_vl.get_rope_index` (M-RoPE positions of one
Qwen2-VL sequence from its processor)."""
