"""LoRA adapters on megatron-core's tensor-parallel linear layers (upstream's `model.lora.*` of
ppo_megatron_trainer, which upstream builds with megatron-bridge's PEFT).

Each targeted linear (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`, upstream's names) gets
a child `adapter` holding A (`linear_in`, [rank, in]) and B (`linear_out`, [out, rank]); a forward
hook adds `alpha / rank * B(A(dropout(x)))` to the layer's output. The base weights are frozen, so
only the adapters reach the optimizer (the distributed one included: it splits what it is given).

Design decisions:
- Tensor parallelism follows the base weight. A column-parallel layer (fused QKV, fused gate/up)
  splits B by rows exactly like its weight and keeps A whole; a row-parallel layer splits A by
  columns like its weight and keeps B whole. Column: the input is copied (or, under sequence
  parallelism, gathered) as the base layer does, so each rank's A gradient is its share of the
  sum; those are summed over the tensor group (`partial_grad_over_tp`, read by
  `finalize_megatron_grads`). Row: the small [.., rank] activation is all-reduced, B then runs on
  every rank alike (and, under sequence parallelism, each rank keeps its slice of the tokens).
- Initial values do not depend on the layout: each adapter's full A and B are drawn from a
  generator seeded by `megatron.seed` and the layer's global name, then cut as above; so tp=2
  starts (and, with the same data, trains) exactly as tp=1.
- Checkpoints: the adapters are part of the model's sharded state dict, sharded along the same
  axis as their layer's weight (B of the fused gate/up with megatron's gate/up factory), so a
  checkpoint saved at one layout resumes at another, Adam moments included.
- Export (rollout weights, `hf_model` checkpoints, the model merger's input): `export_parameters`
  shows each adapted weight as its merge `W + alpha / rank * B @ A`, computed on this rank's shard
  in float64 and rounded once to the weight's dtype; the base weights are never written to.
- The reference policy is the base model: `adapters_disabled` switches every hook off.
- A critic (`value_head=True`, `critic.model.lora`): the adapters go on the same layers and the value
  head (the last stage's `output_layer`, HF's `score`) trains whole beside them, as upstream's
  critic trains the head it adds after megatron-bridge's PEFT froze the base (and as peft's
  `modules_to_save` does for the FSDP critic). The head is small and replicated, so it needs no
  adapter of its own.
- MoE experts (megatron's `SequentialMLP`, the local spec's): each expert's `linear_fc1` and
  `linear_fc2` gets its own A and B, as megatron-bridge gives every `local_experts.j` linear its own
  adapter. An expert linear does no communication of its own: the token dispatcher hands every
  expert-tensor rank the same tokens and sums their partial fc2 outputs. Its adapter does none either,
  and its layout follows the expert-tensor group: fc1 splits B by rows (A's gradient is summed over the
  expert-tensor group), fc2 splits A by columns and adds `B(A_i x_i)`, a partial sum like the base
  weight's, which the dispatcher sums (B's gradient is summed over the group). Experts are named and
  seeded by their global index (`...mlp.experts.local_experts.<global>.linear_fc1`), so every
  expert-parallel layout starts from the same adapters; their gradients are reduced over the
  expert-data-parallel group like the expert weights (`verl.models.mcore.moe`).
- Left out: `type` other than `lora` (canonical_lora, dora, vlm_lora), a pretrained `adapter_path`,
  grouped-GEMM experts (TransformerEngine, not built here) and dropout on expert adapters split over
  expert-tensor ranks; each is refused with its reason when asked for.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import zlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from verl.utils.device import collective_device
from verl.utils.megatron.lora_config import LORA_DTYPES, LORA_TARGETS, lora_config_errors

__all__ = [
    "LORA_TARGETS",
    "LoRASettings",
    "adapters_disabled",
    "apply_lora",
    "export_parameters",
    "lora_parameters",
    "merged_weight",
    "partial_grad_group",
]

PARTIAL_GRAD_ATTR = "partial_grad_over_tp"
"""Set on a parameter whose gradient each tensor-parallel rank holds only its share of, naming the group
to sum it over before the optimizer step: "tensor" (a dense layer's) or "expert_tensor" (an expert's)."""


def partial_grad_group(param: torch.Tensor):
    """The process group `param`'s gradient shares are summed over, or None."""
    from megatron.core import parallel_state as mpu

    which = getattr(param, PARTIAL_GRAD_ATTR, None)
    if which == "tensor":
        return mpu.get_tensor_model_parallel_group()
    if which == "expert_tensor":
        return mpu.get_expert_tensor_parallel_group()
    return None


