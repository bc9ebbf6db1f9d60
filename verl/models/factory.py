"""Build small causal LMs from plain transformers configs, with the local character tokenizer.

Every preset is an ordinary Qwen2, Llama, Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss, Qwen2.5-VL or
Qwen3-VL model, saved as an ordinary HF directory
(config.json, model.safetensors, tokenizer files, generation_config.json) that
`AutoModelForCausalLM.from_pretrained` (`AutoModelForImageTextToText` for the vision-language ones) /
`AutoTokenizer.from_pretrained` load offline: no custom modelling code, no `trust_remote_code`.

Design decisions:
- head_dim is 64 in every preset (hidden_size = 64 * num_attention_heads) because vLLM's
  attention backends only accept a fixed set of head sizes, and 64 is the smallest common one.
- Presets span the sizes this project needs: `tiny` (~1M, learns 2-digit addition in a few hundred
  CPU steps, the bundled model's architecture), `small` (~5M), `base` (~24M, Llama architecture, so
  both model families are exercised) and `qwen2.5-0.5b-shape` (Qwen2.5-0.5B's dimensions, random
  weights, for GPU benchmarks only).
- The small presets' vocabulary is exactly the tokenizer's (263 tokens). The 0.5B-shaped preset
  keeps Qwen2.5's 151,936-row vocabulary, the tokenizer padded with reserved tokens to match, so the
  LM head and logits cost what they cost in the real model.
- Weights are initialised by transformers from a fixed seed, so a preset plus a seed is a
  reproducible checkpoint.
- `tiny-moe` is transformers' own Qwen3MoeForCausalLM (4 experts, top-2), so the mixture-of-experts
  paths (router load-balancing loss, FSDP sharding of expert weights, the model merger) run on
  CPU with the same classes a released Qwen3-MoE checkpoint loads into. vLLM and SGLang serve that
  architecture too.
- `tiny-dsv3` is transformers' own DeepseekV3ForCausalLM with every feature of the family at tiny
  sizes (multi-head latent attention, a dense first layer, grouped sigmoid routing with a
  correction bias, a shared expert), for the Megatron backend's DeepSeek-V3 path. Its extra HF
  config fields are `ModelPreset.architecture_config`; its head sizes are the family's own
  (`head_dim` is not passed).
- `tiny-gptoss` is transformers' own GptOssForCausalLM with every feature of gpt-oss-20b at tiny
  sizes (attention sinks, a sliding-window then a full-attention layer, YaRN, biases everywhere,
  biased routing, the clamped SwiGLU), for both backends' gpt-oss paths. Its window (4) is tiny so
  that short test sequences leave it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

HEAD_DIM = 64


@dataclass(frozen=True)
class ModelPreset:
    """Dimensions of one preset. All sizes are counts; head_dim is always 64."""

    architecture: str
    """A key of `ARCHITECTURES`: `qwen2` (Qwen2ForCausalLM), `llama` (LlamaForCausalLM), `qwen3_moe`
    (Qwen3MoeForCausalLM), `deepseek_v3`, `glm4_moe`, `gpt_oss`, or the vision-language `qwen2_5_vl`
    (Qwen2_5_VLForConditionalGeneration) and `qwen3_vl` (Qwen3VLForConditionalGeneration)."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int | None = None
    """Embedding rows; None means exactly the character tokenizer's size."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    num_experts: int = 0
    """Routed experts per layer; > 0 only for the mixture-of-experts architectures (`qwen3_moe`, `deepseek_v3`,
    `glm4_moe`)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Hidden size of one expert's MLP."""
    architecture_config: tuple[tuple[str, object], ...] = ()
    """Further transformers config fields of the architecture, as (key, value) pairs (DeepSeek-V3's
    latent-attention ranks, routing groups and dense first layers)."""
    description: str = ""

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is not one of {sorted(ARCHITECTURES)}")
        if self.hidden_size != HEAD_DIM * self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} with {self.num_attention_heads} heads gives head_dim "
                f"{self.hidden_size / self.num_attention_heads:g}; vLLM needs head_dim {HEAD_DIM}, so set "
                f"hidden_size = {HEAD_DIM} * num_attention_heads"
            )
        moe = self.architecture in MOE_ARCHITECTURES
        if moe != (self.num_experts > 0) or (moe and not 0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"architecture={self.architecture!r} with num_experts={self.num_experts}, num_experts_per_tok="
                f"{self.num_experts_per_tok}: experts belong to {sorted(MOE_ARCHITECTURES)} (which need "
                "0 < num_experts_per_tok <= num_experts), and only there"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )


