"""The built-in generation engine: a batched sampling loop over a static-cache decoder.

`GenerationEngine.generate` is the tensor-level core (no DataProto): left-padded prompts in,
right-padded responses, their mask and optional log-probs out. Per token the host does only
launch work: select tokens (on device), write one column of each output buffer, update the
finished flags, and run the decoder (a CUDA-graph replay on GPU). The only host sync is a cheap
"how many rows are still generating?" check every `stop_check_interval` steps (each step on CPU,
where it costs nothing; every 16 on GPU, where each check drains the launch queue).

Work the batch does not need is skipped, which is where the RL workload's time goes (the GRPO
arithmetic task: every prompt sampled n times, most answers done after 3 of 8 tokens):
- Columns that are padding in every row are dropped before anything runs (`drop_leading_padding`):
  prompts padded to `data.max_prompt_length` would otherwise be prefilled, cached and read by
  every decode step in full (the bundled task: ~17 real of 32 columns).
- Repeated prompts are prefilled once: rows with identical (prompt, mask, positions) share one
  prefill, whose cache columns are then copied to every row that repeats it (`_prefill`).
- Finished rows leave the batch: at a check, once an eighth of the active rows have emitted EOS
  (with CUDA graphs: once the rest fits a smaller batch bucket), the live rows' cache rows are
  gathered to the front (`decoder.select_rows`) and later steps compute only those; a slot -> row
  map writes their tokens to the right output rows. Until then finished rows keep decoding and
  their extra tokens are masked to pad at the end, so no step branches per row.

Memory budget (`gpu_memory_utilization`, upstream's key, with vLLM's meaning): the engine's own
footprint (its weights, KV cache and working memory) stays within `gpu_memory_utilization` x the
device's total memory, and what it allocates must also be free right now (driver-free memory plus
what torch's allocator caches unused). The KV cache is sized from that: rows that fit =
(min(util x total - weights, free) - prefill working memory) // (one row's KV cache at this call's
length + its decode working memory), see `kv_cache_rows`. A batch with more rows than fit is
generated in several chunks of rows, one after the other, with the same outputs (greedy) as one
pass. The cache grows only (to cover both the old and the new shape when that fits), so calls of
alternating shapes do not reallocate it, and with it recapture the CUDA graphs, every time.
`kv_cache_bytes` fixes the KV budget instead (any device; CPU otherwise has no budget).

Weight sync and memory (the hybrid engine's contract, shared with the vLLM/SGLang adapters):
- `update_weights(named_tensors)` copies HF-named tensors into the decoder's buffers in place, as
  they arrive (one FSDP-gathered tensor at a time is fine), and reports `timing_s/update_weights`;
- `sleep(level=2)` frees the KV cache and the weight copy (level 1 frees only the KV cache);
- `wake_up()` re-allocates the weight buffers; the KV cache is allocated lazily by the next
  `generate`, so waking, syncing and dropping the trainer's gathered copies never holds weights,
  gathered weights and a KV cache at once.
Generating while asleep, or after a level-2 wake-up before every weight was synced again, is an
error that says which call is missing.

Quantised weights (`quantization="fp8"`, upstream's `rollout.quantization`): the native decoder
keeps its decoder layers' linear weights in fp8 with 128 x 128 block scales (`native.fp8`); every
weight load and sync quantises as it copies, so the engine never holds a full-precision copy of them.

Routing records (`record_routing=True`, for MoE router replay R3, `verl.models.mcore.router_replay`):
forward hooks on the model's routers (`verl.models.moe.RoutingRecorder`) read each forward's top-k
expert ids: the prefill's for the prompt columns (fanned out to the rows that repeat a prompt) and
each decode step's for the token it feeds. Every sampled token must pass through a forward to have
a routing, so a recording call keeps finished rows in the batch (no compaction: the token after
EOS is fed like any other and masked out) and runs one extra decode step for the last sampled
column. Without the flag nothing is hooked and nothing changes. The generic HF path only: the
native decoder runs dense models.

Vision-language models (Qwen2.5-VL; the generic HF path, the native decoder refuses them):
`generate(..., multi_modal_inputs=[...])` takes one dict per row (`pixel_values`, `image_grid_thw`,
the processor's output for that row's images; None or {} for a text-only row) and position ids of
shape [B, 4, P] (upstream verl's layout: the text positions, then M-RoPE's time/height/width rows;
`verl.utils.vision.vl_position_ids`, computed here when none are given). The prefill runs the
model's vision tower on the images of the rows it prefills; every decode step feeds one text token,
whose four position rows each continue the row's last prompt position by one per token (the text
rule of M-RoPE: transformers' generate adds the same `rope_deltas` to all three rows). The images
matter only to the prefill, so every later transformation of the batch works on cache rows as for a
text model: compaction of finished rows, the fan-out of repeated prompts (rows repeat a prompt only
when their images are equal too: the prefill key carries a fingerprint of each row's pixels), chunks
of rows (each chunk carries its rows' images), pausing (the caller re-prefills with the images).
CUDA graphs and fp8 need the native decoder and are refused for these models with the reason.

Expert parallelism (`expert_parallel=(group, rank, size)`, `rollout.expert_parallel_size`): the
routed experts are split over the group (`native.expert_parallel`) and every MoE layer exchanges
tokens over it, so the group's ranks must run the same forwards: the stop check asks the group how
many rows are still generating (one all-reduce per check) and stops when none are anywhere; a rank
whose own rows are all done keeps decoding them (masked out at the end), never compacting to zero
rows. Pausing (partial rollouts) is refused with it. The generic HF path only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl.models.moe import RoutingRecorder
from verl.utils.device import device_context, empty_cache, free_memory_bytes, get_device, synchronize
from verl.utils.vision import is_vision_language_config, vl_position_ids
from verl.workers.rollout.engine_io import image_grids
from verl.workers.rollout.native.cuda_graph import BATCH_BUCKETS, DecodeGraphRunner
from verl.workers.rollout.native.hf_decoder import HFModelDecoder
from verl.workers.rollout.native.llama_decoder import (
    DEFAULT_PREFILL_TOKENS,
    LlamaDecoder,
    spec_from_hf_config,
    unsupported_reason,
)
from verl.workers.rollout.native.vision_inputs import check_images, image_keys, vision_kwargs
from verl.workers.rollout.sampling import SamplingParams, select_tokens

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_DTYPES.update({"float16": torch.float16, "fp16": torch.float16, "half": torch.float16})


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """`None`/'auto' -> float32 on CPU, bfloat16 on an accelerator; names and torch dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"rollout dtype={dtype!r} is not one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


