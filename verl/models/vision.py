"""The vision-language presets: transformers' own Qwen2.5-VL (`tiny-vl`) and Qwen3-VL (`tiny-qwen3-vl`) at
tiny sizes, with their processors.

`make_tiny("tiny-vl", out_dir)` writes an ordinary Qwen2.5-VL directory: config.json
(`Qwen2_5_VLForConditionalGeneration`), model.safetensors, the character tokenizer with Qwen2-VL's
vision markers, generation_config.json and the processor files (preprocessor_config.json,
processor_config.json), which `verl.utils.hf_processor` / `AutoProcessor` load offline.
`make_tiny("tiny-qwen3-vl", out_dir)` writes the same for `Qwen3VLForConditionalGeneration`.

Design decisions:
- The model is the real architecture at tiny sizes (a 2-block windowed vision tower with its 2x2 patch
  merger, the M-RoPE language model), so every multi-modal path (the processor's image patches, the
  3-D rotary positions, the vision tower's gradients, the rollout's prefill with images) runs with the
  classes a released Qwen2.5-VL checkpoint loads into.
- The decoder keeps the text presets' head_dim 64 (vLLM's attention backends); M-RoPE splits its 32
  rotary frequencies 8/12/12 over (time, height, width), Qwen2.5-VL's 16/24/24 halved.
- Images are small: the image processor's `min_pixels`/`max_pixels` keep every image between one and
  sixteen merged 28x28 patches (4 to 64 vision patches), so a batch of image prompts stays cheap on CPU.
- The vision markers are appended after the byte symbols, so the text ids are the text tokenizer's.
- Qwen3-VL differs where the family does: 16-pixel patches (32x32 merged) normalised to [-1, 1], a vision
  tower with learned position embeddings (`num_position_embeddings`, interpolated to each image's grid)
  and DeepStack (the outputs of vision blocks 0 and 1, each through its own merger, are added to the
  image tokens' hidden states after decoder layers 0 and 1), a Qwen3 decoder (q/k norms) whose M-RoPE
  interleaves the (time, height, width) frequencies (12/10/10 of 32, Qwen3-VL's 24/20/20 halved).
- transformers 5's Qwen2.5-VL and Qwen3-VL processors also hold a video processor, which needs
  torchvision; no CPU torchvision build matching the pinned torch is installable here, so
  `hf_processor` loads the directory as `verl.utils.vision.ImageOnlyQwen2_5_VLProcessor` /
  `ImageOnlyQwen3VLProcessor` (see there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class VisionFamily:
    """What a vision-language architecture's preset needs beyond the text model's fields."""

    config_class: str
    """transformers' config class."""
    processor_class: str
    """transformers' processor class, written to processor_config.json."""
    patch_size: int
    """Pixels per side of one vision patch (2x2 patches merge into one image token)."""
    image_mean: tuple[float, float, float] | None = None
    """The image processor's normalisation (None: Qwen2-VL's image processor default, CLIP's)."""
    image_std: tuple[float, float, float] | None = None


FAMILIES = {
    "qwen2_5_vl": VisionFamily("Qwen2_5_VLConfig", "Qwen2_5_VLProcessor", patch_size=14),
    "qwen3_vl": VisionFamily(
        "Qwen3VLConfig", "Qwen3VLProcessor", patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)
    ),
    "qwen3_vl_moe": VisionFamily(
        "Qwen3VLMoeConfig", "Qwen3VLProcessor", patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)
    ),
}
# the Qwen3-VL tower (learned positions, DeepStack) and decoder (interleaved M-RoPE)
QWEN3_VL_ARCHITECTURES = ("qwen3_vl", "qwen3_vl_moe")

# the image processor's patch geometry (Qwen2-VL's): 14-pixel patches, 2x2 merged, 2 frames per temporal patch
PATCH_SIZE = FAMILIES["qwen2_5_vl"].patch_size
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# pixel bounds of a resized image: one to sixteen merged patches
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2
MAX_PIXELS = 16 * MIN_PIXELS


def _family(architecture: str) -> VisionFamily:
    if architecture not in FAMILIES:
        raise ValueError(
            f"architecture={architecture!r} is not a vision-language architecture built here; choose one of "
            f"{sorted(FAMILIES)}"
        )
    return FAMILIES[architecture]


