"""Vision-language helpers shared by the dataset, the actors and the rollout engines.

- `ImageOnlyQwen2_5_VLProcessor`, `ImageOnlyQwen3VLProcessor`: transformers 5's Qwen2.5-VL and Qwen3-VL
  processors also hold a video processor, which needs torchvision, and no CPU torchvision build matching
  the pinned torch is installable here. These are the same processors without it (text, chat template
  and images go through transformers' own code; videos raise). `verl.utils.hf_processor` falls back to
  them when the full processor cannot be built for want of torchvision.
- Positions: Qwen2-VL, Qwen2.5-VL and Qwen3-VL place an image's tokens identically (`mrope_position_ids`;
  `mrope_positions` also places videos, for upstream's `verl.models.transformers.qwen2_vl.get_rope_index`);
  they differ only in how the model lays the three rows out over the rotary frequencies (Qwen3-VL
  interleaves them), which happens inside the model.
- `input_only_token_ids` / `mask_input_only_logits`: the vision markers a response never contains, kept out
  of the policy's distribution (the PPO actor's and the engines' batch API's log-probs alike).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# transformers' processor class -> the name of its image-only variant here
IMAGE_ONLY_PROCESSORS = {
    "Qwen2_5_VLProcessor": "ImageOnlyQwen2_5_VLProcessor",
    "Qwen3VLProcessor": "ImageOnlyQwen3VLProcessor",
}

_IMAGE_ONLY_CLASSES: dict[str, type] = {}


def _image_only_processor_class(base_name: str = "Qwen2_5_VLProcessor"):
    """transformers' `base_name` processor without its video processor (built once per name)."""
    if base_name not in IMAGE_ONLY_PROCESSORS:
        raise ValueError(
            f"no image-only variant of the processor {base_name!r}; the vision-language processors built here are "
            f"{sorted(IMAGE_ONLY_PROCESSORS)}"
        )
    if base_name in _IMAGE_ONLY_CLASSES:
        return _IMAGE_ONLY_CLASSES[base_name]
    import transformers
    from transformers.processing_utils import ProcessorMixin

    base = getattr(transformers, base_name)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        # Qwen3-VL's processor also names the markers around each image
        self.vision_start_token = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        self.vision_end_token = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError(
                "video inputs need transformers' Qwen2-VL video processor, which needs torchvision (not "
                "installed); install a torchvision build matching torch, or use image inputs only"
            )
        return base.__call__(self, images=images, text=text, **kwargs)

    name = IMAGE_ONLY_PROCESSORS[base_name]
    cls = type(
        name,
        (base,),
        {
            "__init__": __init__,
            "__call__": __call__,
            "__module__": __name__,
            "__doc__": f"transformers' {base_name} without its video processor (which needs torchvision).\n\n"
            "Text, chat templates and images go through transformers' own code; asking it for videos raises.",
        },
    )
    globals()[name] = cls  # importable by name (pickling across Ray workers)
    _IMAGE_ONLY_CLASSES[base_name] = cls
    return cls


def build_processor(tokenizer, image_processor, processor_class: str = "Qwen2_5_VLProcessor"):
    """The image-only `processor_class` (Qwen2.5-VL's or Qwen3-VL's) over `tokenizer` and `image_processor`."""
    cls = _image_only_processor_class(processor_class)
    return cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def load_image_only_processor(path: str, processor_class: str = "Qwen2_5_VLProcessor", **kwargs):
    """A Qwen2-VL family directory's processor without the video processor: its image processor and
    tokenizer loaded by transformers' Auto classes, put together as the image-only `processor_class`."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    image_processor = AutoImageProcessor.from_pretrained(path, **kwargs)
    return build_processor(tokenizer, image_processor, processor_class)


def __getattr__(name: str):
    # `ImageOnlyQwen2_5_VLProcessor` / `ImageOnlyQwen3VLProcessor` by name (built on first use: they
    # import transformers' model code)
    for base, image_only in IMAGE_ONLY_PROCESSORS.items():
        if name == image_only:
            return _image_only_processor_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_vision_language_config(config) -> bool:
    """Whether an HF config is a vision-language model's (it has a vision tower and an image token)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


# config fields naming a vision-language model's input-only marker tokens
_MARKER_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def input_only_token_ids(config) -> list[int]:
    """The vision marker ids of a vision-language config (`<|image_pad|>`, `<|video_pad|>`,
    `<|vision_start|>`, `<|vision_end|>`); [] for a text model.

    They mark where the processor put images in a prompt; a response never contains them. A rollout
    that sampled one would break every later forward of the row (transformers matches the image tokens
    of a sequence against its image features and raises, as upstream's volcengine/verl#3469 reports), so
    the rollout engines never sample them (their logits are -inf): a released Qwen2.5-VL gives them a
    negligible probability, a randomly initialised one ~1.5% per token.
    """
    if not is_vision_language_config(config):
        return []
    return sorted({int(v) for v in (getattr(config, f, None) for f in _MARKER_FIELDS) if v is not None})


