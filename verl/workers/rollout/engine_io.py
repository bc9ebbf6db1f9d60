"""What the rollout engine adapters share: sampling resolution, request building, output layout.

Every engine (`hf`, `vllm`, `sglang`) turns the same DataProto of left-padded prompts into the same
DataProto of responses; this module holds the engine-independent halves of that, so the adapters
for external engines reduce to "build requests, call the engine, read back token ids and log-probs":

- `resolve_sampling(config, meta, prompts)` decides greedy vs sampling, temperature/top-k/top-p and
  how many samples each row gets, in upstream verl's precedence (see `hf_rollout`).
- `prompt_token_lists(input_ids, attention_mask)` strips the left padding into plain token lists,
  the request format of vLLM (`TokensPrompt`) and SGLang (`input_ids=`).
- `assemble_output(...)` pads the engine's responses back into the batch layout of DESIGN.md:
  `responses` right-padded with pad_token_id, `response_mask` 1 up to and including the first
  stop token, positions continuing from the prompt's last, and `rollout_log_probs` (0 where
  masked) when the engine returned them. Everything after the first stop token is dropped, so an
  engine that reports a few tokens past a stop cannot leak them into training.
- `hf_weight_name(name)` strips the wrappers FSDP, activation checkpointing and torch.compile add
  to parameter names, so engines receive plain Hugging Face names.
- `response_position_ids(position_ids, response_mask)`: the positions of prompt + response, for text
  models' [B, P] positions and vision-language models' [B, 4, P] (text row + M-RoPE rows) alike.
- `multi_modal_rows(prompts, image_processor)`: each row's images as the model's inputs
  (`pixel_values`, `image_grid_thw`), from `multi_modal_inputs` or, without them, by running the image
  processor on `multi_modal_data["images"]` (docs/multimodal_rollout.md); `prompt_position_ids` the
  prompt's positions in the layout the model needs.
- `image_requests(prompts, image_token_id)`: the requests of engines that process images themselves
  (vLLM): each row's ids with one image token per image, and the row's images.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verl.utils.vision import vl_position_ids
from verl.workers.rollout.sampling import SamplingParams

_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.|_orig_mod\.)")


def hf_weight_name(name: str) -> str:
    """`model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight` -> `model.layers.0.mlp.up_proj.weight`."""
    return _WRAPPER_PREFIXES.sub("", name)


def response_position_ids(position_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Positions of prompt + response: [B, P+R] from [B, P], or [B, 4, P+R] from [B, 4, P].

    Text positions ([B, P]): every response column continues the prompt's last position by one
    (masked columns too, as upstream does). Multimodal positions (upstream verl's layout, see
    `verl.utils.vision.vl_position_ids`): the response is text, so each of the four rows goes on by
    one per generated token; the columns after a response's end get what `vl_position_ids` gives
    padding over the whole sequence (the text row repeats its last value, the M-RoPE rows are 0), so
    the output equals `vl_position_ids` of prompt + response exactly.
    """
    R = response_mask.shape[-1]
    delta = torch.arange(1, R + 1, device=position_ids.device, dtype=position_ids.dtype)
    if position_ids.dim() == 2:
        return torch.cat([position_ids, position_ids[:, -1:] + delta], dim=-1)
    mask = response_mask.to(position_ids.device, position_ids.dtype)
    last = position_ids[..., -1:]  # [B, 4, 1]
    text = last[:, :1] + mask.cumsum(-1)[:, None]
    mrope = (last[:, 1:] + delta) * mask[:, None]
    return torch.cat([position_ids, torch.cat([text, mrope], dim=1)], dim=-1)


def multi_modal_rows(prompts, image_processor=None) -> list[dict] | None:
    """Each prompt row's image inputs for the model (`{"pixel_values", "image_grid_thw"}`, {} for a
    text-only row), or None when no row has an image.

    `non_tensor_batch["multi_modal_inputs"]` (what the dataset's processor made, and what the actor
    trains on) is used when present. Without it, the images of `non_tensor_batch["multi_modal_data"]`
    go through `image_processor` (a callable returning `pixel_values` and `image_grid_thw`, e.g. the
    model's processor's `image_processor`; None for a text model, whose rows with images are refused);
    the prompt ids must then already hold the expanded image tokens. Videos are refused.
    """
    inputs = prompts.non_tensor_batch.get("multi_modal_inputs")
    if inputs is not None:
        rows = [_unwrap(row) for row in inputs]
        return rows if any(rows) else None
    data = prompts.non_tensor_batch.get("multi_modal_data")
    if data is None:
        return None
    rows, done = [], {}  # rows repeated for GRPO share their dict: process each one once
    for item in data:
        item = _unwrap(item)
        if id(item) in done:
            rows.append(done[id(item)])
            continue
        if item.get("videos") or item.get("video"):
            raise ValueError(
                "a prompt carries videos (multi_modal_data['videos']): the rollout generates with images only; "
                "drop data.video_key or the video rows"
            )
        images = item.get("images", item.get("image"))
        if not images:
            rows.append({})
            continue
        if not isinstance(images, (list, tuple)):
            images = [images]
        if image_processor is None:
            raise ValueError(
                "the prompts carry images (multi_modal_data) but the rollout model is not a vision-language model "
                "(its config has no vision_config); use a vision-language checkpoint (e.g. Qwen2.5-VL) or text-only data"
            )
        out = image_processor(images=list(images), return_tensors="pt")
        rows.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]})
        done[id(item)] = rows[-1]
    return rows if any(rows) else None


