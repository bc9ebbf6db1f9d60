"""Run megatron-core on a CPU-only torch: the one compatibility shim, active only without CUDA.

megatron-core assumes a GPU in a handful of places that our CPU path reaches: the pipeline
schedules allocate token counters with a hard-coded accelerator device, the p2p layer and the
global memory buffer (used by the local attention's `baddbmm`) allocate on
`torch.cuda.current_device()`, p2p and dist_checkpointing call `torch.cuda.synchronize()`, and
the model-parallel RNG seeding reads the accelerator's generator. Everything else (the layers,
the tensor-parallel collectives over gloo, the schedules' logic) is plain torch and runs as is.

Design decisions:
- Patch megatron, not torch. `enable_cpu_compat()` rebinds the global name `torch` inside the
  already imported `megatron.core` modules to a thin proxy of torch whose `cuda` namespace answers
  for a CPU (current device = cpu, synchronize / streams / events are no-ops) and whose tensor
  factories map any accelerator device to cpu. torch itself, and every other library in the
  process (the rollout engine, transformers), keep the real `torch.cuda`.
- It is a no-op when `verl.utils.device.is_cuda_available()`: on a GPU megatron runs unpatched.
- It is idempotent and imports the megatron modules it patches itself, so callers only call it
  once before building a model (`verl.utils.megatron.parallel_state.initialize_model_parallel`
  does).
- The RNG: `seed_model_parallel_rng` seeds megatron's tracker with `inference_rng_tracker=True`,
  a tracker that keeps CPU generator states; with it tensor-parallel runs are bit-identical to
  tp=1 (measured), because dropout is off and initialisation happens on CPU.
- Activation recomputation saves and restores the accelerator's RNG state around each recomputed
  block; on CPU there is none (`_no_accelerator_rng_state`).
- Context parallelism: megatron's rotary embedding slices its positions for a context-parallel
  rank through pinned memory and a copy to the accelerator; on CPU the same slice is taken in place
  (`_slice_rotary_positions_on_cpu`). The attention itself is ours
  (`verl.models.mcore.context_parallel`), on CPU and GPU alike.
- Mixed precision (`megatron.dtype=bf16`: fp32 parameters, the forward under `torch.autocast`):
  megatron's tensor-parallel linear is an autograd Function whose `custom_bwd` re-enters the
  forward's autocast state for the accelerator only, so on CPU its backward would multiply bf16
  gradients with fp32 weights. `_cpu_autocast_in_linear_backward` re-enters the CPU autocast state
  the forward ran under.
- megatron's own optimizer (`verl.utils.megatron.optimizer`, for upstream's recipes): its fp32
  path clips gradients through `clip_grad_by_total_norm_fp32`, which asserts CUDA float tensors;
  `_device_neutral_grad_clipping` scales them the same way on any device.
- Sequence parallelism needs no shim: its collectives (all-gather and reduce-scatter into flat
  tensors) run on gloo, and its norm is ours (`verl.models.mcore.config.RMSNorm`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

from verl.utils.device import is_cuda_available

__all__ = ["enable_cpu_compat", "is_cpu_compat_enabled", "seed_model_parallel_rng"]

# megatron modules that touch the accelerator on the paths we run; imported (and so patched) eagerly
_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.exchange_utils",
    # mixture-of-experts layers: the router moves its weight to `torch.cuda.current_device()`
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    # multi-token prediction: the roll of its inputs across context-parallel ranks receives into a buffer
    # made on `torch.cuda.current_device()`
    "megatron.core.transformer.multi_token_prediction",
    # attention sinks (softmax_type="learnable") allocate their parameter on `torch.cuda.current_device()`,
    # and the sliding-window mask is built on the CUDA device
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.utils",
    # YaRN moves its frequencies to `torch.cuda.current_device()`
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "empty_like", "zeros_like")

_enabled = False


def _on_cpu(device):
    """`device` with any accelerator replaced by cpu (None stays None: torch's default is cpu here)."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    return device if torch.device(device).type == "cpu" else torch.device("cpu")


class _NoOpStream:
    """Stands in for an accelerator stream or event: CPU work is synchronous, so all waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def record_event(self, *args, **kwargs):
        # the MoE token dispatcher synchronises on the event its copy stream records
        return _NoOpStream()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _make_cuda_namespace() -> types.SimpleNamespace:
    def current_stream(*args, **kwargs):
        return _NoOpStream()

    return types.SimpleNamespace(
        is_available=lambda: False,
        is_initialized=lambda: False,
        current_device=lambda: torch.device("cpu"),
        device_count=lambda: 0,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        set_device=lambda *a, **k: None,
        manual_seed=lambda seed: None,
        manual_seed_all=lambda seed: None,
        current_stream=current_stream,
        default_stream=current_stream,
        Stream=_NoOpStream,
        Event=_NoOpStream,
        stream=lambda *a, **k: contextlib.nullcontext(),
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        amp=torch.amp,
    )


class _CpuTorch(types.ModuleType):
    """torch, except that `cuda` describes a CPU and tensor factories never target an accelerator."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cuda_namespace()
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn):
        def wrapped(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _on_cpu(kwargs["device"])
            return fn(*args, **kwargs)

        return wrapped

    def __getattr__(self, name):
        return getattr(torch, name)


def is_cpu_compat_enabled() -> bool:
    return _enabled


def enable_cpu_compat() -> None:
    """Make megatron-core's GPU assumptions hold on CPU (see the module docstring); no-op with CUDA."""
    global _enabled
    if _enabled or is_cuda_available():
        return
    proxy = _CpuTorch()
    for name in _MODULES:
        importlib.import_module(name)
    # also any other megatron.core module already loaded (the model's layers import more)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = proxy
    _keep_tied_embedding_on_cpu()
    _slice_rotary_positions_on_cpu()
    _no_accelerator_rng_state()
    _cpu_autocast_in_linear_backward()
    _device_neutral_grad_clipping()
    _enabled = True


def enable_moe_compat() -> None:
    """Two megatron-core 0.16 MoE paths that fail outside its tested setup (TransformerEngine, an
    older torch); both are needed on every machine without TE, so unlike `enable_cpu_compat` this
    also runs with CUDA. Idempotent.

    - The router linear (`moe_utils.router_gating_linear`, used whenever `moe_router_dtype` is set)
      tests `te_general_gemm is not None`, a name bound only when TE imports: without TE it raises
      NameError. Binding it to None selects the function's own torch matmul.
    - The all-to-all token dispatcher passes its split sizes as numpy arrays, which torch 2.13's
      `all_to_all_single` binding refuses (it takes a sequence of ints): they are turned into lists.
    """
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    forward = mappings._AllToAll.forward
    if getattr(forward, "_verl_int_splits", False):
        return

    def as_ints(splits):
        return None if splits is None else [int(n) for n in splits]

    def forward_with_int_splits(ctx, group, input, output_split_sizes, input_split_sizes):
        return forward(ctx, group, input, as_ints(output_split_sizes), as_ints(input_split_sizes))

    forward_with_int_splits._verl_int_splits = True
    mappings._AllToAll.forward = staticmethod(forward_with_int_splits)


def _keep_tied_embedding_on_cpu() -> None:
    """With pp > 1 and tied embeddings, megatron moves the last stage's copy of the embedding to the
    accelerator (`Tensor.cuda` on `weight.data`) before all-reducing it with the first stage's; on CPU the copy
    stays where it is. Only that one method sees the change."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self):
        to_accelerator = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = to_accelerator

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _slice_rotary_positions_on_cpu() -> None:
    """Under context parallelism megatron's rotary embedding keeps this rank's positions with
    `get_pos_emb_on_this_cp_rank`, which builds its index in pinned memory and moves it to the
    accelerator; on CPU the same slice (chunks r and 2cp-1-r) is taken without either. The
    function is rebound in the two modules that call it on our path."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    from verl.utils.megatron.sequence_layout import split_sequence

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        return split_sequence(pos_emb, seq_dim, cp_group.size(), cp_group.rank())

    rope_utils.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def _no_accelerator_rng_state() -> None:
    """Activation recomputation (`recompute_granularity`) saves and restores the RNG states around
    each recomputed block: the CPU generator (torch's own calls), the accelerator's, and megatron's
    tracker. Without an accelerator there is no accelerator state: getting it gives an empty
    tensor and setting it does nothing (the CPU generator and the tracker are still restored)."""
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None


def _cpu_autocast_in_linear_backward() -> None:
    """The backward of megatron's tensor-parallel linear runs under the CPU autocast state its
    forward ran under (see the module docstring); without autocast nothing changes."""
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Linear

    forward, backward = Linear.forward, Linear.backward

    def forward_recording_autocast(ctx, *args):
        ctx.verl_cpu_autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        return forward(ctx, *args)

    def backward_under_autocast(ctx, *grads):
        dtype = getattr(ctx, "verl_cpu_autocast", None)
        if dtype is None:
            return backward(ctx, *grads)
        with torch.autocast("cpu", dtype=dtype):
            return backward(ctx, *grads)

    Linear.forward = staticmethod(forward_recording_autocast)
    Linear.backward = staticmethod(backward_under_autocast)


def _device_neutral_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        """megatron's: scale the fp32 gradients of `parameters` in place by max_norm / (total_norm + 1e-6)
        when that is below 1; without its CUDA-tensor assertion."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [
            to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters if getattr(p, attr, None) is not None
        ]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32  # imported there by name


def seed_model_parallel_rng(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker the same way on CPU and GPU.

    Tensor-parallel ranks get distinct streams for their shards' initialisation as megatron
    intends; with `inference_rng_tracker=True` the tracker works on CPU generator states.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not is_cuda_available())