# architecture name -> transformers config class name
ARCHITECTURES = {
    "qwen2": "Qwen2Config",
    "llama": "LlamaConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
    "glm4_moe": "Glm4MoeConfig",
    "gpt_oss": "GptOssConfig",
    "qwen2_5_vl": "Qwen2_5_VLConfig",  # vision-language, built by verl.models.vision
    "qwen3_vl": "Qwen3VLConfig",  # vision-language, built by verl.models.vision
    "qwen3_vl_moe": "Qwen3VLMoeConfig",  # vision-language with routed experts, built by verl.models.vision
}
# those whose MLPs are routed experts (see verl.models.moe)
MOE_ARCHITECTURES = {"qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_vl_moe"}
# vision-language architectures (a vision tower, a processor, M-RoPE positions; see verl.models.vision)
VISION_ARCHITECTURES = {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}
# those whose config names the routed experts n_routed_experts
_N_ROUTED = {"deepseek_v3", "glm4_moe"}
# those whose config names the routed experts num_local_experts and each expert's size intermediate_size
_LOCAL_EXPERTS = {"gpt_oss"}

PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        architecture="qwen2",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=512,
        description="~1M parameters; learns 2-digit addition on CPU in minutes (the bundled arith-tiny)",
    ),
    "small": ModelPreset(
        architecture="qwen2",
        hidden_size=256,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=1024,
        description="~5M parameters",
    ),
    "base": ModelPreset(
        architecture="llama",
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        description="~24M parameters, Llama architecture with grouped-query attention",
    ),
    "tiny-moe": ModelPreset(
        architecture="qwen3_moe",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        description="~0.4M parameters, Qwen3-MoE shape (4 experts, top-2 routing), for the MoE code paths",
    ),
    "tiny-dsv3": ModelPreset(
        architecture="deepseek_v3",
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        architecture_config=(
            ("first_k_dense_replace", 1),  # layer 0 dense, layers 1-2 MoE
            ("n_shared_experts", 1),
            ("n_group", 4),  # 4 groups of 2 experts, 2 groups chosen per token
            ("topk_group", 2),
            ("routed_scaling_factor", 2.5),
            ("norm_topk_prob", True),
            ("q_lora_rank", 96),  # multi-head latent attention; query/key head 48 + 16 = 64
            ("kv_lora_rank", 64),
            ("qk_nope_head_dim", 48),
            ("qk_rope_head_dim", 16),
            ("v_head_dim", 64),
            ("num_nextn_predict_layers", 0),
        ),
        description="~0.6M parameters, DeepSeek-V3 shape (latent attention, a dense first layer, 8 routed "
        "experts in 4 groups with sigmoid routing, top-4, one shared expert), for the MoE code paths",
    ),
    "tiny-glm4moe": ModelPreset(
        architecture="glm4_moe",
        hidden_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        tie_word_embeddings=False,
        architecture_config=(
            ("first_k_dense_replace", 1),  # layer 0 dense, layers 1-2 MoE
            ("n_shared_experts", 1),
            ("n_group", 1),  # GLM-4.5's routing: no group limit
            ("topk_group", 1),
            ("routed_scaling_factor", 2.5),
            ("norm_topk_prob", True),
            ("attention_bias", True),  # q/k/v bias, as GLM-4.5's checkpoints
            ("use_qk_norm", False),  # GLM-4.5-Air's; GLM-4.5 has per-head q/k norms
            ("partial_rotary_factor", 0.5),  # RoPE on the first 32 of 64 head dimensions
            ("num_nextn_predict_layers", 0),
        ),
        description="~1.3M parameters, GLM-4.5-Air shape (grouped-query attention with q/k/v bias and half "
        "rotary, a dense first layer, 8 routed experts with sigmoid routing, top-2, one shared expert), for the "
        "MoE code paths",
    ),
    "tiny-gptoss": ModelPreset(
        architecture="gpt_oss",
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,  # gpt-oss names each expert's MLP size intermediate_size
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        rope_theta=150000.0,
        rms_norm_eps=1e-5,
        architecture_config=(
            ("layer_types", ("sliding_attention", "full_attention")),  # gpt-oss-20b's alternation
            ("sliding_window", 4),  # 128 in gpt-oss-20b; 4 so that short test sequences leave the window
            ("attention_bias", True),  # q/k/v and o_proj biases
            ("swiglu_limit", 7.0),
            (
                "rope_parameters",
                (
                    ("rope_type", "yarn"),
                    ("rope_theta", 150000.0),
                    ("factor", 32.0),
                    ("beta_fast", 32.0),
                    ("beta_slow", 1.0),
                    ("truncate", False),
                    ("original_max_position_embeddings", 4096),
                ),
            ),
        ),
        description="~0.9M parameters, gpt-oss-20b shape (attention sinks, alternating sliding-window and full "
        "attention, YaRN RoPE, q/k/v/o biases, 4 experts with biased router and expert biases, top-2, the clamped "
        "SwiGLU), for the MoE code paths",
    ),
    "tiny-vl": ModelPreset(
        architecture="qwen2_5_vl",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        architecture_config=(
            ("mrope_section", (8, 12, 12)),  # (time, height, width) rotary frequencies; sums to head_dim/2
            ("vision_depth", 2),
            ("vision_hidden_size", 64),
            ("vision_intermediate_size", 128),
            ("vision_num_heads", 2),
            ("vision_window_size", 56),  # windowed attention in block 0, full attention in block 1
            ("vision_fullatt_block_indexes", (1,)),
        ),
        description="~0.6M parameters, Qwen2.5-VL shape (a 2-block windowed vision tower with the 2x2 patch "
        "merger, M-RoPE decoder) with its image processor, for the multi-modal code paths",
    ),
    "tiny-qwen3-vl": ModelPreset(
        architecture="qwen3_vl",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        architecture_config=(
            ("mrope_section", (12, 10, 10)),  # Qwen3-VL's 24/20/20 halved; interleaved inside the model
            ("vision_depth", 2),
            ("vision_hidden_size", 64),
            ("vision_intermediate_size", 128),
            ("vision_num_heads", 2),
            ("vision_num_position_embeddings", 64),  # an 8x8 grid of learned positions, interpolated per image
            ("vision_deepstack_visual_indexes", (0, 1)),  # both blocks feed DeepStack, into decoder layers 0-1
        ),
        description="~0.6M parameters, Qwen3-VL shape (16-pixel patches, learned vision positions, DeepStack "
        "features from both vision blocks into both decoder layers, interleaved M-RoPE, q/k norms) with its image "
        "processor, for the multi-modal code paths",
    ),
    "tiny-qwen3-vl-moe": ModelPreset(
        architecture="qwen3_vl_moe",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        architecture_config=(
            ("mrope_section", (12, 10, 10)),
            ("vision_depth", 2),
            ("vision_hidden_size", 64),
            ("vision_intermediate_size", 128),
            ("vision_num_heads", 2),
            ("vision_num_position_embeddings", 64),
            ("vision_deepstack_visual_indexes", (0, 1)),
        ),
        description="~0.6M parameters, Qwen3-VL-MoE shape (tiny-qwen3-vl with 4 routed experts, top-2, in every "
        "decoder layer), for the multi-modal mixture-of-experts code paths",
    ),
    "qwen2.5-0.5b-shape": ModelPreset(
        architecture="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        description="Qwen2.5-0.5B dimensions (~494M), random weights, for GPU benchmarks",
    ),
}


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def build_tokenizer(preset: ModelPreset | str = "tiny"):
    """The character tokenizer sized for `preset` (padded with reserved tokens when the preset's
    vocabulary is larger)."""
    from verl.models.tokenizer import build_char_tokenizer

    preset = get_preset(preset) if isinstance(preset, str) else preset
    return build_char_tokenizer(
        reserved_to=preset.vocab_size,
        model_max_length=preset.max_position_embeddings,
        vision=preset.architecture in VISION_ARCHITECTURES,
    )