class LoRASettings:
    """The adapter layout of `model.lora` (`MegatronLoRAConfig` or a plain mapping), checked."""

    def __init__(self, lora_cfg, seed: int = 42, key: str = "actor_rollout_ref.model.lora"):
        get = lora_cfg.get
        self.key = key
        self.rank = int(get("rank", 0))
        self.alpha = float(get("alpha", 32))
        self.dropout = float(get("dropout", 0.0))
        self.dropout_position = get("dropout_position", "pre")
        self.a_init = get("lora_A_init_method", "xavier")
        self.b_init = get("lora_B_init_method", "zero")
        self.target_modules = list(get("target_modules", list(LORA_TARGETS)))
        self.exclude_modules = list(get("exclude_modules", []) or [])
        dtype = get("dtype", None)
        self.dtype = None if dtype is None else LORA_DTYPES.get(str(dtype).replace("torch.", ""))
        self.seed = seed
        errors = lora_config_errors(lora_cfg, key=key)
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _matches(full_name: str, patterns: list[str]) -> bool:
    short = full_name.rsplit(".", 1)[-1]
    return any(short == p or ("*" in p and fnmatch.fnmatchcase(full_name, p)) for p in patterns)


def _init(tensor: torch.Tensor, method: str, generator: torch.Generator) -> None:
    if method == "zero":
        nn.init.zeros_(tensor)
    elif method == "xavier":
        nn.init.xavier_normal_(tensor, generator=generator)
    elif method == "kaiming":
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
    else:
        nn.init.normal_(tensor, std=0.02, generator=generator)


def _gated_rows(full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's rows of a fused [gate; up] tensor: its slice of gate, then its slice of up (the
    layout of megatron's fc1 weight shard)."""
    gate, up = full.chunk(2)
    return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])


