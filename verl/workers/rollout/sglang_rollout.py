"""`SGLangRollout`: SGLang's offline `Engine` as the rollout (`actor_rollout_ref.rollout.name=sglang`).

Written against SGLang's documented offline Engine API; SGLang cannot be installed on the CPU
machines this project is tested on, so the engine calls themselves are UNTESTED here (docs/
rollout_backends.md lists exactly what is). What does not need the engine is unit-tested: the
constructor arguments, the sampling-parameter dicts, the weight-name mapping and the parsing of
SGLang's outputs into responses and log-probs.

Engine calls used (all on `sglang.Engine`):
- `Engine(model_path=..., tp_size=..., mem_fraction_static=..., enable_memory_saver=True,
  skip_tokenizer_init=True, ...)`: token ids in and out, no detokenisation;
- `generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=True)`: a list of
  dicts, each with `output_ids` and `meta_info["output_token_logprobs"]` = [(logprob, token_id,
  text), ...];
- `update_weights_from_tensor(named_tensors=[(name, tensor), ...], flush_cache=...)`: HF-named
  tensors, loaded by SGLang's own per-model `load_weights` (which fuses q/k/v and gate/up);
- `release_memory_occupation(tags=[...])` / `resume_memory_occupation(tags=[...])` with tags
  `kv_cache` and `weights`: the hybrid engine's sleep and wake-up (needs enable_memory_saver).

Design decisions:
- Weights are streamed in buckets of `checkpoint_engine.update_weights_bucket_megabytes` so peak extra memory is one
  bucket, and the cache is flushed once, with the last bucket.
- sleep() releases both the KV cache and the weights (the trainer re-sends the weights after
  every update anyway); wake_up() resumes the weights first, and the KV cache only after the sync
  (`resume_kv_cache`, called by the first generate), so the weight update never competes with a
  re-allocated KV cache for memory, as upstream verl does it.
- One engine per worker (tensor_model_parallel_size=1). SGLang's tensor parallelism spawns its own
  processes on several devices, which a one-device Ray worker cannot host; a larger size is refused
  with an explanation instead of failing deep inside SGLang.
- A vision-language model (Qwen2.5-VL) is refused when the rollout is built: passing SGLang the
  images is not written here, since it could not be tested; rollout.name=hf or vllm generate with
  images (docs/multimodal_rollout.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import is_cuda_available
from verl.workers.config import RolloutConfig
from verl.workers.rollout.engine_io import EngineResponse, hf_weight_name
from verl.workers.rollout.external_engine import (
    ExternalEngineRollout,
    engine_specific_kwargs,
    max_model_len,
    weights_from_trainer,
)
from verl.workers.rollout.sampling import SamplingParams


def sglang_engine_kwargs(model_path: str, config: RolloutConfig, seed: int = 0) -> dict:
    """Keyword arguments of `sglang.Engine(...)` for a rollout config."""
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if is_cuda_available() else "float32"
    kwargs = dict(
        model_path=model_path,
        dtype=dtype,
        tp_size=int(config.tensor_model_parallel_size),
        mem_fraction_static=float(config.gpu_memory_utilization),
        max_running_requests=int(config.max_num_seqs),
        chunked_prefill_size=int(config.max_num_batched_tokens) if config.enable_chunked_prefill else -1,
        context_length=max_model_len(config),
        disable_cuda_graph=bool(config.enforce_eager),
        enable_memory_saver=bool(config.free_cache_engine),
        skip_tokenizer_init=True,
        load_format="dummy" if weights_from_trainer(config) else config.load_format,
        random_seed=int(seed),
        log_level="error",
    )
    kwargs.update(engine_specific_kwargs(config, "sglang"))
    return kwargs


def sglang_sampling_params(
    sampling: SamplingParams, max_new_tokens: int, stop_token_ids: Sequence[int], ignore_eos: bool = False
) -> dict:
    """SGLang's per-request `sampling_params` dict (greedy is temperature 0; top_k -1 is off)."""
    params = {
        "max_new_tokens": int(max_new_tokens),
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": bool(ignore_eos),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.do_sample:
        params.update(
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k) if sampling.top_k > 0 else -1,
        )
    else:
        params.update(temperature=0.0, top_p=1.0, top_k=-1)
    return params


