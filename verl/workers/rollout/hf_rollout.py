"""`HFRollout`: the built-in rollout engine (`actor_rollout_ref.rollout.name=hf`).

It adapts `native.engine.GenerationEngine` (a static-KV-cache decoder for Llama/Qwen2/Mistral
models, CUDA-graph decode on GPU, a generic HF-forward path for any other causal LM) to the
DataProto contract of `BaseRollout`.

Sampling parameters, in upstream verl's precedence:
- `meta_info["do_sample"] is False` -> greedy, one sample per prompt;
- `meta_info["validate"]` -> `config.val_kwargs` (temperature 0 or do_sample False means greedy);
- otherwise the config's temperature/top_k/top_p, each overridable by the same meta_info key.

Samples per prompt: the driver normally repeats every prompt `n` times itself before calling
(`batch.repeat(n, interleave=True)`, rows sharing a `uid`), so the engine draws one sample per row.
It repeats the rows itself (interleaved, non-tensor columns too) only when `meta_info["n"]` asks
for it, or when `config.n` (or `val_kwargs.n`) > 1 and the batch evidently was not repeated: it has
no `uid` column, or every `uid` is distinct.

Output layout (DESIGN.md): `prompts` [B, P], `responses` [B, R] right-padded with pad_token_id,
`input_ids`/`attention_mask`/`position_ids` [B, P+R] (positions continue from the prompt's last;
the mask is 1 up to and including the EOS token), `response_mask` [B, R] and, with
`calculate_log_probs`, `rollout_log_probs` [B, R] (0 where masked). R is always the configured
response length, whatever the longest response.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from verl.utils.device import get_device
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.engine_io import resolve_sampling, resolve_token_ids
from verl.workers.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ValKwargs:
    """Sampling used when `meta_info["validate"]` is true (upstream `rollout.val_kwargs`)."""

    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = False
    n: int = 1


@dataclass
class HFRolloutConfig:
    """The rollout config keys the built-in engine reads (other keys, e.g. vLLM's, are ignored)."""

    temperature: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    top_p: float = 1.0
    n: int = 1
    """Samples per prompt when the batch was not repeated by the driver (see module docstring)."""
    do_sample: bool = True
    prompt_length: int = 512
    response_length: int = 512
    """Maximum new tokens; also the width of `responses`."""
    calculate_log_probs: bool = False
    """Return `rollout_log_probs` (log-prob of each sampled token under logits / temperature)."""
    free_cache_engine: bool = True
    """Let the hybrid engine call sleep()/wake_up() around generation."""
    dtype: str = "auto"
    """Engine weights and KV cache: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16."""
    enforce_eager: bool = False
    """True disables CUDA-graph decoding on GPU."""
    max_num_seqs: int = 1024
    """At most this many sequences generate at once; larger batches run in chunks."""
    ignore_eos: bool = False
    """Generate `response_length` tokens even past end-of-sequence (benchmarks, load tests)."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)

    def __post_init__(self):
        if isinstance(self.val_kwargs, Mapping):
            known = {f.name for f in dataclasses.fields(ValKwargs)}
            self.val_kwargs = ValKwargs(**{k: v for k, v in self.val_kwargs.items() if k in known})
        for key in ("response_length", "prompt_length", "n", "max_num_seqs"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"actor_rollout_ref.rollout.{key}={getattr(self, key)} must be a positive integer")

    @classmethod
    def from_any(cls, config) -> HFRolloutConfig:
        """Accepts this dataclass, any dataclass, a dict or an OmegaConf DictConfig."""
        if isinstance(config, cls):
            return config
        if config is None:
            return cls()
        if dataclasses.is_dataclass(config):
            config = dataclasses.asdict(config)
        elif not isinstance(config, Mapping):  # OmegaConf DictConfig
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(config, resolve=True)
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in dict(config).items() if k in known and v is not None}
        if isinstance(values.get("val_kwargs"), Mapping) or dataclasses.is_dataclass(values.get("val_kwargs")):
            vk = values["val_kwargs"]
            values["val_kwargs"] = dict(vk) if isinstance(vk, Mapping) else dataclasses.asdict(vk)
        return cls(**values)


def _first_set(*values):
    return next((v for v in values if v is not None), None)


class HFRollout(BaseRollout):
    """The built-in engine behind the `BaseRollout` interface.

    model_path_or_module: an HF checkpoint directory or a transformers causal LM (whose current
        weights are copied; the engine always owns its weight copy, refreshed by update_weights).
    config: the rollout config (dict, DictConfig or dataclass; see `HFRolloutConfig`).
    tokenizer: optional; supplies eos/pad ids when meta_info does not carry them.
    """

    def __init__(self, model_path_or_module, config=None, tokenizer=None, device=None):
        from verl.workers.rollout.native.engine import GenerationEngine

        self.config = HFRolloutConfig.from_any(config)
        self.tokenizer = tokenizer
        device = torch.device(device) if device is not None else get_device()
        self.engine = GenerationEngine.from_model(
            model_path_or_module,
            device=device,
            dtype=self.config.dtype,
            use_cuda_graph=None if not self.config.enforce_eager else False,
        )
        hf_config = self._hf_config(model_path_or_module)
        self._default_eos = _first_set(
            getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None)
        )
        self._default_pad = _first_set(
            getattr(tokenizer, "pad_token_id", None), getattr(hf_config, "pad_token_id", None)
        )

    @staticmethod
    def _hf_config(model_path_or_module):
        if hasattr(model_path_or_module, "config"):
            return model_path_or_module.config
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path_or_module)

    # ----------------------------------------------------------------------------------- engine
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        return self.engine.update_weights(named_tensors)

    def sleep(self, level: int = 2) -> None:
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def release(self) -> None:
        self.engine.sleep(2)

    # ------------------------------------------------------------------------------- generation
    def _sampling_and_n(self, meta: dict, prompts) -> tuple[SamplingParams, int]:
        return resolve_sampling(self.config, meta, prompts)

    def _token_ids(self, meta: dict) -> tuple[list[int], int]:
        return resolve_token_ids(meta, self._default_eos, self._default_pad)

    @torch.no_grad()
    def generate_sequences(self, prompts):
        from tensordict import TensorDict

        from verl.protocol import DataProto

        start = time.perf_counter()
        meta = dict(prompts.meta_info)
        sampling, n = self._sampling_and_n(meta, prompts)
        if n > 1:
            prompts = prompts.repeat(repeat_times=n, interleave=True)
        eos_ids, pad = self._token_ids(meta)
        if self.config.ignore_eos:  # no row stops early: every response is response_length tokens long
            eos_ids = []
        response_length = int(meta.get("response_length", self.config.response_length))

        input_ids = prompts.batch["input_ids"]
        attention_mask = prompts.batch["attention_mask"]
        position_ids = prompts.batch.get("position_ids", None)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if position_ids.dim() != 2:
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)}: the built-in rollout supports 1-D rotary "
                "positions [batch, prompt_len] only (no multimodal rope)"
            )
        out_device = input_ids.device

        parts = []
        chunk = self.config.max_num_seqs
        for lo in range(0, input_ids.shape[0], chunk):
            parts.append(
                self.engine.generate(
                    input_ids[lo : lo + chunk],
                    attention_mask[lo : lo + chunk],
                    response_length,
                    sampling,
                    eos_token_id=eos_ids,
                    pad_token_id=pad,
                    position_ids=position_ids[lo : lo + chunk],
                    return_logprobs=self.config.calculate_log_probs,
                )
            )
        responses = torch.cat([p.responses for p in parts]).to(out_device)
        response_mask = torch.cat([p.response_mask for p in parts]).to(out_device, attention_mask.dtype)

        delta = torch.arange(1, response_length + 1, device=out_device, dtype=position_ids.dtype)
        tensors = {
            "prompts": input_ids,
            "responses": responses,
            "input_ids": torch.cat([input_ids, responses], dim=-1),
            "attention_mask": torch.cat([attention_mask, response_mask], dim=-1),
            "position_ids": torch.cat([position_ids, position_ids[:, -1:] + delta], dim=-1),
            "response_mask": response_mask,
        }
        if self.config.calculate_log_probs:
            tensors["rollout_log_probs"] = torch.cat([p.logprobs for p in parts]).to(out_device)

        timing = dict(meta.get("timing", {}))
        timing["generate_sequences"] = time.perf_counter() - start
        meta["timing"] = timing
        batch = TensorDict(tensors, batch_size=[input_ids.shape[0]])
        return DataProto(batch=batch, non_tensor_batch=dict(prompts.non_tensor_batch), meta_info=meta)
