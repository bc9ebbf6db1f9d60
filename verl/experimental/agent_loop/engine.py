"""The engine side of agent loops: one async request at a time in, token ids (+ log-probs) out.

Agent loops are written as if each conversation had the engine to itself:

    out = await engine.generate(prompt_ids, sampling, max_new_tokens)   # TokenOutput

`AsyncRolloutEngine` is that interface. Engines with a native async server (vLLM's AsyncLLM,
SGLang's server) implement it directly, one request per call. Batch-synchronous engines — the
built-in `GenerationEngine`, and vLLM's offline `LLM` as the `vllm` rollout uses it — are adapted
by `MicroBatchEngine`, which collects the requests that many concurrent conversations make and runs
them as one batch:

- It waits for the first request, then keeps collecting while requests keep arriving (a new one
  within `idle_wait_s`), and launches at once when every registered conversation is waiting
  (`client()` registers one). So conversations whose tools answer quickly share a batch, and a slow
  tool (a sandbox run, a web call) holds back only its own conversation: the others generate
  without it and it joins a later batch.
- The batch runs in a dedicated thread, so the event loop keeps running tools while the engine
  generates; tool latency and generation overlap instead of adding up.
- Requests with different sampling settings go to separate batches; within a batch every request
  is generated up to the largest `max_new_tokens` and cut to its own.

`rollout_batch_generator(rollout, ...)` turns any `BaseRollout` into the batch function
`MicroBatchEngine` needs, through the rollout's public `generate_sequences` (DataProto in and out),
so the built-in `hf` engine and the `vllm`/`sglang` adapters all serve agent loops without changes
(see docs/multi_turn.md for an async-native engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenOutput:
    """One generated continuation."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    """Log-prob of each token (what `rollout.logprobs_mode` names), when the engine computed them."""
    stopped: bool = True
    """True when it ended on a stop token; False when it ran out of `max_new_tokens`."""
    version_min: int | None = None
    """With partial rollouts (asynchronous training): the oldest weight version that sampled a token
    of it; None when the engine did not say (one version for the whole call)."""
    version_max: int | None = None
    """The newest such version."""
    routed_experts: Any | None = None
    """MoE routing (router replay R3, `rollout.enable_rollout_routing_replay`): [len(prompt_ids) +
    len(token_ids), moe_layers, top_k] expert ids of every token the call's forwards saw, prompt
    first; None when the engine records none."""

    @property
    def stop_reason(self) -> str:
        """Upstream's name for why generation ended: "stop" (a stop token) or "length" (the budget)."""
        return "stop" if self.stopped else "length"


class AsyncRolloutEngine(ABC):
    """Generation for one conversation turn; safe to await from many coroutines at once."""

    @abstractmethod
    async def generate(
        self, prompt_ids: Sequence[int], sampling: Mapping[str, Any], max_new_tokens: int
    ) -> TokenOutput:
        """Continue `prompt_ids` by at most `max_new_tokens` tokens.

        `sampling` holds the rollout's sampling keys as `meta_info` carries them (`do_sample`,
        `temperature`, `top_k`, `top_p`, `validate`); an absent key means the rollout config's value.
        """

    @contextlib.asynccontextmanager
    async def client(self):
        """Scope of one conversation; batching engines use it to know how many may still ask."""
        yield self


BatchGenerateFn = Callable[[list[list[int]], Mapping[str, Any], int], list[TokenOutput]]


@dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    future: asyncio.Future


@dataclass
class BatchStats:
    """How the micro-batcher grouped the requests (for metrics)."""

    num_batches: int = 0
    num_requests: int = 0
    generate_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