def vision_config(preset, text_hidden_size: int) -> dict:
    """The vision tower's config fields of `preset` (its `architecture_config` `vision_*` pairs)."""
    extra = dict(preset.architecture_config)
    common = dict(
        depth=extra.get("vision_depth", 2),
        hidden_size=extra.get("vision_hidden_size", 64),
        intermediate_size=extra.get("vision_intermediate_size", 128),
        num_heads=extra.get("vision_num_heads", 2),
        out_hidden_size=text_hidden_size,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        in_channels=3,
    )
    if preset.architecture in QWEN3_VL_ARCHITECTURES:
        return dict(
            common,
            patch_size=FAMILIES[preset.architecture].patch_size,
            num_position_embeddings=extra.get("vision_num_position_embeddings", 64),
            deepstack_visual_indexes=list(extra.get("vision_deepstack_visual_indexes", (0, 1))),
        )
    return dict(
        common,
        patch_size=PATCH_SIZE,
        window_size=extra.get("vision_window_size", 56),
        fullatt_block_indexes=list(extra.get("vision_fullatt_block_indexes", (1,))),
    )


def build_vl_config(preset, decoder_fields: dict, tokenizer=None):
    """A `Qwen2_5_VLConfig` / `Qwen3VLConfig` for `preset`: the text model from `decoder_fields` (the sizes
    and special ids the text presets' configs get, `verl.models.factory.decoder_fields`) with head_dim 64
    and M-RoPE (interleaved for Qwen3-VL), the vision tower from `vision_config`, and the vision marker
    ids from `tokenizer` (or the character tokenizer's fixed ids)."""
    import transformers

    from verl.models import tokenizer as char_tokenizer

    family = _family(preset.architecture)
    head_dim = 64
    section = list(dict(preset.architecture_config).get("mrope_section", (8, 12, 12)))
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section={section} must sum to head_dim/2 = {head_dim // 2}")
    if tokenizer is None:
        base = char_tokenizer.base_vocab_size()
        marker_ids = {tok: base + i for i, tok in enumerate(char_tokenizer.VISION_TOKENS)}
    else:
        marker_ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in char_tokenizer.VISION_TOKENS}
    rope = dict(rope_type="default", mrope_section=section, rope_theta=preset.rope_theta)
    if preset.architecture in QWEN3_VL_ARCHITECTURES:
        rope["mrope_interleaved"] = True
    text = dict(decoder_fields, head_dim=head_dim, rope_parameters=rope)
    if preset.num_experts:  # Qwen3-VL-MoE: every decoder layer's MLP is routed experts, as Qwen3-MoE's
        text.update(
            num_experts=preset.num_experts,
            num_experts_per_tok=preset.num_experts_per_tok,
            moe_intermediate_size=preset.moe_intermediate_size,
        )
    return getattr(transformers, family.config_class)(
        text_config=text,
        vision_config=vision_config(preset, preset.hidden_size),
        image_token_id=marker_ids[char_tokenizer.IMAGE_PAD_TOKEN],
        video_token_id=marker_ids[char_tokenizer.VIDEO_PAD_TOKEN],
        vision_start_token_id=marker_ids[char_tokenizer.VISION_START_TOKEN],
        vision_end_token_id=marker_ids[char_tokenizer.VISION_END_TOKEN],
        **{k: decoder_fields[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")},
    )


def build_image_processor(architecture: str = "qwen2_5_vl"):
    """Qwen2-VL's image processor (the PIL backend: no torchvision needed; Qwen3-VL uses the same class
    with 16-pixel patches and its own normalisation), keeping every image between one and sixteen merged
    patches."""
    from transformers import Qwen2VLImageProcessorPil

    family = _family(architecture)
    merged = (family.patch_size * MERGE_SIZE) ** 2
    normalise = {} if family.image_mean is None else dict(image_mean=family.image_mean, image_std=family.image_std)
    return Qwen2VLImageProcessorPil(
        min_pixels=merged,
        max_pixels=16 * merged,
        patch_size=family.patch_size,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        **normalise,
    )


def save_processor(tokenizer, out_dir: str, architecture: str = "qwen2_5_vl") -> None:
    """Write the preset's processor files (preprocessor_config.json, processor_config.json) into `out_dir`,
    next to the tokenizer files `save_tokenizer` wrote."""
    import json

    from verl.utils.vision import build_processor

    family = _family(architecture)
    processor = build_processor(tokenizer, build_image_processor(architecture), family.processor_class)
    processor.image_processor.save_pretrained(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": family.processor_class}, f, indent=2)
        f.write("\n")