class GenerationOutput(NamedTuple):
    """responses [B, R] right-padded with pad_token_id; response_mask [B, R] (1 up to and including
    EOS); logprobs [B, R] float32 (0 where masked) or None; paused_at: the number of response
    columns sampled before `pause()` stopped generation (columns from there on are pad, mask 0),
    None when it ran to the end; routed_experts (`record_routing`): [B, P+R, num_moe_layers, top_k]
    expert ids over the prompt's columns (as passed in) and the response's, zeros where either mask
    is 0, else None. Unpacks as a tuple in that order."""

    responses: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor | None = None
    paused_at: int | None = None
    routed_experts: torch.Tensor | None = None


# what the estimates leave out: library workspaces (cuBLAS), the CUDA-graph pool, allocator rounding
_MARGIN_BYTES = 256 * 2**20


def kv_cache_rows(
    free_bytes: int,
    total_bytes: int,
    utilization: float,
    held_bytes: int,
    workspace_bytes: int,
    row_bytes: int,
) -> int:
    """How many sequences' KV cache the engine may allocate (0 when not even one fits).

    free_bytes: device memory this process can allocate now (driver-free plus torch-cached unused,
        plus whatever the engine is about to free, e.g. its current KV cache).
    total_bytes: the device's total memory; the engine's footprint stays within
        `utilization * total_bytes` (vLLM's `gpu_memory_utilization`).
    held_bytes: what the engine keeps besides the cache (its weights).
    workspace_bytes: transient memory the generation needs besides the rows (a prefill chunk).
    row_bytes: one row's KV cache at this length plus its per-row decode working memory.
    """
    budget = min(utilization * total_bytes - held_bytes, free_bytes) - workspace_bytes
    return max(0, int(budget // row_bytes))


def _iter_checkpoint_tensors(path: Path, num_layers: int | None = None):
    """Stream (name, tensor) pairs from a safetensors checkpoint, one tensor at a time; a model's
    multi-token-prediction layers (MiMo's `model.mtp_layers.*`) are left out: the engine has no MTP
    heads (MTP speculative decoding is refused by the config, `model.mtp.enable_rollout`). So are
    decoder layers `model.layers.<i>` past the config's `num_layers`, which `from_pretrained` ignores
    too: a config with fewer layers than the checkpoint (`model.hf_config_path`) builds the first ones."""
    import re

    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith("model.mtp_layers."):
                    continue
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if num_layers is not None and layer and int(layer.group(1)) >= num_layers:
                    continue
                yield name, f.get_tensor(name)


class GenerationEngine:
    """Static-cache generation over a `LlamaDecoder` (native) or an `HFModelDecoder` (generic)."""

    def __init__(
        self,
        decoder,
        use_cuda_graph: bool = False,
        stop_check_interval: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_bytes: int | None = None,
        expert_parallel_group=None,
    ):
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} must lie in (0, 1]: it is the fraction of the "
                "device's memory the rollout engine may use (actor_rollout_ref.rollout.gpu_memory_utilization)"
            )
        self.decoder = decoder
        self.device = decoder.device
        self.graphs = DecodeGraphRunner(decoder) if use_cuda_graph else None
        if isinstance(decoder, LlamaDecoder):
            decoder.cuda_graphs = self.graphs is not None
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_bytes = kv_cache_bytes
        # why `from_model` left the graphs off when they were left to it (reported as a speed path)
        self.cuda_graph_off_reason = ""
        if stop_check_interval is None:
            stop_check_interval = 1 if self.device.type == "cpu" else 16
        self.stop_check_interval = stop_check_interval
        self._step = torch.zeros(1, dtype=torch.long, device=self.device)
        self._asleep = False
        self._weights_released = False
        self._synced: set[str] = set(decoder.parameter_names())
        self._recorder: RoutingRecorder | None = None
        # the group whose ranks must run the same forwards (expert parallelism), else None
        self.expert_parallel_group = expert_parallel_group

    @property
    def is_native(self) -> bool:
        return isinstance(self.decoder, LlamaDecoder)

    @property
    def vision_config(self):
        """The HF config of the model when it is a vision-language model (it takes images), else None."""
        config = getattr(getattr(self.decoder, "model", None), "config", None)
        return config if config is not None and is_vision_language_config(config) else None

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_model(
        cls,
        model_path_or_module,
        device: torch.device | str | None = None,
        dtype=None,
        use_cuda_graph: bool | None = None,
        allow_native: bool = True,
        stop_check_interval: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_bytes: int | None = None,
        prefill_tokens: int | None = DEFAULT_PREFILL_TOKENS,
        expert_parallel: tuple | None = None,
        quantization: str | None = None,
    ) -> GenerationEngine:
        """Build an engine with its own copy of the weights of an HF checkpoint directory or model.

        The native decoder is used when the architecture allows it (and `allow_native`), else the
        generic HF path. CUDA graphs default to on for the native decoder on an accelerator.
        `prefill_tokens`: prompt tokens per prefill forward (whole prompts, at least one; None: all).
        `expert_parallel`: (group, rank in it, size) to split the routed experts over (module docstring).
        `quantization`: None or 'fp8' (block-wise fp8 linear weights, `native.fp8`; native decoder only).
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        device = torch.device(device) if device is not None else get_device()
        dtype = resolve_dtype(dtype, device)
        is_path = isinstance(model_path_or_module, (str, Path))
        if is_path:
            path = Path(model_path_or_module)
            if not (path / "config.json").exists():
                raise FileNotFoundError(
                    f"rollout model path {str(path)!r} has no config.json; pass an HF checkpoint directory "
                    "(actor_rollout_ref.model.path) or an HF model instance"
                )
            config = AutoConfig.from_pretrained(path)
        else:
            config = model_path_or_module.config
        reason = unsupported_reason(config) if allow_native else "native decoder disabled"
        if reason is None and expert_parallel is not None:
            reason = "expert parallelism runs on the generic path"

        if quantization is not None and reason is not None:
            raise ValueError(
                f"actor_rollout_ref.rollout.quantization={quantization!r} needs the built-in engine's native decoder, "
                f"which cannot run this model ({reason}); the generic HF path has no quantised weights: set "
                "rollout.quantization=null"
            )
        if reason is None:
            decoder = LlamaDecoder(
                spec_from_hf_config(config), device, dtype, prefill_tokens=prefill_tokens, quantization=quantization
            )
            decoder.allocate_weights()
            if not is_path:
                source = model_path_or_module.state_dict().items()
            elif list(path.glob("*.safetensors")):
                source = _iter_checkpoint_tensors(path, getattr(config.get_text_config(), "num_hidden_layers", None))
            else:
                source = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict().items()
            missing = set(decoder.parameter_names()) - decoder.load_weights(source)
            if missing:
                raise ValueError(
                    f"the checkpoint lacks {len(missing)} weights the model needs, e.g. {sorted(missing)[:3]}"
                )
        else:
            logger.info("rollout uses the generic HF decoder: %s", reason)
            auto_class = AutoModelForCausalLM
            if is_vision_language_config(config):  # AutoModelForCausalLM does not map Qwen2.5-VL
                from transformers import AutoModelForImageTextToText as auto_class
            if is_path:
                model = auto_class.from_pretrained(path, dtype=dtype)
            else:
                model = auto_class.from_config(config)
                model.load_state_dict(
                    {
                        k: v.full_tensor() if hasattr(v, "full_tensor") else v
                        for k, v in model_path_or_module.state_dict().items()
                    }
                )
            decoder = HFModelDecoder(model, device, dtype, expert_parallel=expert_parallel)

        graph_off_reason = ""
        if use_cuda_graph is None:
            use_cuda_graph = reason is None and device.type != "cpu"
            if reason is not None:
                graph_off_reason = f"they need the native decoder, which cannot run this model: {reason}"
            elif device.type == "cpu":
                graph_off_reason = "the rollout runs on CPU, where there are no CUDA graphs"
        if use_cuda_graph and reason is not None:
            raise ValueError(f"CUDA graphs need the native decoder, which cannot run this model: {reason}")
        engine = cls(
            decoder,
            use_cuda_graph=use_cuda_graph,
            stop_check_interval=stop_check_interval,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_bytes=kv_cache_bytes,
            expert_parallel_group=None if expert_parallel is None else expert_parallel[0],
        )
        engine.cuda_graph_off_reason = graph_off_reason
        return engine

    # --------------------------------------------------------------------------- weights, memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Copy HF-named tensors (streamed, any order) into the engine; returns timing metrics."""
        if self._asleep:
            raise RuntimeError("update_weights() on a sleeping rollout engine; call wake_up() first")
        start = time.perf_counter()
        self._synced |= self.decoder.load_weights(named_tensors)
        synchronize()
        return {"timing_s/update_weights": time.perf_counter() - start}

    def sleep(self, level: int = 2) -> None:
        """Free the KV cache (level 1) and also the weight copy (level 2, the default)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level} must be 1 (free the KV cache) or 2 (also free the weights)")
        if self.graphs is not None:
            self.graphs.reset()
        self.decoder.release_cache()
        if level == 2:
            self.decoder.release_weights()
            self._weights_released = True
            self._synced = set()
        self._asleep = True
        empty_cache()

    def wake_up(self) -> None:
        """Re-allocate what `sleep` freed; after a level-2 sleep the weights must be synced again."""
        if not self._asleep:
            return
        if self._weights_released:
            self.decoder.allocate_weights()
            self._weights_released = False
        self._asleep = False

    def memory_bytes(self) -> dict[str, int]:
        out = {"weights": self.decoder.weight_bytes(), "kv_cache": self.decoder.cache_bytes()}
        if self.graphs is not None:
            out["graph_buffers"] = self.graphs.static_bytes()
        return out

    def graph_stats(self) -> dict[str, float]:
        """CUDA-graph captures since the engine was built, and the seconds they took (0 without graphs)."""
        if self.graphs is None:
            return {"captures": 0, "capture_s": 0.0}
        return {"captures": self.graphs.num_captures, "capture_s": self.graphs.capture_s}

    def max_cache_rows(self, length: int, prompt_len: int, batch: int) -> int | None:
        """Rows of `length` columns the KV cache may hold for a `batch` x `prompt_len` call under the
        memory budget (module docstring); None when unbounded (CPU without `kv_cache_bytes`, or the
        generic HF path, which manages its own cache)."""
        if not self.is_native:
            return None
        decoder = self.decoder
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes // decoder.cache_row_bytes(length)
        memory = free_memory_bytes(self.device)
        if memory is None:
            return None
        free, total = memory
        reclaimable = decoder.cache_bytes() + (self.graphs.static_bytes() if self.graphs is not None else 0)
        workspace = decoder.prefill_bytes(min(batch, decoder.prefill_rows(prompt_len)), prompt_len) + _MARGIN_BYTES
        return kv_cache_rows(
            free + reclaimable,
            total,
            self.gpu_memory_utilization,
            decoder.weight_bytes(),
            workspace,
            decoder.cache_row_bytes(length) + decoder.decode_row_bytes(),
        )

    def _cache_len(self, prompt_len: int, max_new_tokens: int) -> int:
        length = prompt_len + max_new_tokens
        return self.graphs.round_len(length) if self.graphs is not None else length

    def _rows_per_chunk(self, batch: int, prompt_len: int, max_new_tokens: int) -> int:
        """Rows generated at once: the whole batch when the cache holds it or the budget allows it."""
        if not self.is_native:
            return batch
        length = self._cache_len(prompt_len, max_new_tokens)
        cap_b, cap_t = self.decoder.cache_capacity()
        if batch <= cap_b and length <= cap_t:
            return batch
        fit = self.max_cache_rows(length, prompt_len, batch)
        if fit is None:
            fit = batch
        if fit < 1:
            memory = free_memory_bytes(self.device)
            free_gib, total_gib = (m / 2**30 for m in memory) if memory else (0.0, 0.0)
            raise RuntimeError(
                f"the rollout's memory budget does not hold the KV cache of one {length}-token sequence "
                f"({self.decoder.cache_row_bytes(length) / 2**20:.1f} MiB): weights take "
                f"{self.decoder.weight_bytes() / 2**30:.2f} GiB of gpu_memory_utilization={self.gpu_memory_utilization} "
                f"x {total_gib:.1f} GiB, and {free_gib:.1f} GiB is free; raise "
                "actor_rollout_ref.rollout.gpu_memory_utilization, shorten prompt_length/response_length, "
                "or free device memory (e.g. actor param/optimizer offload)"
            )
        if self.graphs is not None:
            fit = min(fit, BATCH_BUCKETS[-1])
        return min(batch, fit)

    def _reserve(self, batch: int, prompt_len: int, max_new_tokens: int, max_position: int) -> None:
        """Make the cache hold `batch` rows for this call; it only grows (see the module docstring)."""
        length = self._cache_len(prompt_len, max_new_tokens)
        if not self.is_native:
            self.decoder.reserve(batch, length, max_position)
            return
        cap_b, cap_t = self.decoder.cache_capacity()
        rows, cols = max(batch, cap_b), max(length, cap_t)
        if (rows, cols) != (batch, length) and (batch > cap_b or length > cap_t):
            fit = self.max_cache_rows(cols, prompt_len, batch)
            if fit is not None and fit < rows:  # the union does not fit: this call's shape only
                rows, cols = batch, length
        grown = self.decoder.reserve(rows, cols, max_position)
        if grown and self.graphs is not None:
            self.graphs.reset()

    def _check_ready(self) -> None:
        if self._asleep:
            raise RuntimeError(
                "generate() on a sleeping rollout engine: its weights/KV cache are freed; call wake_up() "
                "(and update_weights(...) after a level-2 sleep) before generating"
            )
        missing = set(self.decoder.parameter_names()) - self._synced
        if missing:
            raise RuntimeError(
                f"{len(missing)} of the rollout's weights were not synced since wake_up(), e.g. "
                f"{sorted(missing)[:3]}; call update_weights() with the full model state before generating"
            )

    def routing_recorder(self) -> RoutingRecorder:
        """The recorder of the model's routers (built once); refuses a model without MoE layers."""
        if self._recorder is None:
            if self.is_native:  # the native decoder runs dense models only
                raise ValueError(
                    "the rollout model has no mixture-of-experts layers, so it has no routing to record; set "
                    "actor_rollout_ref.rollout.enable_rollout_routing_replay=false"
                )
            self._recorder = RoutingRecorder(self.decoder.model)
        return self._recorder

    # -------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        pad_token_id: int = 0,
        position_ids: torch.Tensor | None = None,
        return_logprobs: bool = False,
        generator: torch.Generator | None = None,
        pause: Callable[[], bool] | None = None,
        pause_check_steps: int = 1,
        record_routing: bool = False,
        multi_modal_inputs: Sequence[Mapping | None] | None = None,
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` per left-padded prompt row of `input_ids` [B, P].

        A row stops after emitting any of `eos_token_id` (the EOS token is kept and masked 1);
        later columns hold `pad_token_id` with mask 0. `position_ids` default to the running count
        of attended prompt tokens (what the trainer uses); responses continue from the last one.

        `pause` (partial rollouts) is asked every `pause_check_steps` sampled columns; when it says
        True the whole batch stops there and `paused_at` tells how many columns were sampled. The
        caller resumes by generating again from prompt + partial response: the KV cache is not kept,
        since after a weight update it would hold the old weights' keys and values.

        `record_routing` returns each token's MoE routing as `routed_experts` (module docstring).

        `multi_modal_inputs` (vision-language models): one dict per row with the row's `pixel_values`
        and `image_grid_thw` (None or {} for a text-only row); `position_ids` are then [B, 4, P]
        (module docstring; computed with `vl_position_ids` when None).
        """
        self._check_ready()
        if pause is not None and self.expert_parallel_group is not None:
            raise NotImplementedError(
                "partial rollouts with actor_rollout_ref.rollout.expert_parallel_size > 1: a pause is decided per "
                "rank, but the ranks of an expert-parallel group must run the same forwards; turn partial "
                "rollouts off or set expert_parallel_size=1"
            )
        recorder = self.routing_recorder() if record_routing else None
        sampling = sampling or SamplingParams()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1 (rollout.response_length)")
        dev = self.device
        input_ids = input_ids.to(dev)
        attention_mask = attention_mask.to(dev)
        images = check_images(self.vision_config, input_ids.shape[0], position_ids, multi_modal_inputs)
        if position_ids is None and self.vision_config is not None:
            position_ids = vl_position_ids(
                self.vision_config, input_ids.cpu(), attention_mask.cpu(), image_grids(images)
            )
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        position_ids = position_ids.to(dev)
        full_prompt_len = input_ids.shape[1]
        input_ids, attention_mask, position_ids = drop_leading_padding(input_ids, attention_mask, position_ids)
        B, P = input_ids.shape
        R = max_new_tokens
        args = (sampling, eos_token_id, pad_token_id, return_logprobs, generator)
        if recorder is not None:
            with device_context(dev), recorder:
                out = self._generate_rows(
                    input_ids, attention_mask, position_ids, R, *args, pause, pause_check_steps, recorder, images
                )
            routing = F.pad(out.routed_experts, (0, 0, 0, 0, full_prompt_len - P, 0))  # the dropped columns
            return out._replace(routed_experts=routing)
        # the engine's device is current for everything below (graph capture, streams, kernels),
        # whichever device the calling thread has current
        with device_context(dev):
            chunk = self._rows_per_chunk(B, P, R)
            if chunk >= B:
                return self._generate_rows(
                    input_ids, attention_mask, position_ids, R, *args, pause, pause_check_steps, None, images
                )
            # Rows beyond the memory budget: chunk after chunk. A pause in one chunk ends the batch
            # at that column: later chunks generate only that far, earlier ones are cut there.
            parts, paused_at = [], None
            for lo in range(0, B, chunk):
                rows = slice(lo, lo + chunk)
                out = self._generate_rows(
                    input_ids[rows],
                    attention_mask[rows],
                    position_ids[rows],
                    R if paused_at is None else paused_at,
                    *args,
                    pause if paused_at is None else None,
                    pause_check_steps,
                    None,
                    None if images is None else images[rows],
                )
                paused_at = paused_at if paused_at is not None else out.paused_at
                parts.append(out)
            return _concat_outputs(parts, R, pad_token_id, paused_at)

    def _generate_rows(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_token_id,
        pad_token_id: int,
        return_logprobs: bool,
        generator: torch.Generator | None,
        pause: Callable[[], bool] | None,
        pause_check_steps: int,
        recorder: RoutingRecorder | None = None,
        images: list[Mapping | None] | None = None,
    ) -> GenerationOutput:
        """`generate` for rows whose KV cache fits at once (inputs already on the device); with a
        `recorder` (inside its `with`) the routing of every fed token too; `images`: the rows'
        multi-modal inputs (see `generate`)."""
        dev = self.device
        B, P = input_ids.shape
        R = max_new_tokens
        self._reserve(B, P, R, int(position_ids.max()) + R + 1)

        eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        eos = torch.tensor(eos_ids, dtype=torch.long, device=dev) if eos_ids else None
        responses = torch.full((B, R), pad_token_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros((B, R), dtype=torch.float32, device=dev) if return_logprobs else None
        # [B, R] or, M-RoPE, [B, 4, R]: every position row continues by one per generated token
        positions = position_ids[..., -1:] + torch.arange(1, R + 1, device=dev)

        logits, fan_out = self._prefill(input_ids, attention_mask, position_ids, images)
        routing = None
        if recorder is not None:
            prompt_routing = recorder.take()
            prompt_routing = prompt_routing.view(-1, P, *prompt_routing.shape[1:])
            routing = torch.zeros((B, P + R, *prompt_routing.shape[2:]), dtype=recorder.dtype, device=dev)
            routing[:, :P] = prompt_routing if fan_out is None else prompt_routing[fan_out]
        # Active rows occupy decoder slots [0, live); `rows` maps slot -> output row once finished
        # rows have been dropped (None while slot i is row i).
        rows, live = None, B
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        paused_at = None
        for i in range(R):
            tokens, token_logprobs = select_tokens(logits, sampling, return_logprobs, generator)
            if rows is None:
                responses[:, i] = tokens
                if logprobs is not None:
                    logprobs[:, i] = token_logprobs
            else:
                responses[rows, i] = tokens
                if logprobs is not None:
                    logprobs[rows, i] = token_logprobs
            if i == R - 1:
                break
            if eos is not None:
                finished |= (tokens[:, None] == eos).any(-1)  # not isin: it may sync on some devices
                if (i + 1) % self.stop_check_interval == 0:
                    remaining = live - int(finished.sum())
                    if self._group_sum(remaining) == 0:
                        break
                    if recorder is None and remaining > 0 and self._worth_compacting(remaining, live):
                        keep = (~finished).nonzero().squeeze(1)
                        self.decoder.select_rows(keep, P + i)
                        rows = keep if rows is None else rows[keep]
                        tokens, positions = tokens[keep], positions[keep]
                        finished = torch.zeros(remaining, dtype=torch.bool, device=dev)
                        live = remaining
            if pause is not None and (i + 1) % pause_check_steps == 0 and pause():
                paused_at = i + 1
                break
            logits = self._decode(tokens, positions[..., i], P + i)
            if routing is not None:
                routing[:, P + i] = recorder.take()
        if routing is not None:  # the last sampled token has not been fed yet: one more step routes it
            self._decode(tokens, positions[..., i], P + i)
            routing[:, P + i] = recorder.take()

        # 1 up to and including each row's first EOS; unsampled columns (early stop) are pad already
        if eos is None:
            response_mask = torch.ones((B, R), dtype=attention_mask.dtype, device=dev)
        else:
            is_eos = (responses[..., None] == eos).any(-1).to(attention_mask.dtype)
            response_mask = ((is_eos.cumsum(-1) - is_eos) == 0).to(attention_mask.dtype)
            responses.masked_fill_(response_mask == 0, pad_token_id)
        if paused_at is not None:
            response_mask[:, paused_at:] = 0
        if logprobs is not None:
            logprobs.masked_fill_(response_mask == 0, 0.0)
        if routing is not None:
            routing.masked_fill_(torch.cat([attention_mask, response_mask], dim=1)[..., None, None] == 0, 0)
        return GenerationOutput(responses, response_mask, logprobs, paused_at, routing)

    def _prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        images: list[Mapping | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill each distinct prompt once; its keys/values are written to every row that repeats it.
        Returns the last position's logits of every row and the row -> prefilled prompt map (None when
        every row was prefilled as itself).

        GRPO-style batches repeat every prompt `n` times; their prefill is the same computation, and
        writing `P` cache columns per row costs far less than recomputing them. With images, rows
        repeat a prompt only when their images are equal too (`vision_inputs.image_keys`).
        """
        B = input_ids.shape[0]
        mask = attention_mask.to(input_ids.dtype)
        parts = [input_ids * mask, mask, position_ids.reshape(B, -1).to(input_ids.dtype)]
        if images is not None:
            parts.append(image_keys(images).to(input_ids.device, input_ids.dtype)[:, None])
        key = torch.cat(parts, dim=1)
        distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
        if distinct.shape[0] == B:
            return self.decoder.prefill(input_ids, attention_mask, position_ids, **vision_kwargs(images, None)), None
        # any row of each distinct prompt represents it: take the first
        first = torch.full((distinct.shape[0],), B, dtype=torch.long, device=input_ids.device)
        first.scatter_reduce_(0, inverse, torch.arange(B, device=input_ids.device), reduce="amin")
        # Number the distinct prompts by first appearance (`unique` sorts them by content): a batch
        # repeated with interleave, as GRPO's `repeat(n, interleave=True)` makes it, then maps rows to
        # prompts [0]*n + [1]*n + ..., which the decoder fans out with one broadcast copy per layer.
        by_appearance = torch.argsort(first)
        renumber = torch.empty_like(by_appearance)
        renumber[by_appearance] = torch.arange(by_appearance.shape[0], device=input_ids.device)
        first, inverse = first[by_appearance], renumber[inverse]
        logits = self.decoder.prefill(
            input_ids[first],
            attention_mask[first],
            position_ids[first],
            rows=inverse,
            **vision_kwargs(images, first.tolist()),
        )
        return logits[inverse], inverse

    def _group_sum(self, count: int) -> int:
        """`count` summed over the expert-parallel group (itself without one)."""
        if self.expert_parallel_group is None:
            return count
        total = torch.tensor([count], dtype=torch.long, device=self.device)
        dist.all_reduce(total, group=self.expert_parallel_group)
        return int(total)

    def _worth_compacting(self, remaining: int, live: int) -> bool:
        """Drop finished rows once they are an eighth of the batch (CUDA graphs: once the batch fits a
        smaller graph bucket). A compaction copies the live rows' cache columns once, about what
        one decode step reads; each later step then computes `remaining` rows instead of `live`."""
        if self.graphs is not None:
            return self.graphs.graph_batch(remaining) < self.graphs.graph_batch(live)
        return remaining * 8 <= live * 7

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs.run(tokens, positions, column, column + 1)
        self._step.fill_(column)
        return self.decoder.decode_step(tokens, positions, self._step, column + 1)


def drop_leading_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The left-padded prompts [B, P] without their leading columns that are padding in every row.

    A batch padded to `data.max_prompt_length` carries columns no row attends to (the bundled task:
    prompts of 14-17 tokens padded to 32). Every one of them would be prefilled, held in the KV
    cache and read, masked, by every decode step. Dropping them changes no token's result: a
    masked key's softmax weight is exactly 0 and positions come from `position_ids`, not from the
    column index. One host sync per call, on the mask only."""
    if input_ids.shape[1] == 0:
        return input_ids, attention_mask, position_ids
    # the first attended column (argmax returns the first maximum; 0 when no column is attended)
    start = int(attention_mask.bool().any(0).int().argmax())
    if start == 0:
        return input_ids, attention_mask, position_ids
    return input_ids[:, start:], attention_mask[:, start:], position_ids[..., start:]


def _concat_outputs(parts: list[GenerationOutput], width: int, pad_token_id: int, paused_at: int | None):
    """One `GenerationOutput` from row chunks generated one after the other (see `generate`)."""

    def widen(t: torch.Tensor, fill) -> torch.Tensor:
        return t if t.shape[1] == width else F.pad(t, (0, width - t.shape[1]), value=fill)

    responses = torch.cat([widen(p.responses, pad_token_id) for p in parts])
    response_mask = torch.cat([widen(p.response_mask, 0) for p in parts])
    logprobs = None if parts[0].logprobs is None else torch.cat([widen(p.logprobs, 0.0) for p in parts])
    if paused_at is not None:
        responses[:, paused_at:] = pad_token_id
        response_mask[:, paused_at:] = 0
        if logprobs is not None:
            logprobs[:, paused_at:] = 0.0
    return GenerationOutput(responses, response_mask, logprobs, paused_at)