class MicroBatchEngine(AsyncRolloutEngine):
    """Runs concurrent `generate` calls as batches of a synchronous batch function (module docstring).

    generate_batch: `(prompts, sampling, max_new_tokens) -> [TokenOutput per prompt]`, called in
        `executor` (one dedicated thread when None) so the event loop stays free.
    idle_wait_s: keep collecting while a new request arrives at least this often.
    max_batch_size: split larger groups (None: no limit).
    """

    def __init__(
        self,
        generate_batch: BatchGenerateFn,
        executor: Executor | None = None,
        idle_wait_s: float = 0.01,
        max_batch_size: int | None = None,
    ):
        self._generate_batch = generate_batch
        self._executor = executor
        self._own_executor = executor is None
        self.idle_wait_s = float(idle_wait_s)
        self.max_batch_size = max_batch_size
        self._pending: dict[tuple, list[_Request]] = {}
        self._sampling: dict[tuple, dict] = {}
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._num_clients = 0
        self.stats = BatchStats()

    # ------------------------------------------------------------------------------ requests
    @contextlib.asynccontextmanager
    async def client(self):
        self._num_clients += 1
        try:
            yield self
        finally:
            self._num_clients -= 1
            if self._arrived is not None:
                self._arrived.set()  # one fewer conversation to wait for

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Mapping[str, Any], max_new_tokens: int
    ) -> TokenOutput:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        loop = asyncio.get_running_loop()
        self._start(loop)
        key = tuple(sorted(sampling.items()))
        self._sampling[key] = dict(sampling)
        request = _Request(list(prompt_ids), int(max_new_tokens), loop.create_future())
        self._pending.setdefault(key, []).append(request)
        self._arrived.set()
        return await request.future

    # ------------------------------------------------------------------------------- batching
    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._worker is not None and not self._worker.done() and self._worker.get_loop() is loop:
            return
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-engine")
        self._arrived = asyncio.Event()
        self._worker = loop.create_task(self._serve())

    def _num_waiting(self) -> int:
        return sum(len(requests) for requests in self._pending.values())

    async def _collect(self) -> None:
        """Return when the pending requests should run: everyone waits, or arrivals stopped."""
        while True:
            if self._num_clients and self._num_waiting() >= self._num_clients:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), self.idle_wait_s)
            except (asyncio.TimeoutError, TimeoutError):
                return

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            if not self._pending:
                self._arrived.clear()
                continue
            await self._collect()
            pending, self._pending = self._pending, {}
            for key, requests in pending.items():
                # a cancelled conversation (e.g. cut by over-sampling) no longer needs its turn
                requests = [r for r in requests if not r.future.done()]
                if not requests:
                    continue
                size = self.max_batch_size or len(requests)
                for lo in range(0, len(requests), size):
                    await self._run_batch(loop, self._sampling[key], requests[lo : lo + size])

    async def _run_batch(self, loop, sampling: dict, requests: list[_Request]) -> None:
        max_new = max(r.max_new_tokens for r in requests)
        start = time.perf_counter()
        try:
            outputs = await loop.run_in_executor(
                self._executor, self._generate_batch, [r.prompt_ids for r in requests], sampling, max_new
            )
            if len(outputs) != len(requests):
                raise RuntimeError(f"the engine returned {len(outputs)} outputs for {len(requests)} prompts")
        except Exception as e:  # every conversation waiting on this batch sees the engine's error
            for r in requests:
                if not r.future.done():
                    r.future.set_exception(e)
            return
        self.stats.num_batches += 1
        self.stats.num_requests += len(requests)
        self.stats.batch_sizes.append(len(requests))
        self.stats.generate_s += time.perf_counter() - start
        for r, out in zip(requests, outputs):
            if not r.future.done():
                r.future.set_result(_cut(out, r.max_new_tokens))

    async def aclose(self) -> None:
        """Stop the batching task (pending requests are cancelled) and the engine thread, if owned."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        for requests in self._pending.values():
            for r in requests:
                r.future.cancel()
        self._pending = {}
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _cut(out: TokenOutput, max_new_tokens: int) -> TokenOutput:
    if len(out.token_ids) <= max_new_tokens:
        return out
    log_probs = None if out.log_probs is None else list(out.log_probs[:max_new_tokens])
    routing = out.routed_experts
    if routing is not None:  # prompt + generated tokens: drop the generated tokens cut here
        routing = routing[: len(routing) - (len(out.token_ids) - max_new_tokens)]
    return dataclasses.replace(
        out,
        token_ids=list(out.token_ids[:max_new_tokens]),
        log_probs=log_probs,
        stopped=False,
        routed_experts=routing,
    )


def rollout_batch_generator(
    rollout, eos_token_ids: Sequence[int], pad_token_id: int, with_logprobs: bool
) -> BatchGenerateFn:
    """A `MicroBatchEngine` batch function over any `BaseRollout`'s `generate_sequences`.

    Each batch becomes one DataProto of left-padded prompts with `meta_info` = the sampling keys +
    `n=1`, `response_length=max_new_tokens` and the stop/pad ids; each row's response is read back up
    to its mask (the stop token included), with `rollout_log_probs` when `with_logprobs`, the
    row's `weight_version` / `weight_version_max` when the rollout reports them (partial rollouts),
    and its prompt's and response's `routed_experts` when the rollout records routing (R3).
    """
    import torch
    from tensordict import TensorDict

    from verl.protocol import DataProto

    stops = {int(t) for t in eos_token_ids}

    def generate_batch(prompts: list[list[int]], sampling: Mapping[str, Any], max_new_tokens: int):
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        meta = dict(sampling)
        meta.update(
            n=1, response_length=int(max_new_tokens), eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id
        )
        batch = TensorDict(
            {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
            batch_size=[len(prompts)],
        )
        out = rollout.generate_sequences(DataProto(batch=batch, meta_info=meta))
        responses = out.batch["responses"].cpu()
        lengths = out.batch["response_mask"].cpu().sum(-1).tolist()
        log_probs = out.batch.get("rollout_log_probs", None) if with_logprobs else None
        if with_logprobs and log_probs is None:
            raise RuntimeError("the rollout returned no rollout_log_probs; set rollout.calculate_log_probs=True")
        if log_probs is not None:
            log_probs = log_probs.cpu()
        versions = [out.non_tensor_batch.get(key) for key in ("weight_version", "weight_version_max")]
        routing = out.batch.get("routed_experts", None)  # [B, width + R, layers, k]: the prompt left-padded
        if routing is not None:
            routing = routing.cpu()
        outputs = []
        for row, length in enumerate(lengths):
            ids = responses[row, : int(length)].tolist()
            lp = log_probs[row, : int(length)].tolist() if log_probs is not None else None
            low, high = (None if v is None else int(v[row]) for v in versions)
            routed = None if routing is None else routing[row, width - len(prompts[row]) : width + int(length)]
            outputs.append(
                TokenOutput(
                    ids, lp, bool(ids) and ids[-1] in stops, version_min=low, version_max=high, routed_experts=routed
                )
            )
        return outputs

    return generate_batch