def mask_input_only_logits(logits: torch.Tensor, token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """`logits` [..., V] with the columns `token_ids` (`input_only_token_ids`) at a value that stays the
    dtype's lowest after a division by `temperature`: a probability of exactly 0, and finite, so
    p * logit stays 0 in the entropy. The policy of a vision-language model is then over the tokens
    its rollout can emit. Unchanged (the same tensor) for no ids."""
    import torch

    if not token_ids:
        return logits
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    return logits.index_fill(-1, ids, torch.finfo(logits.dtype).min * min(1.0, float(temperature)))


def mrope_position_ids(config, input_ids, attention_mask, image_grid_thw=None):
    """Qwen2-VL's multimodal rotary positions (M-RoPE), shape (3, batch, length): (time, height, width).

    Over each row's attended tokens: a text token takes the next position in all three rows; the
    `<|image_pad|>` tokens of one image (a run of `t * h * w / merge**2` of them, in the order of
    `image_grid_thw`'s rows over the batch) take `start + (t_idx, h_idx, w_idx)` over its merged patch
    grid, and the text after it starts at `start + max(t, h/merge, w/merge)`. Padding positions are 0.
    This is transformers' `get_rope_index` for images (checked against it in the tests), computed from
    the config alone, so the dataset and the rollout need no model. Video tokens are refused.
    """
    return mrope_positions(
        input_ids,
        attention_mask,
        image_token_id=config.image_token_id,
        video_token_id=getattr(config, "video_token_id", None),
        spatial_merge_size=config.vision_config.spatial_merge_size,
        image_grid_thw=image_grid_thw,
    )


def _grid_rows(grid_thw) -> list[list[int]]:
    import torch

    return [] if grid_thw is None else torch.as_tensor(grid_thw).reshape(-1, 3).tolist()


def mrope_positions(
    input_ids,
    attention_mask,
    *,
    image_token_id: int,
    video_token_id: int | None,
    spatial_merge_size: int,
    image_grid_thw=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
    tokens_per_second: float = 2,
):
    """`mrope_position_ids` from the token ids and merge size themselves, videos included (upstream
    verl's `get_rope_index` rule, from transformers 4.52's Qwen2.5-VL): a video's `<|video_pad|>` run
    takes the next `video_grid_thw` row and its temporal index `k` becomes
    `int(k * second_per_grid_ts[v] * tokens_per_second)` (seconds per grid 1.0 when not given); the text
    after any image or video starts one past the largest position it took. Video tokens without
    `video_grid_thw` are refused, as are image or video runs that do not match their grids.
    """
    import torch

    merge = spatial_merge_size
    input_ids = torch.as_tensor(input_ids)
    attention_mask = torch.as_tensor(attention_mask).bool()
    if (
        video_token_id is not None
        and video_grid_thw is None
        and bool(((input_ids == video_token_id) & attention_mask).any())
    ):
        raise ValueError("video tokens in a prompt: videos are not supported here (images only)")
    images = iter(_grid_rows(image_grid_thw))
    video_grids = _grid_rows(video_grid_thw)
    seconds = (
        [1.0] * len(video_grids)
        if second_per_grid_ts is None
        else list(torch.as_tensor(second_per_grid_ts).reshape(-1).cpu())
    )
    if len(seconds) != len(video_grids):
        raise ValueError(
            f"second_per_grid_ts has {len(seconds)} values for {len(video_grids)} videos (video_grid_thw rows)"
        )
    videos = iter(zip(video_grids, seconds, strict=True))
    positions = torch.zeros((3, *input_ids.shape), dtype=torch.long)
    for row in range(input_ids.shape[0]):
        ids = input_ids[row][attention_mask[row]].tolist()
        out = torch.empty((3, len(ids)), dtype=torch.long)
        pos, i = 0, 0
        while i < len(ids):
            token = ids[i]
            if token == image_token_id:
                kind, grid, second = "image", next(images, None), None
            elif video_token_id is not None and token == video_token_id:
                kind, (grid, second) = "video", next(videos, (None, None))
            else:
                out[:, i] = pos
                pos, i = pos + 1, i + 1
                continue
            if grid is None:
                raise ValueError(f"row {row} has more {kind}s than {kind}_grid_thw has rows")
            t, h, w = grid[0], grid[1] // merge, grid[2] // merge
            n = t * h * w
            if ids[i : i + n] != [token] * n:
                raise ValueError(
                    f"row {row}: an {kind} of grid {grid} needs {n} consecutive {kind} tokens at position {i}; "
                    f"the prompt's {kind} tokens do not match {kind}_grid_thw "
                    "(was it processed by the model's processor?)"
                )
            steps = torch.arange(t)
            if second is not None:  # upstream's order of the products (float32), so the truncation agrees
                steps = (steps * second * tokens_per_second).long()
            grid_t = steps.view(t, 1, 1).expand(t, h, w).reshape(-1)
            grid_h = torch.arange(h).view(1, h, 1).expand(t, h, w).reshape(-1)
            grid_w = torch.arange(w).view(1, 1, w).expand(t, h, w).reshape(-1)
            out[:, i : i + n] = torch.stack([grid_t, grid_h, grid_w]) + pos
            pos, i = pos + max(int(steps[-1]), h - 1, w - 1) + 1, i + n
        positions[:, row, attention_mask[row]] = out
    if next(images, None) is not None:
        raise ValueError("image_grid_thw has more rows than the prompts have images")
    if next(videos, None) is not None:
        raise ValueError("video_grid_thw has more rows than the prompts have videos")
    return positions


def vl_position_ids(config, input_ids, attention_mask, image_grid_thw=None):
    """Position ids of a vision-language batch, shape (batch, 4, length), upstream verl's layout: row 0
    the text positions (as a text model's: attended tokens counted from 0, left padding 0), rows 1-3
    `mrope_position_ids`'s (time, height, width)."""
    import torch

    attention_mask = torch.as_tensor(attention_mask)
    text = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    mrope = mrope_position_ids(config, input_ids, attention_mask, image_grid_thw)
    return torch.cat([text.unsqueeze(0), mrope], dim=0).transpose(0, 1).contiguous()
