"""The built-in engine's image inputs (vision-language models, Qwen2.5-VL; see `native.engine`).

Each prompt row carries its own dict of model inputs (`pixel_values`, `image_grid_thw`, the
processor's output for the row's images; empty for a text-only row). The engine keeps them per row,
so whatever splits or reorders rows (chunks, compaction, repeated prompts, resumed partial
rollouts) carries each row's images with it; only the prefill reads them, as the concatenation of
the prefilled rows' tensors in row order (`vision_kwargs`). Rows share a prefill only when their
images are equal too (`image_keys`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch


def check_images(vision_config, batch_size: int, position_ids, multi_modal_inputs) -> list[Mapping] | None:
    """The rows' multi-modal inputs as a list (None when no row has any), after checking that the
    model (`vision_config`: its HF config when it is a vision-language model, else None) takes them
    and that the positions have the shape its rotary embedding needs."""
    if position_ids is not None and position_ids.dim() == 3 and vision_config is None:
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} (multimodal M-RoPE) for a rollout model that is "
            "not a vision-language model; text models take [batch, prompt_len] positions"
        )
    if multi_modal_inputs is None:
        return None
    images = [unwrap_row(row) for row in multi_modal_inputs]
    if len(images) != batch_size:
        raise ValueError(f"multi_modal_inputs has {len(images)} entries for {batch_size} prompt rows; pass one per row")
    if not any(images):
        return None
    for row in images:
        unknown = set(row or {}) - {"pixel_values", "image_grid_thw"}
        if unknown:
            raise ValueError(
                f"multi_modal_inputs keys {sorted(unknown)} are not supported by the built-in rollout engine: it "
                "generates with images (pixel_values, image_grid_thw) only; videos are not supported"
            )
    if vision_config is None:
        raise ValueError(
            "the prompts carry images (multi_modal_inputs) but the rollout model is not a vision-language model "
            "(its config has no vision_config); use a vision-language checkpoint (e.g. Qwen2.5-VL) or text-only data"
        )
    if position_ids is not None and position_ids.dim() != 3:
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} for prompts with images: a vision-language model "
            "needs [batch, 4, prompt_len] positions (text row + M-RoPE rows, verl.utils.vision.vl_position_ids), "
            "or none (then they are computed here)"
        )
    return images


NO_IMAGES: Mapping = MappingProxyType({})


def unwrap_row(row):
    """A row's multi-modal dict ({} for a text-only row); tensordict's NonTensorData is unwrapped."""
    row = getattr(row, "data", row) if type(row).__name__ == "NonTensorData" else row
    return row if row else NO_IMAGES  # the row's own object: `image_keys` hashes each object once


def vision_kwargs(images: list[Mapping] | None, rows: list[int] | None) -> dict:
    """The model's image arguments for prefilling `rows` (all rows when None): their `pixel_values`
    and `image_grid_thw` concatenated in row order; {} when those rows have no image."""
    if images is None:
        return {}
    selected = [images[i] for i in rows] if rows is not None else images
    selected = [row for row in selected if row.get("pixel_values") is not None]
    if not selected:
        return {}
    return {
        "multi_modal": {
            "pixel_values": torch.cat([torch.as_tensor(row["pixel_values"]) for row in selected]),
            "image_grid_thw": torch.cat([torch.as_tensor(row["image_grid_thw"]).reshape(-1, 3) for row in selected]),
        }
    }


def image_keys(images: list[Mapping]) -> torch.Tensor:
    """[B] int64: equal for rows whose images are equal (0: no image), so that only rows with the same
    prompt *and* images share a prefill. A row's key is a hash of its pixel values and grids, computed
    once per distinct dict object: rows repeated for GRPO (`DataProto.repeat`) share their dict, and so
    hash one image once."""
    import hashlib

    by_object: dict[int, bytes] = {}
    numbers: dict[bytes, int] = {}
    keys = []
    for row in images:
        if row.get("pixel_values") is None:
            keys.append(0)
            continue
        digest = by_object.get(id(row))
        if digest is None:
            h = hashlib.blake2b(digest_size=16)
            for name in ("pixel_values", "image_grid_thw"):
                t = torch.as_tensor(row[name]).detach().cpu().contiguous()
                h.update(str((t.dtype, tuple(t.shape))).encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            digest = by_object[id(row)] = h.digest()
        keys.append(numbers.setdefault(digest, len(numbers) + 1))
    return torch.tensor(keys, dtype=torch.long)
