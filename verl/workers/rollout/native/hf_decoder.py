"""The generic path: any transformers causal LM, driven through its own forward and KV cache.

Used when `llama_decoder.unsupported_reason` refuses a model (GPT-2, sliding-window models,
dynamic RoPE, ...), so every causal LM still generates with the same engine loop, sampling,
weight sync and sleep/wake semantics; it is as slow per step as transformers itself.

It exposes the same surface as `LlamaDecoder` (allocate/load/release weights, reserve/prefill/
decode_step). The model is the engine's own copy: weights arrive through `load_weights`, and
`release_weights` swaps every parameter's storage for an empty tensor (shapes are remembered),
so sleeping frees the memory without rebuilding the module.

With expert parallelism (`expert_parallel=(group, rank, size)`) the model's routed experts are
split over the group (`expert_parallel.shard_experts`) and `load_weights` keeps this rank's rows of
each full expert tensor it is sent.

Vision-language models (Qwen2.5-VL) run here too: the prefill takes the prefilled rows' images
(`multi_modal={"pixel_values", "image_grid_thw"}`) and, like every forward, position ids of shape
[B, 4, length] (text row + M-RoPE rows; [B] or [B, 4] per decode step), which the model takes as
[4, B, length]. Weights synced under the checkpoint names of transformers 4 (`visual.*`,
`model.layers.*`, as the released Qwen2.5-VL checkpoints and older trainers name them) are mapped
to the model's own (`model.visual.*`, `model.language_model.*`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from verl.utils.hf_forward import model_forward
from verl.utils.vision import input_only_token_ids
from verl.workers.rollout.native.llama_decoder import canonical_name

# transformers 4's Qwen2-VL family names -> transformers 5's (the released checkpoints use the former)
_LEGACY_VL_NAMES = (
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!visual\.|language_model\.)"), "model.language_model."),
)


def _model_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] stays; [B, 4, L] (upstream verl's multimodal layout) -> [4, B, L], the model's."""
    return position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids


class HFModelDecoder:
    """Wraps an HF `PreTrainedModel` (owned by the engine) as a prefill/decode decoder."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, expert_parallel=None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.vocab_size = model.config.get_text_config().vocab_size
        # parameter name -> the expert-parallel module whose rows of the full tensor this rank keeps
        self._expert_shards = {}
        if expert_parallel is not None:
            from verl.workers.rollout.native.expert_parallel import shard_experts

            for name, module in shard_experts(self.model, *expert_parallel).items():
                self._expert_shards.update({f"{name}.gate_up_proj": module, f"{name}.down_proj": module})
        # every name a state dict may use (tied aliases included) -> the module attribute holding it
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        self._released = False
        self._cache = None
        self._mask: torch.Tensor | None = None
        forward = model_forward(self.model)
        if forward.cache_argument is None:
            raise ValueError(
                f"{type(model).__name__}.forward takes no KV cache argument (neither `cache` nor `past_key_values`), "
                "which the built-in rollout engine needs to generate; use a model with a KV cache or another "
                "rollout engine (actor_rollout_ref.rollout.name)"
            )
        self._forward = forward
        self._legacy_vl_names = getattr(model.config, "vision_config", None) is not None
        # a vision-language model's image/video markers are never sampled (verl.utils.vision.input_only_token_ids)
        self._unsampled = torch.tensor(input_only_token_ids(model.config), dtype=torch.long, device=self.device)

    # ----------------------------------------------------------------------------------- weights
    def _never_sampled(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the input-only vision markers at -inf (unchanged for a text model)."""
        if self._unsampled.numel():
            logits = logits.index_fill(-1, self._unsampled, float("-inf"))
        return logits

    def parameter_names(self) -> list[str]:
        return list(self._shapes)

    def allocate_weights(self) -> None:
        if not self._released:
            return
        for name, param in self.model.named_parameters():
            param.data = torch.empty(self._shapes[name], device=self.device, dtype=self.dtype)
        self._released = False

    def release_weights(self) -> None:
        for param in self.model.parameters():
            param.data = torch.empty(0, device=self.device, dtype=self.dtype)
        self._released = True

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self._released:
            raise RuntimeError("the decoder's weights are released (sleep); call wake_up() before update_weights()")
        loaded = set()
        for raw_name, tensor in named_tensors:
            name = canonical_name(raw_name)
            if self._legacy_vl_names and name not in self._params:
                for pattern, prefix in _LEGACY_VL_NAMES:
                    name = pattern.sub(prefix, name, count=1)
            param = self._params.get(name)
            if param is None:
                if name in dict(self.model.named_buffers()):
                    continue  # buffers (rotary tables, position ids) are derived from the config
                raise KeyError(f"weight {raw_name!r} is not a parameter of the rollout's {type(self.model).__name__}")
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            shard = self._expert_shards.get(name)
            expected = tuple(param.shape) if shard is None else (shard.num_experts, *param.shape[1:])
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"weight {raw_name!r} has shape {tuple(tensor.shape)} but the rollout model expects "
                    f"{expected}; the synced model must have the same config as the rollout's"
                )
            if shard is not None:
                tensor = shard.local_rows(tensor)
            param.data.copy_(tensor)
            loaded.add(name)
        # names of one tied parameter count as one
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        return {by_id[id(self._params[n])] for n in loaded}

    # ------------------------------------------------------------------------------------- cache
    def reserve(self, batch: int, max_len: int, max_position: int) -> bool:
        self._mask = torch.zeros(batch, max_len, dtype=torch.long, device=self.device)
        return True

    def select_rows(self, index: torch.Tensor, columns: int) -> None:
        """Keep rows `index` of the cache and mask (see `LlamaDecoder.select_rows`)."""
        self._cache.reorder_cache(index)
        self._mask = self._mask[index]

    def release_cache(self) -> None:
        self._cache = None
        self._mask = None

    def cache_bytes(self) -> int:
        return 0 if self._mask is None else self._mask.numel() * self._mask.element_size()

    # ----------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        rows: torch.Tensor | None = None,
        multi_modal: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from transformers import DynamicCache

        B, P = input_ids.shape
        self._mask = self._mask[:B]
        self._mask.zero_()
        self._mask[:, :P] = attention_mask
        self._cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=self._mask[:, :P],
            position_ids=_model_positions(position_ids),
            use_cache=True,
            **{k: v.to(self.device) for k, v in (multi_modal or {}).items()},
            **self._forward.cache_kwargs(self._cache),
            # only the last position's logits are sampled from: skip the LM head elsewhere
            **({"logits_to_keep": 1} if self._forward.accepts_logits_to_keep else {}),
        )
        if rows is not None:  # fan the prompts out to the cache rows that repeat them
            self._cache.reorder_cache(rows)
            self._mask = self._mask[rows]
        return self._never_sampled(out.logits[:, -1])

    @torch.no_grad()
    def decode_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, step_index: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        self._mask.index_fill_(1, step_index, 1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self._mask[:, :kv_len],
            position_ids=_model_positions(positions[..., None]),
            use_cache=True,
            **self._forward.cache_kwargs(self._cache),
        )
        return self._never_sampled(out.logits[:, -1])
