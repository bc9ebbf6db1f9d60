"""`apply_monkey_patch(model, ulysses_sp_size, use_remove_padding, ...)`: upstream's hook for workers that
load a Hugging Face model themselves (verl-recipe's reward-model and PRIME workers call it) and then run
it on packed ("remove padding") inputs, sliced across a Ulysses sequence-parallel group.

- Remove padding needs no patch here: transformers detects packed rows from `position_ids` that
  restart at 0 when no attention mask is given, and its "sdpa" attention then builds the
  block-diagonal causal mask (`verl.utils.remove_padding`). Upstream patches flash-attention for it.
- Ulysses (`ulysses_sp_size` > 1): the model's "sdpa" attention is routed through
  `verl.utils.ulysses.ulysses_attention` whenever upstream's global sequence-parallel group
  (`verl.utils.ulysses.set_ulysses_sequence_parallel_group`) has more than one rank and the layer is
  given `position_ids`: each rank's query/key/value slice is traded for a head shard of the whole
  sequence (all-to-all), the sequence boundaries are read from the all-gathered position ids, and
  the result goes back to the rank's slice. Inputs come from upstream's
  `ulysses_pad_and_slice_inputs`, outputs are joined with `gather_outputs_and_unpad`. As upstream's,
  each layer all-gathers the position ids (a small collective and one host sync per layer).
  Only "sdpa" attention (the CPU and default path here); heads must divide by the group size.
- `use_tiled_mlp`: the model type's MLP class computes in `tiled_mlp_shards` token chunks
  (`verl.models.transformers.tiled_mlp`); a model type without a tiled MLP is a ValueError.
- Refused, with the reason: `use_fused_kernels` (this build's fused log-probs live in the actor,
  `model.use_fused_kernels`, not in a patched model forward), `use_prefix_grouper`.
"""

from __future__ import annotations

__all__ = ["apply_monkey_patch"]


def apply_monkey_patch(
    model,
    ulysses_sp_size: int = 1,
    use_remove_padding: bool = True,
    use_fused_kernels: bool = False,
    fused_kernels_backend: str | None = None,
    use_prefix_grouper: bool = False,
    use_tiled_mlp: bool = False,
    tiled_mlp_shards: int = 4,
) -> None:
    """Prepare `model` (an HF `PreTrainedModel`) for packed inputs, with `ulysses_sp_size` > 1 for Ulysses
    sequence parallelism over the global group, with `use_tiled_mlp` for a tiled MLP (module docstring)."""
    from verl.utils import ulysses

    refused = {
        "use_fused_kernels": (use_fused_kernels, "set the actor's model.use_fused_kernels instead"),
        "use_prefix_grouper": (use_prefix_grouper, "not built"),
    }
    for key, (on, why) in refused.items():
        if on:
            raise NotImplementedError(f"apply_monkey_patch({key}=True) is not supported in this build: {why}")
    config = getattr(model, "config", None)
    if use_tiled_mlp:
        from verl.models.transformers.tiled_mlp import apply_tiled_mlp_monkey_patch

        apply_tiled_mlp_monkey_patch(num_shards=tiled_mlp_shards, model_type=getattr(config, "model_type", None))
    if ulysses_sp_size <= 1:
        return
    text_config = getattr(config, "text_config", None) or config
    ulysses.check_heads_divisible(text_config, ulysses_sp_size)
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(
            f"apply_monkey_patch(ulysses_sp_size={ulysses_sp_size}) needs attn_implementation='sdpa', the model "
            f"uses {impl!r}; load it with attn_implementation='sdpa'"
        )
    if not use_remove_padding:
        raise ValueError(
            f"apply_monkey_patch(ulysses_sp_size={ulysses_sp_size}) needs use_remove_padding=True: Ulysses splits the "
            "packed token sequence across ranks"
        )
    ulysses.patch_sdpa_attention()
