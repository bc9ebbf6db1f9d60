"""Images of a multi-modal prompt row -> RGB PIL images, sized as upstream verl's dataset sizes them.

Upstream's ``process_image`` calls ``qwen_vl_utils.fetch_image``; that package imports torchvision,
which has no CPU build matching the pinned torch here, so its image rule is written out below. The
behaviour is upstream's:

- a ``PIL.Image.Image`` is only converted to RGB (no resize; the processor resizes it);
- a dict (what parquet stores: ``{"bytes": ..., "path": ...}``, or ``{"image": ...}``) is opened,
  converted to RGB (an RGBA image over a white background, as ``fetch_image``) and resized to the
  closest size whose sides are multiples of ``2 * image_patch_size`` (one merged patch) and whose area
  lies within ``min_pixels`` .. ``max_pixels`` (defaults 4 and 16384 merged patches; a row's dict may
  set ``min_pixels``/``max_pixels``, or ``resized_height``/``resized_width``).

Deliberate differences: a dict holding only ``path`` (parquet written without the bytes) opens that
file, where upstream fails; URLs are refused with an error (fetching images over the network while
training is left to the preprocessing step). Videos are refused: reading them needs torchvision.
"""

from __future__ import annotations

import base64
import math
import os
from io import BytesIO

from PIL import Image

SPATIAL_MERGE_SIZE = 2
IMAGE_MIN_TOKEN_NUM = 4
IMAGE_MAX_TOKEN_NUM = 16384
MAX_RATIO = 200


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor``, the area scaled into [min_pixels, max_pixels]
    keeping the aspect ratio (qwen_vl_utils' rule; Python's round, so halves go to the even multiple)."""
    max_pixels = IMAGE_MAX_TOKEN_NUM * factor**2 if max_pixels is None else max_pixels
    min_pixels = IMAGE_MIN_TOKEN_NUM * factor**2 if min_pixels is None else min_pixels
    if max_pixels < min_pixels:
        raise ValueError(f"max_pixels={max_pixels} is smaller than min_pixels={min_pixels}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"an image of {width}x{height} pixels has an aspect ratio over {MAX_RATIO}; crop or pad it in preprocessing"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def _open(source) -> Image.Image:
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, bytes | bytearray):
        return Image.open(BytesIO(source))
    if not isinstance(source, str):
        raise TypeError(f"an image reference must be bytes, a path or a PIL image, got {type(source).__name__}")
    if source.startswith(("http://", "https://")):
        raise ValueError(
            f"image {source[:80]!r} is a URL; images are not downloaded while training. Download them in "
            "preprocessing and store the bytes (or a local path) in the parquet file"
        )
    if source.startswith("data:image"):
        if "base64," not in source:
            raise ValueError(f"data URL image {source[:40]!r}... is not base64-encoded")
        return Image.open(BytesIO(base64.b64decode(source.split("base64,", 1)[1])))
    path = source[len("file://") :] if source.startswith("file://") else source
    if not os.path.exists(path):
        raise FileNotFoundError(f"image file {path!r} does not exist (working directory {os.getcwd()!r})")
    return Image.open(path)


def process_image(image: dict | Image.Image, image_patch_size: int = 14) -> Image.Image:
    """One image of a row (a PIL image, or a dict with ``bytes``, ``image`` or ``path``) as an RGB PIL image.

    PIL images are converted only; dict images are resized within the pixel budget (module docstring).
    """
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if not isinstance(image, dict):
        raise TypeError(
            f"an image must be a PIL image or a dict with 'bytes' or 'path' (as parquet stores images), got "
            f"{type(image).__name__}"
        )
    if image.get("bytes") is not None:
        if image.get("image") is not None:
            raise ValueError("an image dict holds both 'bytes' and 'image'; keep one of them")
        source = image["bytes"]
    elif image.get("image") is not None:
        source = image["image"]
    elif image.get("path"):
        source = image["path"]
    else:
        raise ValueError(
            f"an image dict needs 'bytes', 'image' or 'path', got the keys {sorted(image)}; store images as "
            "datasets.Image does ({'bytes': <encoded file>, 'path': ...})"
        )
    opened = _to_rgb(_open(source))
    factor = int(image_patch_size) * SPATIAL_MERGE_SIZE
    if image.get("resized_height") is not None and image.get("resized_width") is not None:
        height, width = smart_resize(int(image["resized_height"]), int(image["resized_width"]), factor)
    else:
        width, height = opened.size
        height, width = smart_resize(height, width, factor, image.get("min_pixels"), image.get("max_pixels"))
    return opened.resize((width, height))


def process_video(video, image_patch_size: int = 14, **kwargs):
    """Videos are not supported here: reading and sampling frames needs torchvision (not installable on
    this build). Always raises, with what to do."""
    raise NotImplementedError(
        "video inputs are not supported: reading video frames needs torchvision, which is not installed. "
        "Use image data (data.image_key), or drop the data.video_key column"
    )


def process_multi_modal_inputs_for_minicpmo(input_ids, attention_mask, position_ids, cu_seqlens, multi_modal_inputs):
    """MiniCPM-o's multi-modal inputs for a packed (padding-removed) micro-batch, as upstream's actors
    pass them: `{"data": {...}}`.

    `multi_modal_inputs` holds one entry per row: `image_bound` [n_i, 2] (token spans of each image in
    the left-padded row), `pixel_values` (a list of image tensors) and `tgt_sizes` [n_i, 2]. Packing
    drops row i's left padding and starts it at `cu_seqlens[i]`, so each bound moves by
    `cu_seqlens[i] - left_padding_i` (left padding = the index of the row's first attended token).
    The rows' images become one list, their bounds and target sizes one stacked tensor each (a batch
    of one packed sequence), and the packed `input_ids`, `attention_mask`, `position_ids` are added.
    Other keys pass through. The input dict is updated in place, as upstream's is.
    """
    import torch

    left_padding = torch.argmax(attention_mask, dim=1)
    bounds = [
        bound.to(left_padding.device) - left_padding[i] + cu_seqlens[i]
        for i, bound in enumerate(multi_modal_inputs["image_bound"])
    ]
    multi_modal_inputs["pixel_values"] = [[image for row in multi_modal_inputs["pixel_values"] for image in row]]
    multi_modal_inputs["image_bound"] = [torch.vstack(bounds)]
    multi_modal_inputs["tgt_sizes"] = [torch.vstack(multi_modal_inputs["tgt_sizes"])]
    multi_modal_inputs["input_ids"] = input_ids
    multi_modal_inputs["attention_mask"] = attention_mask
    multi_modal_inputs["position_ids"] = position_ids
    return {"data": multi_modal_inputs}
