"""CUDA-graph replay of the native decode step.

At small per-token work a GPU decode step is bound by kernel launches (~25 ops per layer), not by
memory bandwidth; replaying a captured graph launches the whole step at once. Graphs are captured
lazily, one per (batch bucket, KV-length bucket):

- batch buckets are powers of two, capped at the KV cache's row count (the cache is sized for the
  batch itself, not its bucket); a batch is padded up to its bucket and the padding rows compute
  garbage that nobody reads (their key bias keeps one column open so they stay finite);
- the KV length is rounded up to a multiple of `kv_block` columns, so early steps do not pay for
  attention over the whole preallocated cache (future columns are masked by the key bias).

Everything a graph reads is a static buffer: the decoder's weights, KV cache, key bias and rotary
tables, plus the token/position/step inputs owned here. Whoever reallocates any of them (a larger
batch, sleep/wake_up) must call `reset()`, which drops the graphs and their memory pool.

Memory: every graph writes its logits into one static [cache rows, vocab] buffer owned here, so
after a capture none of its intermediates stay alive and the next graph reuses the same blocks of
the shared pool. (When each graph returned its own logits tensor, a long response with
`kv_block=128` kept dozens of [bucket, vocab] tensors alive: ~78 MB each at batch 256 and a 152k
vocabulary.) The returned logits are a view of that buffer, valid until the next `run`. The first
capture after a reset is preceded by the graph for the whole cache (all its rows, every column):
its intermediates are the largest any graph needs, so later graphs carve theirs out of the same
pool blocks instead of adding blocks for each longer KV bucket (the attention scores grow with
it). That costs one capture per cache that a batch finishing early never replays.

Captures are counted and timed (`num_captures`, `capture_s`, never reset): sleep frees the KV
cache and weights, so in the hybrid engine every RL step recaptures the graphs it uses (2 eager
warm-up steps + capture + instantiation, ~15-30 ms each on an H100). Keeping the buffers at fixed
addresses across sleep (a CUDA virtual-memory allocator that unmaps and remaps the pages, as vLLM's
sleep mode does) would remove that cost; it is not done here.

Capture and replay run under the decoder's device (`torch.cuda.device`): the stream, the memory
pool and the graph are taken from the *current* device, which in another thread (the agent loop's
engine thread) is device 0 whatever the engine's device is.
"""

from __future__ import annotations

import time

import torch

from verl.utils.device import device_context

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
        self._graphs: dict[tuple[int, int], object] = {}
        self._pool = None
        self._tokens: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._step: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._stream = None  # warm-up and capture stream, made on the decoder's device
        self.num_captures = 0
        self.capture_s = 0.0

    def round_len(self, length: int) -> int:
        return -(-length // self.kv_block) * self.kv_block

    def reset(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._tokens = self._positions = self._step = self._logits = None

    def num_graphs(self) -> int:
        return len(self._graphs)

    def static_bytes(self) -> int:
        """Bytes of the buffers owned here (inputs and the shared logits output)."""
        return sum(t.numel() * t.element_size() for t in (self._tokens, self._positions, self._logits) if t is not None)

    def graph_batch(self, batch: int) -> int:
        """Rows a graph for `batch` live rows computes: its bucket, at most the cache's rows."""
        return min(batch_bucket(batch), self.decoder.cache_capacity()[0])

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, step: int, kv_len: int) -> torch.Tensor:
        device = self.decoder.device
        with device_context(device):
            batch = tokens.shape[0]
            rows = self.graph_batch(batch)
            cap_batch, cap_len = self.decoder.cache_capacity()
            kv_bucket = min(self.round_len(kv_len), cap_len)
            if self._tokens is None:
                self._tokens = torch.zeros(cap_batch, dtype=torch.long, device=device)
                self._positions = torch.zeros(cap_batch, dtype=torch.long, device=device)
                self._step = torch.zeros(1, dtype=torch.long, device=device)
                self._logits = torch.empty(
                    cap_batch, self.decoder.spec.vocab_size, dtype=self.decoder.dtype, device=device
                )
            self._tokens[:batch].copy_(tokens)
            self._positions[:batch].copy_(positions)
            self._step.fill_(step)
            key = (rows, kv_bucket)
            if key not in self._graphs:
                largest = (self.graph_batch(cap_batch), cap_len)
                if not self._graphs and key != largest:
                    # the largest graph first: every later one fits in the pool blocks it leaves
                    self._graphs[largest] = self._capture(*largest)
                self._graphs[key] = self._capture(rows, kv_bucket)
            self._graphs[key].replay()
            return self._logits[:batch]

    def _capture(self, rows: int, kv_bucket: int):
        device = self.decoder.device
        dev = _device_module(device)
        start = time.perf_counter()

        def step():
            self.decoder.decode_step(
                self._tokens[:rows], self._positions[:rows], self._step, kv_bucket, out=self._logits[:rows]
            )

        # Warm up on a side stream (allocator and library handles), as capture requires. The step
        # is idempotent for fixed inputs, so running it here before the real replay is harmless.
        # The stream is passed to the capture too: torch's default capture stream is one per
        # process, made on whichever device was current first.
        if self._stream is None:
            self._stream = dev.Stream(device)
        stream = self._stream
        stream.wait_stream(dev.current_stream(device))
        with dev.stream(stream):
            for _ in range(self.warmup_steps):
                step()
        dev.current_stream(device).wait_stream(stream)
        if self._pool is None:
            self._pool = dev.graph_pool_handle()
        graph = dev.CUDAGraph()
        with dev.graph(graph, pool=self._pool, stream=stream):
            step()
        stream.synchronize()  # the timing includes the warm-up steps' device work
        self.num_captures += 1
        self.capture_s += time.perf_counter() - start
        return graph


def _device_module(device: torch.device):
    """The torch module of `device`'s type (`torch.cuda` for CUDA devices)."""
    return getattr(torch, device.type)
