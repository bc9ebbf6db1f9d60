"""The tiny vision-language model and image prompts for the rollout tests with images.

`tiny_vl_dir` writes the `tiny-vl` preset (transformers' own Qwen2.5-VL at tiny sizes; or `tiny-qwen3-vl`) with its
matrices re-drawn at std 0.15 (seeded): at the preset's 0.02 every row greedily repeats one token
whatever its image, and a comparison would prove nothing. With 0.15 the next-token margins are
clear in float32 and two images of the same size lead to different responses.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

PAD = 0


def tiny_vl_dir(out_dir: str, seed: int = 0, preset: str = "tiny-vl") -> str:
    from transformers import AutoModelForImageTextToText

    from verl.models.factory import make_tiny

    path = make_tiny(preset, out_dir)
    redraw(AutoModelForImageTextToText.from_pretrained(path), seed).save_pretrained(path)
    return path


def redraw(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    return model.eval()


def random_image(width: int, height: int, seed: int):
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=gen) * 255).to(torch.uint8).numpy())


def vl_prompt_batch(processor, config, rows, **meta):
    """A DataProto of the contract's multi-modal prompt rows: `rows` is a list of (text, images) with
    one `{"type": "image"}` part per image before the text; processed one row at a time, left-padded.
    Returns (DataProto, the per-row processor outputs)."""
    from tensordict import TensorDict

    from verl.protocol import DataProto
    from verl.utils.vision import vl_position_ids

    outputs, raw_ids, data, inputs = [], [], [], []
    for text, images in rows:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        chat = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        out = processor(text=[chat], images=list(images) or None, return_tensors="pt")
        outputs.append(out)
        raw_ids.append(processor.tokenizer(chat, add_special_tokens=False)["input_ids"])
        data.append({"images": list(images)} if images else {})
        inputs.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]} if images else {})
    width = max(o["input_ids"].shape[1] for o in outputs)
    B = len(rows)
    input_ids = torch.full((B, width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    mm_token_type_ids = torch.zeros((B, width), dtype=torch.long)
    for i, out in enumerate(outputs):
        n = out["input_ids"].shape[1]
        input_ids[i, width - n :] = out["input_ids"][0]
        attention_mask[i, width - n :] = 1
        mm_token_type_ids[i, width - n :] = out["mm_token_type_ids"][0]
    grids = [row["image_grid_thw"] for row in inputs if row]
    grids = torch.cat(grids) if grids else None
    position_ids = vl_position_ids(config, input_ids, attention_mask, grids)
    batch = TensorDict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}, batch_size=[B]
    )
    non_tensors = {"raw_prompt_ids": _objects(raw_ids), "multi_modal_data": _objects(data)}
    non_tensors["multi_modal_inputs"] = _objects(inputs)
    proto = DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(meta))
    proto.meta_info.setdefault("pad_token_id", PAD)
    return proto, mm_token_type_ids


def _objects(items) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


def hf_greedy(model, prompts, mm_token_type_ids, max_new_tokens: int, eos=None) -> torch.Tensor:
    """transformers' own `generate` (greedy) on the whole left-padded batch, [B, max_new_tokens], over the
    tokens the policy can emit (the input-only vision markers suppressed, as the rollout engines do)."""
    from verl.utils.model import extract_multi_modal_inputs
    from verl.utils.vision import input_only_token_ids

    images = extract_multi_modal_inputs(list(prompts.non_tensor_batch["multi_modal_inputs"]))
    P = prompts.batch["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts.batch["input_ids"],
            attention_mask=prompts.batch["attention_mask"],
            mm_token_type_ids=mm_token_type_ids,
            **images,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=eos,
            suppress_tokens=input_only_token_ids(model.config),
        )[:, P:]
    return torch.nn.functional.pad(out, (0, max_new_tokens - out.shape[1]), value=PAD)


def teacher_forced_log_probs(model, prompts, responses, response_mask) -> torch.Tensor:
    """[B, R] float64: log p(response token) from a plain forward of each row alone (no padding, no
    cache) over its prompt + response with its images; 0 where masked."""
    from verl.utils.vision import input_only_token_ids, vl_position_ids

    model = copy.deepcopy(model).double()
    if getattr(model.config.get_text_config(), "num_experts", 0):  # grouped_mm has no float64 kernel on CPU
        model.set_experts_implementation("eager")
    B, R = responses.shape
    out = torch.zeros((B, R), dtype=torch.float64)
    for i in range(B):
        keep = prompts.batch["attention_mask"][i].bool()
        n = int(response_mask[i].sum())
        ids = torch.cat([prompts.batch["input_ids"][i][keep], responses[i, :n]])[None]
        mask = torch.ones_like(ids)
        images = prompts.non_tensor_batch["multi_modal_inputs"][i]
        grid = images.get("image_grid_thw")
        kwargs = {"pixel_values": images["pixel_values"].double(), "image_grid_thw": grid} if images else {}
        positions = vl_position_ids(model.config, ids, mask, grid).transpose(0, 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits[0]
        P = int(keep.sum())
        # the rollout never samples the input-only vision markers: the distribution is over the other tokens
        unsampled = torch.tensor(input_only_token_ids(model.config))
        logp = torch.log_softmax(logits[P - 1 : P - 1 + n].index_fill(-1, unsampled, float("-inf")), dim=-1)
        out[i, :n] = logp.gather(-1, responses[i, :n, None]).squeeze(-1)
    return out