def parse_sglang_output(output: dict, with_logprobs: bool) -> EngineResponse:
    """One `Engine.generate` result -> token ids (+ log-probs of the sampled tokens)."""
    token_ids = list(output["output_ids"])
    logprobs = None
    if with_logprobs:
        entries = output.get("meta_info", {}).get("output_token_logprobs")
        if entries is None:
            raise RuntimeError(
                "SGLang returned no meta_info.output_token_logprobs although return_logprob=True was requested"
            )
        if [int(e[1]) for e in entries] != token_ids[: len(entries)]:
            raise RuntimeError("SGLang's output_token_logprobs do not line up with its output_ids")
        logprobs = [float(e[0]) for e in entries]
    return EngineResponse(token_ids=token_ids, logprobs=logprobs)


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """Group a stream of (HF name, tensor) into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_weight_name(name), tensor))
        size += nbytes
    if bucket:
        yield bucket


class SGLangRollout(ExternalEngineRollout):
    """SGLang offline engine behind `BaseRollout` (see the module docstring for what is tested)."""

    images_unsupported_reason = (
        "SGLang's image inputs are not wired into this adapter (there is no CPU build of SGLang to test them on)"
    )

    def __init__(self, model_path: str, config=None, tokenizer=None):
        config = omega_conf_to_dataclass(config, RolloutConfig)
        if config.tensor_model_parallel_size != 1:
            raise NotImplementedError(
                f"rollout.name=sglang with tensor_model_parallel_size={config.tensor_model_parallel_size}: "
                "SGLang's tensor parallelism runs its own processes over several devices, which a one-device "
                "worker cannot host; use tensor_model_parallel_size=1 (one engine per worker) or rollout.name=vllm"
            )
        super().__init__(model_path, config, tokenizer)
        try:
            import sglang
        except ImportError as err:
            raise ImportError(
                "actor_rollout_ref.rollout.name=sglang needs the sglang package (pip install 'sglang[all]', "
                "CUDA only); use rollout.name=hf (built in) or vllm instead"
            ) from err
        import torch.distributed as dist

        seed = dist.get_rank() if dist.is_initialized() else 0
        self.engine = sglang.Engine(**sglang_engine_kwargs(model_path, self.config, seed=seed))
        self._released: set[str] = set()

    def _generate(self, prompts, sampling, max_new_tokens, stop_token_ids, with_logprobs):
        self._resume(["weights", "kv_cache"])
        params = sglang_sampling_params(sampling, max_new_tokens, stop_token_ids, self.config.ignore_eos)
        outputs = self.engine.generate(
            input_ids=prompts, sampling_params=[dict(params) for _ in prompts], return_logprob=with_logprobs
        )
        return [parse_sglang_output(out, with_logprobs) for out in outputs]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        start = time.perf_counter()
        bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        pending = None
        for bucket in bucket_named_tensors(named_tensors, bucket_bytes):
            if pending is not None:
                self.engine.update_weights_from_tensor(named_tensors=pending, flush_cache=False)
            pending = bucket
        if pending is not None:
            self.engine.update_weights_from_tensor(named_tensors=pending, flush_cache=True)
        return {"timing_s/update_weights": time.perf_counter() - start}

    def sleep(self) -> None:
        self._release(["kv_cache", "weights"])

    def wake_up(self) -> None:
        # the KV cache comes back with the first generate, after the weight sync (module docstring)
        self._resume(["weights"])

    def _release(self, tags: list[str]) -> None:
        tags = [t for t in tags if t not in self._released]
        if tags and self.config.free_cache_engine:
            self.engine.release_memory_occupation(tags=tags)
            self._released.update(tags)

    def _resume(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self._released]
        if tags:
            self.engine.resume_memory_occupation(tags=tags)
            self._released.difference_update(tags)

    def release(self) -> None:
        self.engine.shutdown()
