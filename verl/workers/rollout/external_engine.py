"""`ExternalEngineRollout`: the part of the vLLM and SGLang adapters that is not about either engine.

An adapter subclasses it and implements four engine calls: `_generate(requests)` (token lists in,
`EngineResponse`s out), `update_weights`, `sleep` and `wake_up`. This class does the rest of the
`BaseRollout` contract, identically for both engines:

1. resolve sampling and samples-per-row from config + meta_info (`engine_io.resolve_sampling`),
   repeating rows when asked;
2. strip the left padding into token lists;
3. under engine tensor parallelism, gather the token lists of the whole tensor-parallel group (see
   below), so every rank of the group submits identical requests, then keep its own rows;
4. pad the responses into the batch layout (`engine_io.assemble_output`), with
   `rollout_log_probs` when `calculate_log_probs` is on.

Partial rollouts (asynchronous training, `meta_info["partial_rollout"]`, the built-in engine's
contract in hf_rollout): an adapter that can stop its engine between two scheduler steps implements
`_generate_partial`; the rollout worker sets `weight_refresh`, and every `partial_rollout_check_steps`
engine steps the adapter asks it whether newer weights wait. If so, the unfinished requests are
aborted, the weights loaded, and those requests re-submitted as prompt + the tokens they have so
far, with the remaining token budget. Under engine tensor parallelism the ranks of a group agree on
each check (a max all-reduce), so they pause at the same step. The output then carries per-row
`weight_version` / `weight_version_max`: the oldest and newest version that sampled a token of the
row. vLLM implements it (vllm_rollout); SGLang does not (a config error).

Tensor parallelism (`rollout.tensor_model_parallel_size = tp > 1`). The trainer's data-parallel
dispatch hands each worker its own slice of prompts; an engine sharded over `tp` workers needs all
of them to run the same requests. Rather than teach the dispatcher about engine layouts (which
would leak the backend into the trainer), the workers of one tensor-parallel group (consecutive
ranks `[k*tp, (k+1)*tp)`) all-gather their prompts, generate the concatenation, and each keeps the
rows it was given. The driver sees the usual data-parallel output.

Vision-language models (docs/multimodal_rollout.md): an adapter whose engine runs a model's image
processor itself (vLLM) sets `supports_images`; each request is then the row's ids with one
`<|image_pad|>` per image (upstream's `raw_prompt_ids`, `engine_io.image_requests`) and the row's
PIL images from `multi_modal_data`, passed to `_generate(..., images=...)`. The output's positions
are [B, 4, P+R] (`vl_position_ids` over prompt + response), and `multi_modal_inputs` (made with
the model's image processor when the batch has none) travel on to the actor. An adapter without
image support refuses a vision-language model when it is built.

Sampling parameters map one to one onto both engines: greedy is temperature 0; top_k -1 (or 0)
is off; log-probs follow `rollout.logprobs_mode` (vLLM: passed to its engine; SGLang: its only
kind, processed_logprobs, the distribution after temperature and top-k/top-p; see vllm_rollout).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from verl.utils.config import omega_conf_to_dataclass
from verl.utils.vision import is_vision_language_config
from verl.workers.config import RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.engine_io import (
    EngineResponse,
    assemble_output,
    has_images,
    image_requests,
    multi_modal_rows,
    prompt_position_ids,
    prompt_token_lists,
    resolve_sampling,
    resolve_token_ids,
)
from verl.workers.rollout.sampling import SamplingParams


def weights_from_trainer(config: RolloutConfig) -> bool:
    """Whether the engine starts with random weights that the trainer's first sync replaces
    (`load_format` dummy*, upstream's dummy_dtensor, ...): reading the checkpoint is then skipped.
    Any other load_format is the engine's own loader format."""
    return str(config.load_format).startswith("dummy")


def max_model_len(config: RolloutConfig) -> int:
    """The engine's context length (vLLM max_model_len / SGLang context_length): `max_model_len`, or
    prompt_length + response_length when it is null."""
    return int(config.max_model_len or (config.prompt_length + config.response_length))


def engine_specific_kwargs(config: RolloutConfig, engine: str) -> dict:
    """`engine_kwargs[engine]`: passed to the engine's constructor verbatim, winning over every
    argument derived from the other rollout keys."""
    extra = config.engine_kwargs.get(engine) if isinstance(config.engine_kwargs, Mapping) else None
    return dict(extra or {})


class ExternalEngineRollout(BaseRollout):
    """Shared `generate_sequences` of the adapters for engines with their own runtime (module docstring)."""

    # whether `_generate` takes `images=` (the engine processes a vision-language model's images itself)
    supports_images = False
    # why not, in the refusal of a vision-language model
    images_unsupported_reason = "this adapter does not pass images to its engine"

    def __init__(self, model_path: str, config=None, tokenizer=None):
        if not isinstance(model_path, str):
            raise TypeError(
                f"{type(self).__name__} loads the model itself and needs a checkpoint directory, got a "
                f"{type(model_path).__name__}; save the model with save_pretrained() and pass its path"
            )
        self.config = omega_conf_to_dataclass(config, RolloutConfig)
        if self.config.enable_rollout_routing_replay:
            raise NotImplementedError(
                f"actor_rollout_ref.rollout.enable_rollout_routing_replay=true with {type(self).__name__}: this engine "
                "returns no expert routing here (upstream needs patched vLLM/SGLang builds); use the built-in engine "
                "(actor_rollout_ref.rollout.name=hf), which records it, or actor_rollout_ref.actor.router_replay.mode=R2"
            )
        self.model_path = model_path
        self.tokenizer = tokenizer
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path)
        self.vision_config = hf_config if is_vision_language_config(hf_config) else None
        if self.vision_config is not None and not self.supports_images:
            raise NotImplementedError(
                f"{type(self).__name__} with the vision-language model {model_path!r}: {self.images_unsupported_reason}; "
                "use actor_rollout_ref.rollout.name=hf (or vllm), which generate with images"
            )
        self._image_processor = None
        configs = (hf_config, hf_config.get_text_config())  # a vision-language config keeps the ids in its text part
        self._default_eos = next(
            (v for v in (getattr(c, "eos_token_id", None) for c in (tokenizer, *configs)) if v is not None), None
        )
        self._default_pad = next(
            (v for v in (getattr(c, "pad_token_id", None) for c in (tokenizer, *configs)) if v is not None), None
        )
        self._tp_group, self._tp_rank, self._tp_size = _tensor_parallel_group(self.config.tensor_model_parallel_size)
        # Set by the rollout worker of asynchronous training; used when a request asks for partial rollouts.
        self.weight_refresh = None

    # ------------------------------------------------------------------------------ engine calls
    @abstractmethod
    def _generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        max_new_tokens: int,
        stop_token_ids: list[int],
        with_logprobs: bool,
    ) -> list[EngineResponse]:
        """One response per prompt, in order (the engine is free to batch and schedule them)."""

    def _generate_partial(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        max_new_tokens: int,
        stop_token_ids: list[int],
        with_logprobs: bool,
        check_steps: int,
    ) -> PartialResponses:
        """`_generate` that lets newer weights in between two engine steps (module docstring)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot pause a generation to load newer weights (partial rollouts); "
            "set async_training.partial_rollout=false, or use actor_rollout_ref.rollout.name=hf or vllm"
        )

    def _newer_weights_wait(self) -> bool:
        """The weight refresh's `pending()`, agreed by the engine's tensor-parallel group (any rank
        seeing newer weights pauses all of them: they run one schedule in lockstep)."""
        waiting = bool(self.weight_refresh.pending())
        if self._tp_size == 1:
            return waiting
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(waiting)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._tp_group)
        return bool(flag.item())

    # ------------------------------------------------------------------------------- generation
    def generate_sequences(self, prompts):
        start = time.perf_counter()
        meta = dict(prompts.meta_info)
        sampling, n = resolve_sampling(self.config, meta, prompts)
        if n > 1:
            prompts = prompts.repeat(repeat_times=n, interleave=True)
        eos_ids, pad = resolve_token_ids(meta, self._default_eos, self._default_pad)
        response_length = int(meta.get("response_length", self.config.response_length))
        if prompts.batch["input_ids"].dim() != 2:
            raise ValueError("the rollout expects input_ids of shape [batch, prompt_len]")

        position_ids, images, inputs = prompts.batch.get("position_ids", None), None, None
        if self.vision_config is not None:
            mine, mine_images = image_requests(prompts, self.vision_config.image_token_id)
            inputs = multi_modal_rows(prompts, self._run_image_processor)
            position_ids = prompt_position_ids(
                self.vision_config, prompts.batch["input_ids"], prompts.batch["attention_mask"], position_ids, inputs
            )
            if any(row is not None for row in mine_images):
                everyone_images, _ = self._gather_group_requests(mine_images)
                images = {"images": everyone_images}
        else:
            if has_images(prompts):
                raise ValueError(
                    f"the prompts carry images but the rollout model {self.model_path!r} is not a vision-language model "
                    "(its config has no vision_config); use a vision-language checkpoint or text-only data"
                )
            mine = prompt_token_lists(prompts.batch["input_ids"], prompts.batch["attention_mask"])
        everyone, lo = self._gather_group_requests(mine)
        with_logprobs = self.config.calculate_log_probs
        partial = None
        if meta.get("partial_rollout") and self.weight_refresh is not None:
            check_steps = int(meta.get("partial_rollout_check_steps", 1))
            partial = self._generate_partial(
                everyone, sampling, response_length, eos_ids, with_logprobs, check_steps, **(images or {})
            )
            responses = partial.responses
        else:
            responses = self._generate(
                everyone, sampling, response_length, eos_ids, with_logprobs=with_logprobs, **(images or {})
            )
        mine_rows = slice(lo, lo + len(mine))
        responses = responses[mine_rows]

        timing = dict(meta.get("timing", {}))
        timing["generate_sequences"] = time.perf_counter() - start
        meta["timing"] = timing
        out = assemble_output(prompts, responses, response_length, pad, eos_ids, with_logprobs, meta, position_ids)
        if inputs is not None and "multi_modal_inputs" not in out.non_tensor_batch:
            out.non_tensor_batch["multi_modal_inputs"] = np.empty(len(inputs), dtype=object)
            out.non_tensor_batch["multi_modal_inputs"][:] = inputs
        if partial is not None:
            out.non_tensor_batch["weight_version"] = np.asarray(partial.version_min[mine_rows], dtype=np.int64)
            out.non_tensor_batch["weight_version_max"] = np.asarray(partial.version_max[mine_rows], dtype=np.int64)
        return out

    def _run_image_processor(self, images=None, **kwargs):
        """The model's image processor (loaded from the model directory on first use), applied to `images`:
        the `multi_modal_inputs` of a batch that has only `multi_modal_data` (module docstring)."""
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(self.model_path)
        return self._image_processor(images=images, **kwargs)

    def _gather_group_requests(self, mine: list) -> tuple[list, int]:
        """(the requests of the whole tensor-parallel group, offset of this rank's rows in them)."""
        if self._tp_size == 1:
            return mine, 0
        import torch.distributed as dist

        gathered: list = [None] * self._tp_size
        dist.all_gather_object(gathered, mine, group=self._tp_group)
        offset = sum(len(part) for part in gathered[: self._tp_rank])
        return [request for part in gathered for request in part], offset


@dataclass
class PartialResponses:
    """What `_generate_partial` returns: one response per prompt, and per prompt the oldest and newest
    weight version that sampled any of its tokens (the version at the start when it sampled none)."""

    responses: list[EngineResponse]
    version_min: list[int]
    version_max: list[int]


def _tensor_parallel_group(tp: int):
    """(process group, rank in it, size) of this worker's engine tensor-parallel group of consecutive ranks."""
    from verl.utils.process_groups import consecutive_rank_group

    group, rank = consecutive_rank_group(tp, "rollout.tensor_model_parallel_size")
    return group, rank, int(tp)