def has_images(prompts) -> bool:
    """Whether any prompt row carries an image (in `multi_modal_inputs` or `multi_modal_data`)."""
    for key in ("multi_modal_inputs", "multi_modal_data"):
        column = prompts.non_tensor_batch.get(key)
        if column is not None and any(_unwrap(row) for row in column):
            return True
    return False


def image_grids(images: list[Mapping] | None) -> torch.Tensor | None:
    """All rows' `image_grid_thw` rows, in row order (None when no row has an image)."""
    grids = [row["image_grid_thw"] for row in images or [] if row.get("image_grid_thw") is not None]
    return torch.cat([torch.as_tensor(g).reshape(-1, 3) for g in grids]) if grids else None


def prompt_position_ids(vision_config, input_ids, attention_mask, position_ids, images):
    """The prompt's positions as the model takes them: [B, P] for a text model (`vision_config`
    None); [B, 4, P] for a vision-language one, computed with `vl_position_ids` when the batch has
    none or only text positions."""
    if vision_config is not None and (position_ids is None or position_ids.dim() != 3):
        ids, mask = input_ids.cpu(), attention_mask.cpu()
        return vl_position_ids(vision_config, ids, mask, image_grids(images)).to(input_ids.device)
    if position_ids is None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if position_ids.dim() != 2 and vision_config is None:
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} (multimodal M-RoPE) for a rollout model that is "
            "not a vision-language model; text models take [batch, prompt_len] positions"
        )
    return position_ids


def image_requests(prompts, image_token_id: int) -> tuple[list[list[int]], list[list | None]]:
    """(token ids, images) per row for an engine that runs the image processor itself (vLLM).

    The ids are the row's unpadded prompt with each image's run of `<|image_pad|>` tokens collapsed
    to one (upstream's `raw_prompt_ids`; the engine expands them again from the image's size). They
    are derived from `input_ids`, so they always match the tokens the trainer sees. The images are
    `multi_modal_data["images"]` (None for a text-only row); a row whose image count differs from
    its image-token runs is refused.
    """
    ids = prompt_token_lists(prompts.batch["input_ids"], prompts.batch["attention_mask"])
    data = prompts.non_tensor_batch.get("multi_modal_data")
    requests, images = [], []
    for row, tokens in enumerate(ids):
        collapsed = [t for i, t in enumerate(tokens) if t != image_token_id or i == 0 or tokens[i - 1] != t]
        item = _unwrap(data[row]) if data is not None else {}
        if item.get("videos") or item.get("video"):
            raise ValueError(
                "a prompt carries videos (multi_modal_data['videos']): the rollout generates with images only"
            )
        row_images = item.get("images", item.get("image")) or []
        row_images = list(row_images) if isinstance(row_images, (list, tuple)) else [row_images]
        runs = collapsed.count(image_token_id)
        if runs != len(row_images):
            raise ValueError(
                f"prompt row {row} has {runs} image(s) in its tokens but {len(row_images)} in "
                "non_tensor_batch['multi_modal_data']['images']; the engine needs the images themselves (PIL), one per "
                "image placeholder (data.image_key)"
            )
        requests.append(collapsed)
        images.append(row_images or None)
    return requests, images


def _unwrap(row) -> dict:
    row = getattr(row, "data", row) if type(row).__name__ == "NonTensorData" else row
    return row if row else {}


def _sampling(do_sample: bool, temperature: float, top_k: int, top_p: float) -> SamplingParams:
    if not do_sample or temperature == 0:
        return SamplingParams(do_sample=False)
    return SamplingParams(do_sample=True, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))


def _was_repeated(prompts) -> bool:
    uid = prompts.non_tensor_batch.get("uid")
    return uid is not None and len(set(uid.tolist())) < len(uid)