class LoRAAdapter(nn.Module):
    """A and B of one tensor-parallel linear layer (`kind` "column" or "row"); see the module docstring."""

    def __init__(self, base: nn.Module, kind: str, settings: LoRASettings, seed_key: str, gated: bool):
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        self.kind, self.gated, self.enabled = kind, gated, True
        # an expert linear of megatron's SequentialMLP: the dispatcher does its tensor-parallel traffic
        self.expert = bool(getattr(base, "is_expert", False))
        self.scale = settings.scale
        self.tp_group = base.tp_group  # the expert-tensor group for an expert
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self.dropout_position = settings.dropout_position
        dtype = settings.dtype or base.weight.dtype
        generator = torch.Generator().manual_seed(settings.seed + zlib.crc32(seed_key.encode()))
        full_a = torch.empty(settings.rank, base.input_size, dtype=torch.float32)
        full_b = torch.empty(base.output_size, settings.rank, dtype=torch.float32)
        _init(full_a, settings.a_init, generator)
        _init(full_b, settings.b_init, generator)
        if kind == "column":
            a = full_a
            b = _gated_rows(full_b, self.tp_size, self.tp_rank) if gated else full_b.chunk(self.tp_size)[self.tp_rank]
        else:
            a, b = full_a.chunk(self.tp_size, dim=1)[self.tp_rank], full_b
        device = base.weight.device
        self.linear_in = nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.linear_out = nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
        group = "expert_tensor" if self.expert else "tensor"
        if kind == "column":
            set_tensor_model_parallel_attributes(self.linear_out, True, 0, 1)
            if self.tp_size > 1:
                setattr(self.linear_in, PARTIAL_GRAD_ATTR, group)
        else:
            set_tensor_model_parallel_attributes(self.linear_in, True, 1, 1)
            if self.expert and self.tp_size > 1:  # B sees only this rank's partial [.., rank] activation
                setattr(self.linear_out, PARTIAL_GRAD_ATTR, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        if self.dropout_position == "pre":
            x = self.dropout(x)
        if self.expert:  # as the base expert linear: no traffic here (see the module docstring)
            out = F.linear(F.linear(x, self.linear_in), self.linear_out)
        elif self.kind == "column":
            if self.tp_size > 1:  # the input as the base layer sees it, with its backward all-reduce
                if self.sequence_parallel:
                    x = gather_from_sequence_parallel_region(x, group=self.tp_group)
                else:
                    x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
            out = F.linear(F.linear(x, self.linear_in), self.linear_out)
        else:
            hidden = F.linear(x, self.linear_in)
            if self.tp_size > 1:
                hidden = reduce_from_tensor_model_parallel_region(hidden, group=self.tp_group)
            out = F.linear(hidden, self.linear_out)
            if self.tp_size > 1 and self.sequence_parallel:
                out = scatter_to_sequence_parallel_region(out, group=self.tp_group)
        if self.dropout_position == "post":
            out = self.dropout(out)
        return out * self.scale

    def delta(self) -> torch.Tensor:
        """scale * B @ A of this rank's shard, in float64 (`shard_invariant_product`)."""
        return self.scale * shard_invariant_product(self.linear_out.detach().double(), self.linear_in.detach().double())


def shard_invariant_product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """`b @ a` whose every element is the same bits whatever rows of `b` or columns of `a` it is computed
    with: the sum over the (small) adapter rank is taken term by term in rank order, one rounded product
    and one rounded addition per term. A GEMM's rounding depends on the matrix's shape (its kernels block
    and vectorise by it: on an AMD EPYC, `B @ A[:, :32]` differs from the first 32 columns of `B @ A` by
    an ulp in float64), so a tensor-parallel rank's merged shard would not equal the same slice of the
    merge done whole (the model merger's), and a checkpoint's weights would depend on the layout that
    saved them. Costs `rank` elementwise passes over the weight, where the merge happens (export and
    weight sync), not in training."""
    out = b[:, :1] * a[:1, :]
    for k in range(1, b.shape[1]):
        out += b[:, k : k + 1] * a[k : k + 1, :]
    return out


def _add_adapter_output(module, args, kwargs, output):
    adapter = module.adapter
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


def _adapted_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """The layer's sharded state dict with its adapter's A and B sharded like its weight."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    kind = self.adapter.kind
    axes = (
        {"weight": 0, "bias": 0, "adapter.linear_out": 0} if kind == "column" else {"weight": 1, "adapter.linear_in": 1}
    )
    state = self.state_dict(prefix="", keep_vars=True)
    out = make_sharded_tensors_for_checkpoint(
        state, prefix, axes, sharded_offsets, tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group")
    )
    if self.adapter.gated:
        singleton = (metadata or {}).get("singleton_local_shards", False)
        key = f"{prefix}adapter.linear_out"
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
    return out


def _global_expert_name(layer: nn.Module, sub_name: str) -> str:
    """`sub_name` with a routed expert's local index (`mlp.experts.local_experts.<j>.`) replaced by its
    global one, so patterns and initial values name the same expert at every expert-parallel size."""
    prefix = "mlp.experts.local_experts."
    if not sub_name.startswith(prefix):
        return sub_name
    local, rest = sub_name[len(prefix) :].split(".", 1)
    experts = layer.mlp.experts
    return f"{prefix}{experts.ep_group.rank() * experts.num_local_experts + int(local)}.{rest}"


def _check_expert_layer(full_name: str, module: nn.Module, settings: LoRASettings) -> None:
    """Refuse the expert layouts the expert adapter does not implement (see the module docstring)."""
    if ".local_experts." not in full_name:
        raise NotImplementedError(
            f"{settings.key}.target_modules={settings.target_modules} reaches {full_name} "
            f"({type(module).__name__}): adapters on grouped-GEMM experts are not implemented here, only on "
            "megatron's SequentialMLP experts (the local layer spec this backend builds); exclude the experts with "
            "exclude_modules=['*.experts.*']"
        )
    if settings.dropout > 0 and module.tp_group.size() > 1:
        raise NotImplementedError(
            f"{settings.key}.dropout={settings.dropout} on the expert layer {full_name} split over "
            f"{module.tp_group.size()} expert-tensor ranks: each rank would drop a different part of the same "
            f"tokens' partial sums; set lora.dropout=0, {_role(settings.key)}.megatron.expert_tensor_parallel_size=1, "
            "or exclude "
            "the experts with exclude_modules=['*.experts.*']"
        )


def _role(key: str) -> str:
    """The section of `key`'s role, for the messages: `critic` or `actor_rollout_ref.actor`."""
    return "critic" if key.startswith("critic.") else "actor_rollout_ref.actor"


def apply_lora(
    model_chunks, lora_cfg, seed: int = 42, value_head: bool = False, key: str = "actor_rollout_ref.model.lora"
) -> list[nn.Parameter]:
    """Freeze every parameter of `model_chunks` and put adapters on the targeted layers; returns the
    trainable parameters: the adapters', and with `value_head` (a critic) the value head's too.
    `key` names the config section in errors."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    settings = LoRASettings(lora_cfg, seed, key=key)
    if getattr(model_chunks[0].config, "multi_latent_attention", False):
        raise NotImplementedError(
            f"{key}.rank > 0 on a multi-head latent attention model (deepseek_v3): adapters "
            "on its latent projections are not implemented here, and linear_qkv would match nothing; train the "
            f"full model (lora.rank=0) or use {_role(key)}.strategy=fsdp for LoRA"
        )
    for chunk in model_chunks:
        chunk.requires_grad_(False)
    trained, adapted = [], 0
    for chunk in model_chunks:
        for layer in chunk.decoder.layers:
            global_layer = layer.layer_number - 1  # layer_number is global and 1-based
            for sub_name, module in list(layer.named_modules()):
                short = sub_name.rsplit(".", 1)[-1]
                if short not in LORA_TARGETS:
                    continue
                full_name = f"decoder.layers.{global_layer}.{_global_expert_name(layer, sub_name)}"
                if not _matches(full_name, settings.target_modules) or _matches(full_name, settings.exclude_modules):
                    continue
                if ".experts." in f".{sub_name}":
                    _check_expert_layer(full_name, module, settings)
                kind = LORA_TARGETS[short]
                expected = ColumnParallelLinear if kind == "column" else RowParallelLinear
                if not isinstance(module, expected):
                    raise TypeError(f"{full_name} is a {type(module).__name__}, not megatron's {expected.__name__}")
                gated = short == "linear_fc1" and bool(module.config.gated_linear_unit)
                module.adapter = LoRAAdapter(module, kind, settings, full_name, gated)
                module.register_forward_hook(_add_adapter_output, with_kwargs=True)
                # an instance attribute: this layer's checkpoint entries include its adapter
                module.sharded_state_dict = _adapted_sharded_state_dict.__get__(module)
                trained += [module.adapter.linear_in, module.adapter.linear_out]
                adapted += 1
    if torch.distributed.is_initialized():  # another pipeline stage or expert-parallel rank may hold the match
        count = torch.tensor([adapted], dtype=torch.int64, device=collective_device())
        torch.distributed.all_reduce(count)
        adapted = int(count.item())
    if not adapted:
        raise ValueError(
            f"{key}.target_modules={settings.target_modules} (exclude_modules="
            f"{settings.exclude_modules}) matches no layer of this model, so LoRA would adapt nothing"
        )
    if value_head:
        trained += _unfreeze_value_head(model_chunks)
    return trained


def _unfreeze_value_head(model_chunks) -> list[nn.Parameter]:
    """The value head's parameters, trainable again (only the last pipeline stage holds the head)."""
    params = []
    for chunk in model_chunks:
        if getattr(chunk, "post_process", False):
            chunk.output_layer.requires_grad_(True)
            params += list(chunk.output_layer.parameters())
    return params


def _adapters(model_chunks):
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, LoRAAdapter):
                yield module