def build_config(preset: ModelPreset | str, tokenizer=None):
    """A transformers config for `preset`. Special-token ids come from `tokenizer`, or are the
    character tokenizer's fixed ids when it is None (no need to build a 150k-entry tokenizer just to
    size a model)."""
    import transformers

    from verl.models import tokenizer as char_tokenizer

    preset = get_preset(preset) if isinstance(preset, str) else preset
    vision = preset.architecture in VISION_ARCHITECTURES
    if tokenizer is None:
        ids = dict(zip(("pad", "bos", "eos"), (0, 2, 3)))
        assert [char_tokenizer.SPECIAL_TOKENS[i] for i in ids.values()] == ["<pad>", "<bos>", "<eos>"]
        num_tokens = preset.vocab_size or (
            char_tokenizer.base_vocab_size() + vision * len(char_tokenizer.VISION_TOKENS)
        )
    else:
        ids = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
        num_tokens = len(tokenizer)
    vocab_size = preset.vocab_size or num_tokens
    if vocab_size < num_tokens:
        raise ValueError(f"preset vocab_size={vocab_size} is smaller than the tokenizer's {num_tokens} tokens")
    fields = decoder_fields(preset, vocab_size, ids)
    if vision:
        from verl.models.vision import build_vl_config

        return build_vl_config(preset, fields, tokenizer)
    config_cls = getattr(transformers, ARCHITECTURES[preset.architecture])
    moe = {}
    if preset.architecture in _N_ROUTED:  # their configs name the experts n_routed_experts
        moe = dict(
            n_routed_experts=preset.num_experts,
            num_experts_per_tok=preset.num_experts_per_tok,
            moe_intermediate_size=preset.moe_intermediate_size,
        )
    elif preset.architecture in MOE_ARCHITECTURES:
        moe = dict(
            num_experts=preset.num_experts,
            num_experts_per_tok=preset.num_experts_per_tok,
            moe_intermediate_size=preset.moe_intermediate_size,
            norm_topk_prob=True,  # Qwen3-MoE's released checkpoints renormalise the top-k weights
        )
    elif preset.architecture in _LOCAL_EXPERTS:
        moe = dict(num_local_experts=preset.num_experts, num_experts_per_tok=preset.num_experts_per_tok)
    moe.update(_config_values(preset.architecture_config))
    if preset.architecture != "deepseek_v3":
        moe["head_dim"] = HEAD_DIM
    return config_cls(**moe, **fields, rope_theta=preset.rope_theta)


