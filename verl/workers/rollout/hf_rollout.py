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
response length, whatever the longest response. With `enable_rollout_routing_replay` (MoE router
replay R3) also `routed_experts` [B, P+R, num_moe_layers, top_k], the experts each token was routed
to while generating (zeros where `attention_mask` is 0; see `native.engine`); partial rollouts,
which re-prefill with newer weights mid-way, do not record it (refused).

CUDA graphs are on by default on a CUDA device (`cuda_graphs_enabled`); the built-in engine's
switch is `engine_kwargs.hf.enforce_eager`, not `rollout.enforce_eager`. That top-level key is
vLLM's (and SGLang's `disable_cuda_graph`), and upstream's default for it, true, is chosen for
vLLM: graphs captured up front for every batch size cost vLLM start-up time and memory. Here
graphs are captured lazily, a few per batch shape, into one small pool, while eager decoding is
launch-bound (~700 kernel launches per step) and several times slower; reading the upstream key
would turn them off in every run that starts from upstream's YAML.

Memory: `gpu_memory_utilization` bounds the engine's footprint (weights + KV cache + working
memory) as a fraction of the device, as in vLLM; batches whose KV cache would not fit are
generated in chunks of rows (see `native.engine`). `max_num_batched_tokens` bounds the prompt
tokens of one prefill forward (whole prompts, at least one per forward).

Expert parallelism (`rollout.expert_parallel_size = ep > 1`, a mixture-of-experts model): the
workers form groups of `ep` consecutive ranks, each rank holds 1/ep of every layer's routed experts
and generates its own rows, tokens travelling to their experts' ranks and back inside each MoE
layer (`native.expert_parallel`). Every rank of a group runs as many generation chunks as the
busiest one (`max_num_seqs` rows each); the missing ones are a one-token dummy row whose output is
dropped, so the group's forwards line up. Partial rollouts are refused with it.

Vision-language models (Qwen2.5-VL; docs/multimodal_rollout.md): rows carry their images in
`non_tensor_batch["multi_modal_inputs"]` (the processor's `pixel_values`/`image_grid_thw`, what the
actor trains on; used as they are) or only `multi_modal_data["images"]` (then the model's image
processor makes those inputs here, and the output carries them as `multi_modal_inputs` for the
actor). Prompt positions are [B, 4, P] (`vl_position_ids`, computed here when the batch has none or
text positions); the output's `position_ids` are [B, 4, P+R], equal to `vl_position_ids` over
prompt + response. Chunks of rows and resumed partial rollouts carry their rows' images.

Partial rollouts (asynchronous training, `meta_info["partial_rollout"]`): the rollout worker sets
`weight_refresh`; every `partial_rollout_check_steps` decode steps the engine asks it whether newer
weights wait, and if so pauses, loads them and resumes the unfinished rows from prompt + partial
response. The KV cache is recomputed by that prefill rather than kept: keys and values of the old
weights under the new ones would be neither policy, and the rollout log-probs must be the sampling
policy's own. The output then carries per-row `weight_version` / `weight_version_max` (oldest and
newest version that sampled a token of the row).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import torch

from verl.models.moe import ROUTED_EXPERTS
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_device, is_cuda_device
from verl.utils.speed_paths import SpeedPath
from verl.workers.config import RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.engine_io import (
    multi_modal_rows,
    prompt_position_ids,
    resolve_sampling,
    resolve_token_ids,
    response_position_ids,
)
from verl.workers.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)


HF_ENGINE_KWARGS = {
    "enforce_eager": "true: decode without CUDA graphs (default false: graphs on CUDA devices)",
}


def hf_engine_kwargs(config: RolloutConfig) -> dict:
    """`engine_kwargs.hf`, the built-in engine's own arguments ({} when absent), checked against
    `HF_ENGINE_KWARGS`: a misspelled switch would otherwise be ignored without a word."""
    values = dict((config.engine_kwargs or {}).get("hf") or {})
    unknown = set(values) - set(HF_ENGINE_KWARGS)
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.hf has unknown keys {sorted(unknown)}; the built-in engine "
            f"accepts {sorted(HF_ENGINE_KWARGS)}"
        )
    return values


def cuda_graphs_enabled(config: RolloutConfig, device: torch.device) -> bool:
    """Whether the built-in engine decodes with CUDA graphs for `config` on `device`: on a CUDA
    device unless `engine_kwargs.hf.enforce_eager` is true. `rollout.enforce_eager` is vLLM's key
    and is not read (module docstring). The engine still falls back to eager decoding for models
    the native decoder does not run."""
    return is_cuda_device(device) and not bool(hf_engine_kwargs(config).get("enforce_eager", False))