def resolve_sampling(config, meta: Mapping, prompts) -> tuple[SamplingParams, int]:
    """(sampling parameters, samples per row) for one `generate_sequences` call.

    `config` has the rollout keys do_sample, temperature, top_k, top_p, n and val_kwargs (an object
    with do_sample, temperature, top_k, top_p, n). Precedence: `meta["do_sample"] is False` ->
    greedy; `meta["validate"]` -> val_kwargs; else the config, each key overridable by meta. Rows
    are repeated only when `meta["n"]` asks for it, or when n > 1 and the batch evidently was not
    repeated by the driver (no `uid`, or every `uid` distinct). The config's `logprobs_mode` says
    what the returned log-probs are.
    """
    params, n = _resolve_sampling(config, meta, prompts)
    return dataclasses.replace(params, logprobs_mode=config.logprobs_mode), n


def _resolve_sampling(config, meta: Mapping, prompts) -> tuple[SamplingParams, int]:
    if meta.get("do_sample", config.do_sample) is False:
        return SamplingParams(do_sample=False), int(meta.get("n", 1))
    if meta.get("validate", False):
        vk = config.val_kwargs
        params, n = _sampling(vk.do_sample, vk.temperature, vk.top_k, vk.top_p), vk.n
    else:
        params = _sampling(
            True,
            meta.get("temperature", config.temperature),
            meta.get("top_k", config.top_k),
            meta.get("top_p", config.top_p),
        )
        n = config.n
    if "n" in meta:
        return params, int(meta["n"])
    if not params.do_sample or _was_repeated(prompts):
        return params, 1
    return params, int(n)


def resolve_token_ids(meta: Mapping, default_eos, default_pad) -> tuple[list[int], int]:
    """(stop token ids, pad token id) from meta_info, falling back to the tokenizer/model defaults."""
    eos = meta.get("eos_token_id", default_eos)
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, (int, np.integer)) else [int(e) for e in eos])
    pad = meta.get("pad_token_id", default_pad)
    if pad is None:
        pad = eos_ids[0] if eos_ids else None
    if pad is None:
        raise ValueError(
            "the rollout cannot tell which token pads responses: put pad_token_id (or eos_token_id) in "
            "meta_info, pass a tokenizer to the rollout, or set pad_token_id in the model config"
        )
    return eos_ids, int(pad)


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The unpadded token ids of each row of a left-padded [B, P] prompt batch."""
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


@dataclass
class EngineResponse:
    """One generated response as an engine returns it: token ids and, optionally, their log-probs."""

    token_ids: Sequence[int]
    logprobs: Sequence[float] | None = None


def assemble_output(
    prompts,
    responses: Sequence[EngineResponse],
    response_length: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    with_logprobs: bool,
    meta: dict,
    position_ids: torch.Tensor | None = None,
):
    """The rollout's output DataProto from per-row engine responses (see the module docstring).

    `prompts` is the (already repeated) input DataProto; `responses[i]` belongs to its row i;
    `position_ids` the prompt's positions when they are not (or not in that layout) in `prompts`.
    """
    from tensordict import TensorDict

    from verl.protocol import DataProto

    input_ids = prompts.batch["input_ids"]
    attention_mask = prompts.batch["attention_mask"]
    if position_ids is None:
        position_ids = prompts.batch.get("position_ids", None)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if len(responses) != input_ids.shape[0]:
        raise RuntimeError(f"the engine returned {len(responses)} responses for {input_ids.shape[0]} prompts")
    batch_size, device = input_ids.shape[0], input_ids.device
    out_ids = torch.full((batch_size, response_length), pad_token_id, dtype=input_ids.dtype)
    out_mask = torch.zeros(batch_size, response_length, dtype=attention_mask.dtype)
    out_logprobs = torch.zeros(batch_size, response_length, dtype=torch.float32)
    stops = set(int(t) for t in eos_token_ids)
    for row, response in enumerate(responses):
        tokens = [int(t) for t in response.token_ids[:response_length]]
        length = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
        out_ids[row, :length] = torch.tensor(tokens[:length], dtype=input_ids.dtype)
        out_mask[row, :length] = 1
        if with_logprobs:
            if response.logprobs is None or len(response.logprobs) < length:
                raise RuntimeError(
                    f"the engine returned {0 if response.logprobs is None else len(response.logprobs)} log-probs "
                    f"for a response of {length} tokens; rollout_log_probs need one per token"
                )
            out_logprobs[row, :length] = torch.tensor([float(x) for x in response.logprobs[:length]])

    out_ids, out_mask = out_ids.to(device), out_mask.to(device)
    tensors = {
        "prompts": input_ids,
        "responses": out_ids,
        "input_ids": torch.cat([input_ids, out_ids], dim=-1),
        "attention_mask": torch.cat([attention_mask, out_mask], dim=-1),
        "position_ids": response_position_ids(position_ids, out_mask),
        "response_mask": out_mask,
    }
    if with_logprobs:
        tensors["rollout_log_probs"] = out_logprobs.to(device)
    batch = TensorDict(tensors, batch_size=[batch_size])
    return DataProto(batch=batch, non_tensor_batch=dict(prompts.non_tensor_batch), meta_info=meta)