def decoder_fields(preset: ModelPreset, vocab_size: int, ids: dict) -> dict:
    """The config fields every preset's decoder gets: its sizes, tied embeddings and special-token ids."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        intermediate_size=preset.intermediate_size,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings,
        rms_norm_eps=preset.rms_norm_eps,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )


def _config_values(pairs) -> dict:
    """`ModelPreset.architecture_config` as config kwargs: a nested tuple of pairs becomes a dict, any
    other tuple a list (the preset stays hashable, the config gets JSON-like values)."""

    def value(v):
        if isinstance(v, tuple) and v and all(isinstance(p, tuple) and len(p) == 2 for p in v):
            return {k: value(x) for k, x in v}
        return list(v) if isinstance(v, tuple) else v

    return {k: value(v) for k, v in pairs}


def count_parameters(preset: ModelPreset | str) -> int:
    """Parameter count of `preset` (tied embeddings counted once), computed on the meta device."""
    import torch

    config = build_config(preset)
    with torch.device("meta"):
        model = _auto_model_class(config).from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_model(preset: ModelPreset | str = "tiny", seed: int = 0, dtype: str = "float32"):
    """A freshly initialised `(model, tokenizer)` pair for `preset`, seeded for reproducibility."""
    import torch

    preset = get_preset(preset) if isinstance(preset, str) else preset
    tokenizer = build_tokenizer(preset)
    config = build_config(preset, tokenizer)
    torch.manual_seed(seed)
    model = _auto_model_class(config).from_config(config, dtype=_torch_dtype(dtype))
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _auto_model_class(config):
    """transformers' Auto class for `config`: image-text-to-text for the vision-language architectures
    (AutoModelForCausalLM does not map them), causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if config.model_type in VISION_ARCHITECTURES else AutoModelForCausalLM