class WeightRefresh(Protocol):
    """What partial rollouts need from whoever delivers new weights (the rollout worker of
    asynchronous training): the version the engine holds, whether a newer one is waiting, and a
    way to load it into the engine."""

    version: int

    def pending(self) -> bool:
        """Whether newer weights than `version` are waiting (cheap: called every few decode steps)."""
        ...

    def load(self) -> int:
        """Load the waiting weights into the engine; returns (and sets `version` to) their version."""
        ...


class _PartialOutput(NamedTuple):
    responses: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor | None
    version_min: torch.Tensor  # [B] int64, the oldest weight version that sampled a token of the row
    version_max: torch.Tensor  # [B] int64, the newest


def _first_set(*values):
    return next((v for v in values if v is not None), None)


class HFRollout(BaseRollout):
    """The built-in engine behind the `BaseRollout` interface.

    model_path_or_module: an HF checkpoint directory or a transformers causal LM (whose current
        weights are copied; the engine always owns its weight copy, refreshed by update_weights).
    config: the rollout config, a `RolloutConfig` (a DictConfig or dict section is built into one, its
        missing keys taking the class's defaults, which are the YAML's; None: all defaults).
    tokenizer: optional; supplies eos/pad ids when meta_info does not carry them.
    """

    def __init__(self, model_path_or_module, config=None, tokenizer=None, device=None):
        from verl.workers.rollout.native.engine import GenerationEngine

        self.config = omega_conf_to_dataclass(config, RolloutConfig)
        hf_engine_kwargs(self.config)  # refuse unknown engine_kwargs.hf keys before building the engine
        self.tokenizer = tokenizer
        device = torch.device(device) if device is not None else get_device()
        expert_parallel = None
        if self.config.expert_parallel_size > 1:
            from verl.workers.rollout.native.expert_parallel import expert_parallel_group

            ep = int(self.config.expert_parallel_size)
            expert_parallel = (*expert_parallel_group(ep), ep)
        self.expert_parallel_group = None if expert_parallel is None else expert_parallel[0]
        self.engine = GenerationEngine.from_model(
            model_path_or_module,
            device=device,
            dtype=self.config.dtype,
            # None: graphs whenever the native decoder runs the model (the generic path cannot)
            use_cuda_graph=None if cuda_graphs_enabled(self.config, device) else False,
            gpu_memory_utilization=float(self.config.gpu_memory_utilization),
            prefill_tokens=int(self.config.max_num_batched_tokens),
            expert_parallel=expert_parallel,
            quantization=self.config.quantization,
        )
        if self.config.full_determinism:  # rollout.full_determinism: deterministic kernels, seeded streams
            from verl.utils.device import enable_full_determinism

            # seed + rank, as upstream seeds each vLLM replica (replica_rank + seed): replicas given copies of one
            # prompt must not draw alike
            enable_full_determinism(int(self.config.seed) + _replica_rank())
        # sampling draws from the worker's per-rank stream, which checkpoints save (verl.workers.group_setup)
        # Set by the rollout worker of asynchronous training; used when a request asks for partial rollouts.
        self.weight_refresh: WeightRefresh | None = None
        self._model_path = model_path_or_module if isinstance(model_path_or_module, (str, os.PathLike)) else None
        self._image_processor = None  # loaded from the model directory when first needed
        hf_config = self._hf_config(model_path_or_module)
        text_config = hf_config.get_text_config()  # a vision-language config keeps the ids in its text part
        self._default_eos = _first_set(
            getattr(tokenizer, "eos_token_id", None),
            getattr(hf_config, "eos_token_id", None),
            getattr(text_config, "eos_token_id", None),
        )
        self._default_pad = _first_set(
            getattr(tokenizer, "pad_token_id", None),
            getattr(hf_config, "pad_token_id", None),
            getattr(text_config, "pad_token_id", None),
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

    def speed_paths(self) -> list[SpeedPath]:
        """CUDA graphs of the decode step: asked for on a CUDA device unless `engine_kwargs.hf.enforce_eager`
        (see `cuda_graphs_enabled`); another device has none to ask for."""
        device = self.engine.device
        if not is_cuda_device(device):
            return [
                SpeedPath("cuda_graphs", False, False, f"the rollout runs on {device.type}, which has no CUDA graphs")
            ]
        requested = not bool(hf_engine_kwargs(self.config).get("enforce_eager", False))
        active = self.engine.graphs is not None
        reason = self.engine.cuda_graph_off_reason if requested and not active else ""
        return [SpeedPath("cuda_graphs", requested, active, reason)]

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
        graphs_before = self.engine.graph_stats()
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
        processed_here = "multi_modal_inputs" not in prompts.non_tensor_batch
        vision = self.engine.vision_config is not None
        images = multi_modal_rows(prompts, self._load_image_processor if vision else None)
        position_ids = prompt_position_ids(self.engine.vision_config, input_ids, attention_mask, position_ids, images)
        out_device = input_ids.device
        refresh = self.weight_refresh if meta.get("partial_rollout") else None
        check_steps = int(meta.get("partial_rollout_check_steps", 1))
        if refresh is not None and self.config.enable_rollout_routing_replay:
            raise NotImplementedError(
                "actor_rollout_ref.rollout.enable_rollout_routing_replay with partial rollouts: a row resumed under "
                "newer weights is re-prefilled, so its routing would come from two policies; turn partial rollouts "
                "off or use actor_rollout_ref.actor.router_replay.mode=R2"
            )

        parts = []
        chunk = self.config.max_num_seqs
        starts = list(range(0, input_ids.shape[0], chunk))
        # agreed before generating, since the group's ranks run their chunks' forwards side by side
        starts += [None] * (self._group_chunks(len(starts)) - len(starts))
        for lo in starts:
            if lo is None:
                self._generate_dummy(response_length, sampling, eos_ids, pad)
                continue
            rows = slice(lo, lo + chunk)
            args = (input_ids[rows], attention_mask[rows], position_ids[rows], response_length, sampling, eos_ids, pad)
            chunk_images = None if images is None else images[rows]
            if refresh:
                parts.append(self._generate_partial(*args, refresh, check_steps, chunk_images))
            else:
                parts.append(self._generate(*args, chunk_images))
        responses = torch.cat([p.responses for p in parts]).to(out_device)
        response_mask = torch.cat([p.response_mask for p in parts]).to(out_device, attention_mask.dtype)

        tensors = {
            "prompts": input_ids,
            "responses": responses,
            "input_ids": torch.cat([input_ids, responses], dim=-1),
            "attention_mask": torch.cat([attention_mask, response_mask], dim=-1),
            "position_ids": response_position_ids(position_ids.to(out_device), response_mask),
            "response_mask": response_mask,
        }
        if self.config.calculate_log_probs:
            tensors["rollout_log_probs"] = torch.cat([p.logprobs for p in parts]).to(out_device)
        if self.config.enable_rollout_routing_replay:
            tensors[ROUTED_EXPERTS] = torch.cat([p.routed_experts for p in parts]).to(out_device)

        timing = dict(meta.get("timing", {}))
        timing["generate_sequences"] = time.perf_counter() - start
        meta["timing"] = timing
        # CUDA-graph captures of this call: after a sleep every graph used is captured again
        graphs_after = self.engine.graph_stats()
        metrics = dict(meta.get("metrics", {}))
        metrics["rollout/cuda_graph_captures"] = graphs_after["captures"] - graphs_before["captures"]
        metrics["timing_s/cuda_graph_capture"] = graphs_after["capture_s"] - graphs_before["capture_s"]
        meta["metrics"] = metrics
        batch = TensorDict(tensors, batch_size=[input_ids.shape[0]])
        non_tensors = dict(prompts.non_tensor_batch)
        if images is not None and processed_here:  # the actor trains on the inputs the rollout generated with
            import numpy as np

            non_tensors["multi_modal_inputs"] = np.empty(len(images), dtype=object)
            non_tensors["multi_modal_inputs"][:] = images
        if refresh is not None:
            non_tensors["weight_version"] = torch.cat([p.version_min for p in parts]).numpy()
            non_tensors["weight_version_max"] = torch.cat([p.version_max for p in parts]).numpy()
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def _load_image_processor(self, images=None, **kwargs):
        """The model's image processor (loaded from the model directory on first use), applied to `images`."""
        if self._image_processor is None:
            if self._model_path is None:
                raise ValueError(
                    "the prompts carry images without multi_modal_inputs, and a rollout built from a model object has "
                    "no directory to load the image processor from; pass multi_modal_inputs or build it from a path"
                )
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(self._model_path)
        return self._image_processor(images=images, **kwargs)

    def _group_chunks(self, chunks: int) -> int:
        """The most generation chunks any rank of the expert-parallel group runs (`chunks` without one)."""
        if self.expert_parallel_group is None:
            return chunks
        import torch.distributed as dist

        most = torch.tensor([chunks], dtype=torch.long, device=self.engine.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.expert_parallel_group)
        return int(most)

    def _generate_dummy(self, response_length, sampling, eos_ids, pad) -> None:
        """One row of one pad token, generated and dropped: the forwards a chunk of the group's busier
        ranks runs (module docstring)."""
        ones = torch.ones((1, 1), dtype=torch.long)
        self._generate(ones * pad, ones, ones * 0, response_length, sampling, eos_ids, pad)

    def _generate(self, input_ids, attention_mask, position_ids, response_length, sampling, eos_ids, pad, images=None):
        return self.engine.generate(
            input_ids,
            attention_mask,
            response_length,
            sampling,
            eos_token_id=eos_ids,
            pad_token_id=pad,
            position_ids=position_ids,
            return_logprobs=self.config.calculate_log_probs,
            record_routing=bool(self.config.enable_rollout_routing_replay),
            multi_modal_inputs=images,
        )

    def _generate_partial(
        self,
        input_ids,
        attention_mask,
        position_ids,
        response_length,
        sampling,
        eos_ids,
        pad,
        refresh,
        check_steps,
        images=None,
    ) -> _PartialOutput:
        """Generation that lets newer weights in mid-way (see `WeightRefresh`).

        Every `check_steps` columns the engine asks `refresh.pending()`; when newer weights wait, it
        stops, they are loaded, and the rows without EOS yet go on from prompt + partial response,
        which is prefilled again with the new weights (an unfinished row has no padding inside its
        partial response, so the concatenation is a valid left-padded prompt). Each token's
        log-prob is thus the one of the weights that sampled it. A resumed row is prefilled with its
        images again; its response tokens are text, so their positions continue every position row.
        """
        B, R = input_ids.shape[0], response_length
        device = input_ids.device
        responses = torch.full((B, R), pad, dtype=torch.long, device=device)
        response_mask = torch.zeros((B, R), dtype=attention_mask.dtype, device=device)
        logprobs = torch.zeros((B, R), dtype=torch.float32, device=device) if self.config.calculate_log_probs else None
        version_min = torch.full((B,), refresh.version, dtype=torch.int64)
        version_max = version_min.clone()
        eos = torch.tensor(eos_ids, dtype=torch.long, device=device) if eos_ids else None
        active = torch.arange(B, device=device)  # output rows still generating
        done = 0  # response columns sampled so far by every active row
        while True:
            out = self.engine.generate(
                input_ids,
                attention_mask,
                R - done,
                sampling,
                eos_token_id=eos_ids,
                pad_token_id=pad,
                position_ids=position_ids,
                return_logprobs=logprobs is not None,
                pause=refresh.pending,
                pause_check_steps=check_steps,
                multi_modal_inputs=images,
            )
            width = R - done if out.paused_at is None else out.paused_at
            columns = slice(done, done + width)
            responses[active, columns] = out.responses[:, :width].to(device)
            response_mask[active, columns] = out.response_mask[:, :width].to(device, response_mask.dtype)
            if logprobs is not None:
                logprobs[active, columns] = out.logprobs[:, :width].to(device)
            version_max[active.cpu()] = refresh.version
            if out.paused_at is None:
                break
            refresh.load()
            new_tokens = out.responses[:, :width].to(device)
            going = (
                ~(new_tokens[..., None] == eos).any(-1).any(-1)
                if eos is not None
                else torch.ones_like(active, dtype=torch.bool)
            )
            if not going.any():
                break
            active, new_tokens = active[going], new_tokens[going]
            if images is not None:
                images = [images[i] for i in going.nonzero().squeeze(1).tolist()]
            last = position_ids[going][..., -1:]
            input_ids = torch.cat([input_ids[going], new_tokens], dim=-1)
            attention_mask = torch.cat(
                [attention_mask[going], torch.ones_like(new_tokens, dtype=attention_mask.dtype)], dim=-1
            )
            position_ids = torch.cat([position_ids[going], last + torch.arange(1, width + 1, device=device)], dim=-1)
            done += width
        return _PartialOutput(responses, response_mask, logprobs, version_min, version_max)


def _replica_rank() -> int:
    """This engine's rank among the rollout's engines: the worker's rank in its process group (0 alone)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0
