"""The vision-language preset (`tiny-vl`): transformers' own Qwen2.5-VL at tiny sizes, with its processor.

`make_tiny("tiny-vl", out_dir)` writes an ordinary Qwen2.5-VL directory: config.json
(`Qwen2_5_VLForConditionalGeneration`), model.safetensors, the character tokenizer with Qwen2-VL's
vision markers, generation_config.json and the processor files (preprocessor_config.json,
processor_config.json), which `verl.utils.hf_processor` / `AutoProcessor` load offline.

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
- transformers 5's Qwen2.5-VL processor also holds a video processor, which needs torchvision; no CPU
  torchvision build matching the pinned torch is installable here, so `hf_processor` loads the
  directory as `verl.utils.vision.ImageOnlyQwen2_5_VLProcessor` (see there).
"""

from __future__ import annotations

import os

# the image processor's patch geometry (Qwen2-VL's): 14-pixel patches, 2x2 merged, 2 frames per temporal patch
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# pixel bounds of a resized image: one to sixteen merged patches
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2
MAX_PIXELS = 16 * MIN_PIXELS


def vision_config(preset, text_hidden_size: int) -> dict:
    """The vision tower's config fields of `preset` (its `architecture_config` `vision_*` pairs)."""
    extra = dict(preset.architecture_config)
    return dict(
        depth=extra.get("vision_depth", 2),
        hidden_size=extra.get("vision_hidden_size", 64),
        intermediate_size=extra.get("vision_intermediate_size", 128),
        num_heads=extra.get("vision_num_heads", 2),
        out_hidden_size=text_hidden_size,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        window_size=extra.get("vision_window_size", 56),
        fullatt_block_indexes=list(extra.get("vision_fullatt_block_indexes", (1,))),
        in_channels=3,
    )


def build_vl_config(preset, decoder_fields: dict, tokenizer=None):
    """A `Qwen2_5_VLConfig` for `preset`: the text model from `decoder_fields` (the sizes and special ids
    the text presets' configs get, `verl.models.factory.decoder_fields`) with head_dim 64 and M-RoPE, the
    vision tower from `vision_config`, and the vision marker ids from `tokenizer` (or the character
    tokenizer's fixed ids)."""
    from transformers import Qwen2_5_VLConfig

    from verl.models import tokenizer as char_tokenizer

    if preset.architecture != "qwen2_5_vl":
        raise ValueError(f"architecture={preset.architecture!r} is not a vision-language architecture built here")
    head_dim = 64
    section = list(dict(preset.architecture_config).get("mrope_section", (8, 12, 12)))
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section={section} must sum to head_dim/2 = {head_dim // 2}")
    if tokenizer is None:
        base = char_tokenizer.base_vocab_size()
        marker_ids = {tok: base + i for i, tok in enumerate(char_tokenizer.VISION_TOKENS)}
    else:
        marker_ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in char_tokenizer.VISION_TOKENS}
    text = dict(
        decoder_fields,
        head_dim=head_dim,
        rope_parameters=dict(rope_type="default", mrope_section=section, rope_theta=preset.rope_theta),
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision_config(preset, preset.hidden_size),
        image_token_id=marker_ids[char_tokenizer.IMAGE_PAD_TOKEN],
        video_token_id=marker_ids[char_tokenizer.VIDEO_PAD_TOKEN],
        vision_start_token_id=marker_ids[char_tokenizer.VISION_START_TOKEN],
        vision_end_token_id=marker_ids[char_tokenizer.VISION_END_TOKEN],
        **{k: decoder_fields[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")},
    )


def build_image_processor():
    """Qwen2-VL's image processor (the PIL backend: no torchvision needed) at the preset's pixel bounds."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )


def save_processor(tokenizer, out_dir: str) -> None:
    """Write the preset's processor files (preprocessor_config.json, processor_config.json) into `out_dir`,
    next to the tokenizer files `save_tokenizer` wrote."""
    from verl.utils.vision import build_processor

    processor = build_processor(tokenizer, build_image_processor())
    processor.image_processor.save_pretrained(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    import json

    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f, indent=2)
        f.write("\n")