def save_model(model, tokenizer, out_dir: str) -> str:
    """Write `model` and `tokenizer` as one HF directory (safetensors weights, portable tokenizer
    files, generation_config.json; a vision-language model's processor files too)."""
    from verl.models.tokenizer import save_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    add_legacy_config_keys(os.path.join(out_dir, "config.json"))
    save_tokenizer(tokenizer, out_dir)
    if model.config.model_type in VISION_ARCHITECTURES:
        from verl.models.vision import save_processor

        save_processor(tokenizer, out_dir, model.config.model_type)
    return out_dir


def add_legacy_rope_theta(config_path: str) -> None:
    """transformers 5 writes the RoPE base only inside `rope_parameters`; transformers 4.x (and the
    engines pinned to it) read a top-level `rope_theta` and would silently fall back to 10000, so a
    rollout engine and the trainer would disagree on positions. Write both; version 5 reads either.
    The same for GLM-4.5's `partial_rotary_factor` (4.x reads it top-level, defaulting to 0.5) and for
    a rope scaling (gpt-oss's YaRN), which 4.x reads from `rope_scaling`."""
    with open(config_path) as f:
        config = json.load(f)
    changed = False
    for key in ("rope_theta", "partial_rotary_factor"):
        value = (config.get("rope_parameters") or {}).get(key)
        if value is not None and config.get(key) is None:
            config[key] = value
            changed = True
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
        # gpt-oss's YaRN: 4.x reads the scaling from `rope_scaling` (released gpt-oss configs carry it)
        config["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        changed = True
    if changed:
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")


# keys transformers 5 writes under a new name that transformers 4.x (and the engines pinned to it)
# read under the old one, falling back to a default when it is missing: (model_type, new, old)
_RENAMED_KEYS = (
    ("qwen3_moe", "num_local_experts", "num_experts"),
    ("qwen3_vl_moe", "num_local_experts", "num_experts"),
)


def add_legacy_config_keys(config_path: str) -> None:
    """`add_legacy_rope_theta`, and Qwen3-MoE's expert count under its transformers 4.x name too
    (Qwen3-VL-MoE's in its `text_config`): transformers 5 writes only `num_local_experts`, and a 4.x
    reader would build its default 128 (60) experts and fail to load the checkpoint."""
    add_legacy_rope_theta(config_path)
    with open(config_path) as f:
        config = json.load(f)
    changed = False
    for model_type, new, old in _RENAMED_KEYS:
        # a vision-language model's decoder keys are in its text_config
        section = config.get("text_config") if model_type.endswith("_vl_moe") else config
        if (
            config.get("model_type") == model_type
            and isinstance(section, dict)
            and new in section
            and old not in section
        ):
            section[old] = section[new]
            changed = True
    if changed:
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")


def make_tiny(preset: str, out_dir: str, seed: int = 0, dtype: str = "float32") -> str:
    """Build a randomly initialised `preset` model with its tokenizer and save it to `out_dir`."""
    model, tokenizer = build_model(preset, seed=seed, dtype=dtype)
    return save_model(model, tokenizer, out_dir)


def preset_table() -> str:
    """One line per preset: name, architecture, dimensions and description."""
    lines = []
    for name, p in PRESETS.items():
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "description"}
        dims = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        lines.append(f"{name}: {dims} -- {p.description}")
    return "\n".join(lines)


def _torch_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype={name!r} is not one of {sorted(table)}")
    return table[name]
