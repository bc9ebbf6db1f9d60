"""Test helpers for the megatron backend: tiny HF Qwen2/Llama models with every weight perturbed.

The models use grouped-query attention (4 heads, 2 key/value groups) so tensor parallelism splits
both heads and groups, and the 263-token character vocabulary, which tp=2 must pad: both are
where a layout mistake would show. Weights (biases and norm scales included) get random noise, so
a conversion that drops or swaps one cannot go unnoticed.
"""

from __future__ import annotations

import torch

from verl.models.factory import ModelPreset, build_model


def tiny_hf_model(architecture: str = "qwen2", tie_word_embeddings: bool = True, num_layers: int = 2, seed: int = 0):
    preset = ModelPreset(
        architecture=architecture,
        hidden_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    model, _ = build_model(preset, seed=seed, dtype="float32")
    return _perturbed(model, seed)


def tiny_moe_hf_model(num_layers: int = 2, seed: int = 0, norm_topk_prob: bool = True):
    """A Qwen3-MoE model (4 experts, top-2, per-head q/k norms) with every weight perturbed, the
    router's included, so routing is far from uniform. Experts run transformers' eager loop (the
    grouped_mm kernel has no float64 path on CPU)."""
    preset = ModelPreset(
        architecture="qwen3_moe",
        hidden_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model, _ = build_model(preset, seed=seed, dtype="float32")
    model.config.norm_topk_prob = norm_topk_prob
    for module in model.modules():
        if hasattr(module, "norm_topk_prob"):
            module.norm_topk_prob = norm_topk_prob
    model.set_experts_implementation("eager")
    return _perturbed(model, seed, router_scale=0.5)


def tiny_dsv3_hf_model(seed: int = 0, q_lora_rank: int | None = 96, rope_interleave: bool = True):
    """The `tiny-dsv3` preset (latent attention, a dense first layer, 8 experts in 4 groups, sigmoid
    routing, a shared expert), untied, every weight perturbed and the routers' correction bias
    random (large enough to change which experts are chosen)."""
    import dataclasses

    from verl.models.factory import get_preset

    preset = get_preset("tiny-dsv3")
    extra = dict(preset.architecture_config, q_lora_rank=q_lora_rank, rope_interleave=rope_interleave)
    preset = dataclasses.replace(
        preset, tie_word_embeddings=False, max_position_embeddings=64, architecture_config=tuple(extra.items())
    )
    model, _ = build_model(preset, seed=seed, dtype="float32")
    model.set_experts_implementation("eager")
    randomize_correction_bias(model, seed + 2)
    return _perturbed(model, seed, router_scale=0.5)


def tiny_glm4moe_hf_model(
    seed: int = 0,
    use_qk_norm: bool = False,
    attention_bias: bool = True,
    head_dim: int | None = None,
    num_layers: int | None = None,
):
    """The `tiny-glm4moe` preset (grouped-query attention with q/k/v bias and half rotary, a dense
    first layer, 8 experts with sigmoid routing, a shared expert), every weight perturbed and the
    routers' correction bias random (large enough to change which experts are chosen). `head_dim`
    other than hidden / heads (GLM-4.5's own: 128 with 96 heads of a 4096 model) resizes q/k/v/o;
    `num_layers` other than the preset's 3 adds MoE layers (4: two even pipeline stages)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from verl.models.factory import build_config, get_preset

    preset = get_preset("tiny-glm4moe")
    extra = dict(preset.architecture_config, use_qk_norm=use_qk_norm, attention_bias=attention_bias)
    preset = dataclasses.replace(
        preset,
        max_position_embeddings=64,
        architecture_config=tuple(extra.items()),
        num_hidden_layers=num_layers or preset.num_hidden_layers,
    )
    if head_dim is None:
        model, _ = build_model(preset, seed=seed, dtype="float32")
    else:
        config = build_config(preset)
        config.head_dim = head_dim
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.set_experts_implementation("eager")
    randomize_correction_bias(model, seed + 2)
    return _perturbed(model, seed, router_scale=0.5)


def tiny_gptoss_hf_model(seed: int = 0, **config):
    """The `tiny-gptoss` preset (attention sinks, a sliding-window then a full-attention layer, YaRN,
    biases everywhere, 4 experts top-2, the clamped SwiGLU) with every weight perturbed and, so that
    each feature shows in the log-probs: sinks N(0, 1) (HF initialises them at 0.02 std), the
    router at 0.5 std, and the experts' gate/up biases at 4 std so the clamp at `swiglu_limit`
    (7) cuts some pre-activations. `config` overrides HF config fields (before the model is built)."""
    import dataclasses

    from verl.models.factory import get_preset

    preset = get_preset("tiny-gptoss")
    preset = dataclasses.replace(preset, architecture_config=tuple(dict(preset.architecture_config, **config).items()))
    model, _ = build_model(preset, seed=seed, dtype="float32")
    model.set_experts_implementation("eager")
    model = _perturbed(model, seed, router_scale=0.5)
    generator = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("experts.gate_up_proj_bias"):
                param.copy_(4.0 * torch.randn(param.shape, generator=generator))
    return model


def randomize_correction_bias(model, seed: int) -> None:
    """Sigmoid routers' `e_score_correction_bias` (DeepSeek-V3, GLM-4.5) set to 0.1 x N(0, 1): large
    enough to change which experts are chosen, so a conversion that dropped it would show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def assert_correction_bias_changes_routing(hf_model) -> None:
    """The reference itself: the correction bias of the first MoE layer's router decides experts
    (else a conversion that dropped it could pass a log-prob test)."""
    router = hf_model.model.layers[1].mlp.gate
    hidden = torch.randn(64, router.weight.shape[1], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, _, chosen = router(hidden)
        router.e_score_correction_bias.zero_()
        _, _, unbiased = router(hidden)
    assert not torch.equal(chosen.sort(-1).values, unbiased.sort(-1).values)


def _perturbed(model, seed: int, router_scale: float = 0.02):
    """Every weight moved by seeded noise (0.02 std; a MoE router's `router_scale`), so no test
    passes on a symmetric initialisation."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = router_scale if name.endswith(("mlp.gate.weight", "mlp.router.weight")) else 0.02
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return model.eval()


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's state dict as HF saves it: without lm_head when the embeddings are tied."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def setup_megatron(
    tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 0, cp: int = 1, ep: int = 1, etp: int | None = None
) -> None:
    from verl.utils.megatron.parallel_state import initialize_model_parallel

    initialize_model_parallel(
        tp, pp, vpp, context_parallel_size=cp, seed=seed, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )


def build_loaded_chunks(
    hf_model,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    value_head: bool = False,
    cp: int = 1,
    sequence_parallel: bool = False,
    tf_overrides: dict | None = None,
    dtype: torch.dtype = torch.float32,
    ep: int = 1,
    etp: int | None = None,
):
    """This rank's megatron chunks holding `hf_model`'s weights (model-parallel groups set up here)."""
    from verl.models.mcore import build_model_chunks, hf_to_mcore_config, load_hf_state_dict

    setup_megatron(tp, pp, vpp, cp=cp, ep=ep, etp=etp)
    tf_config = hf_to_mcore_config(
        hf_model.config,
        {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "context_parallel_size": cp,
            "sequence_parallel": sequence_parallel,
            "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": etp,
            "override_transformer_config": tf_overrides,
        },
        dtype,
    )
    for key, value in (tf_overrides or {}).items():  # as megatron.override_transformer_config does
        setattr(tf_config, key, value)
    chunks = build_model_chunks(hf_model.config, tf_config, value_head=value_head)
    load_hf_state_dict(chunks, hf_state_dict(hf_model), hf_model.config, value_head=value_head)
    return chunks


def assert_metrics_close(got: dict, want: dict, keys=None, same_length: bool = False) -> None:
    """Per-key metric lists equal to 1e-5 (absolute and relative), as float64."""
    for key in want if keys is None else keys:
        if same_length:
            assert len(got[key]) == len(want[key]), key
        torch.testing.assert_close(
            torch.tensor(got[key], dtype=torch.float64),
            torch.tensor(want[key], dtype=torch.float64),
            atol=1e-5,
            rtol=1e-5,
            msg=key,
        )


def assert_hf_round_trip_exact(chunks, hf_model) -> None:
    """The chunks stream back every HF tensor of `hf_model` once, bit-equal (HF -> megatron -> HF)."""
    from verl.models.mcore import mcore_to_hf_named_tensors

    want = hf_state_dict(hf_model)
    got = {}
    for name, tensor in mcore_to_hf_named_tensors(chunks, hf_model.config):
        assert name not in got, f"{name} streamed twice"
        got[name] = tensor
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