def lora_parameters(model_chunks) -> list[nn.Parameter]:
    return [p for adapter in _adapters(model_chunks) for p in (adapter.linear_in, adapter.linear_out)]


@contextlib.contextmanager
def adapters_disabled(model_chunks):
    """The base model (every adapter off) inside the block."""
    adapters = list(_adapters(model_chunks))
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def merged_weight(layer: nn.Module) -> torch.Tensor:
    """This rank's shard of `W + scale * B @ A` (float64 sum, rounded once to W's dtype)."""
    weight = layer.weight.detach()
    return (weight.double() + layer.adapter.delta()).to(weight.dtype)


class _MergedParameters(Mapping):
    """`named_parameters()` of a chunk where each adapted weight reads as its merge, computed when read."""

    def __init__(self, chunk: nn.Module):
        self._params = dict(chunk.named_parameters())
        self._adapted = {
            name + ".weight": module
            for name, module in chunk.named_modules()
            if isinstance(getattr(module, "adapter", None), LoRAAdapter)
        }

    def __getitem__(self, name):
        module = self._adapted.get(name)
        return self._params[name] if module is None else merged_weight(module)

    def __iter__(self):
        return iter(self._params)

    def __len__(self):
        return len(self._params)


def export_parameters(chunk: nn.Module) -> Mapping[str, torch.Tensor]:
    """The parameters of `chunk` by name, adapted weights merged with their adapters (plain
    `named_parameters` without LoRA)."""
    if not any(isinstance(m, LoRAAdapter) for m in chunk.modules()):
        return dict(chunk.named_parameters())
    return _MergedParameters(chunk)
