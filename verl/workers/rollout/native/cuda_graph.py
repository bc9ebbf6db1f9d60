"""CUDA-graph replay of the native decode step.

At small per-token work a GPU decode step is bound by kernel launches (~25 ops per layer), not by
memory bandwidth; replaying a captured graph launches the whole step at once. Graphs are captured
lazily, one per (batch bucket, KV-length bucket):

- batch buckets are powers of two; a batch is padded up to its bucket and the padding rows compute
  garbage that nobody reads (their key bias keeps one column open so they stay finite);
- the KV length is rounded up to a multiple of `kv_block` columns, so early steps do not pay for
  attention over the whole preallocated cache (future columns are masked by the key bias).

Everything a graph reads is a static buffer: the decoder's weights, KV cache, key bias and rotary
tables, plus the token/position/step inputs owned here. Whoever reallocates any of them (a larger
batch, sleep/wake_up) must call `reset()`, which drops the graphs and their memory pool.
"""

from __future__ import annotations

import torch

from verl.utils.device import get_torch_device

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def batch_bucket(batch: int) -> int:
    for size in BATCH_BUCKETS:
        if batch <= size:
            return size
    raise ValueError(
        f"a rollout batch of {batch} sequences exceeds the largest CUDA-graph bucket {BATCH_BUCKETS[-1]}; "
        "lower actor_rollout_ref.rollout.max_num_seqs (the engine then generates in chunks)"
    )


class DecodeGraphRunner:
    """Captures and replays `decoder.decode_step` per (batch bucket, kv bucket)."""

    def __init__(self, decoder, kv_block: int = 128, warmup_steps: int = 2):
        self.decoder = decoder
        self.kv_block = kv_block
        self.warmup_steps = warmup_steps
        self._graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self._pool = None
        self._tokens: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._step: torch.Tensor | None = None

    def round_len(self, length: int) -> int:
        return -(-length // self.kv_block) * self.kv_block

    def reset(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._tokens = self._positions = self._step = None

    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, step: int, kv_len: int) -> torch.Tensor:
        batch = tokens.shape[0]
        bucket = batch_bucket(batch)
        cap_batch, cap_len = self.decoder.cache_capacity()
        kv_bucket = min(self.round_len(kv_len), cap_len)
        if self._tokens is None:
            device = self.decoder.device
            self._tokens = torch.zeros(cap_batch, dtype=torch.long, device=device)
            self._positions = torch.zeros(cap_batch, dtype=torch.long, device=device)
            self._step = torch.zeros(1, dtype=torch.long, device=device)
        self._tokens[:batch].copy_(tokens)
        self._positions[:batch].copy_(positions)
        self._step.fill_(step)
        key = (bucket, kv_bucket)
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, kv_bucket)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[:batch]

    def _capture(self, bucket: int, kv_bucket: int):
        dev = get_torch_device()

        def step():
            return self.decoder.decode_step(self._tokens[:bucket], self._positions[:bucket], self._step, kv_bucket)

        # Warm up on a side stream (allocator and library handles), as capture requires. The step
        # is idempotent for fixed inputs, so running it here before the real replay is harmless.
        stream = dev.Stream()
        stream.wait_stream(dev.current_stream())
        with dev.stream(stream):
            for _ in range(self.warmup_steps):
                step()
        dev.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = dev.graph_pool_handle()
        graph = dev.CUDAGraph()
        with dev.graph(graph, pool=self._pool):
            logits = step()
        return graph, logits
