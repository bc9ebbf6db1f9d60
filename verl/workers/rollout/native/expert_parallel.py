"""Expert parallelism of the built-in engine (`actor_rollout_ref.rollout.expert_parallel_size`).

The rollout's ranks form groups of `ep` consecutive ranks; in each group, rank r holds only the
routed experts [r * E/ep, (r + 1) * E/ep) of every mixture-of-experts layer, and everything else
(attention, router, shared experts, embeddings) whole. Each rank generates its own share of the
batch, as without expert parallelism (upstream's DP attention + EP layout, ep = tp x dp). In an
MoE layer each rank routes its tokens with the full router, sends every (token, expert) pair to the
rank that owns the expert (`all_to_all` over the group), computes the pairs it received with its
own experts, and sends the results back; the origin weights them by the router's probabilities and
sums them per token in ascending expert order, as transformers' module does, so a token's output
is the unsharded layer's up to matmul rounding.

Design decisions:
- The swap is one module: transformers' fused experts (`gate_up_proj` [E, 2I, H], `down_proj`
  [E, H, I], `forward(hidden, top_k_index, top_k_weights)`: Qwen3-MoE, DeepSeek-V3, GLM-4.5, Mixtral)
  is replaced by `ExpertParallelExperts`, whose parameters keep the same names with E/ep rows; the
  decoder's weight loader takes each rank's rows of the full tensor the trainer sends
  (`local_rows`), so a rank never holds another rank's experts.
- Every rank of a group must run the same forwards, since each MoE layer is a collective: the
  engine agrees on when to stop decoding over the group (`GenerationEngine`), and ranks with fewer
  rows of work run the missing chunks on a dummy row (`HFRollout`).
- Models of other shapes (an experts module without those fused tensors) are refused when the
  engine is built, naming the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from verl.utils.process_groups import consecutive_rank_group


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` is transformers' fused routed-experts module (see the module docstring)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and isinstance(getattr(module, "num_experts", None), int)
        and hasattr(module, "act_fn")
    )


def expert_parallel_group(ep: int):
    """(process group, rank in it) of this rank's expert-parallel group: consecutive blocks of `ep`
    ranks of the default group."""
    return consecutive_rank_group(ep, "actor_rollout_ref.rollout.expert_parallel_size", "rollout workers")


class ExpertParallelExperts(nn.Module):
    """This rank's E/ep experts of one MoE layer; its forward exchanges tokens over `group`."""

    def __init__(self, experts: nn.Module, group, rank: int, size: int):
        super().__init__()
        self.num_experts = int(experts.num_experts)
        self.num_local_experts = self.num_experts // size
        self.first_expert = rank * self.num_local_experts
        self.group, self.size = group, size
        self.act_fn = experts.act_fn
        rows = slice(self.first_expert, self.first_expert + self.num_local_experts)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.data[rows].clone(), requires_grad=False)
        self.down_proj = nn.Parameter(experts.down_proj.data[rows].clone(), requires_grad=False)

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a full [E, ...] expert tensor."""
        return full[self.first_expert : self.first_expert + self.num_local_experts]

    def owner(self, expert: torch.Tensor) -> torch.Tensor:
        """The group rank that holds each expert id."""
        return expert // self.num_local_experts

    def _exchange(self, tensor: torch.Tensor, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
        out = tensor.new_empty((sum(out_rows), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), out_rows, in_rows, group=self.group)
        return out

    def _compute(self, hidden: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(hidden)
        for e in range(self.num_local_experts):
            rows = (local_expert == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            gate, up = nn.functional.linear(hidden[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
        return out

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        num_tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1)  # pair p = token p // k, its (p % k)-th choice
        order = torch.argsort(self.owner(expert), stable=True)  # pairs grouped by the rank that computes them
        send = torch.bincount(self.owner(expert), minlength=self.size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_rows, recv_rows = send.tolist(), recv.tolist()
        hidden = self._exchange(hidden_states[order // k], recv_rows, send_rows)
        local = self._exchange(expert[order], recv_rows, send_rows) - self.first_expert
        back = self._exchange(self._compute(hidden, local), send_rows, recv_rows)
        per_pair = torch.empty_like(back)
        per_pair[order] = back
        weighted = per_pair.view(num_tokens, k, -1) * top_k_weights[..., None]
        # transformers' module adds the experts of a token in ascending expert order, starting from zeros
        ascending = torch.argsort(top_k_index, dim=-1, stable=True)
        weighted = weighted.gather(1, ascending[..., None].expand_as(weighted)).to(hidden_states.dtype)
        total = torch.zeros_like(hidden_states)
        for j in range(k):
            total += weighted[:, j]
        return total


def shard_experts(model: nn.Module, group, rank: int, size: int) -> dict[str, ExpertParallelExperts]:
    """Replace every fused experts module of `model` by this rank's share; returns them by module name.

    Raises when the model has no such module, or when `size` does not divide its expert count."""
    found = [(name, module) for name, module in model.named_modules() if is_fused_experts(module)]
    if not found:
        raise ValueError(
            f"actor_rollout_ref.rollout.expert_parallel_size={size}: the rollout's {type(model).__name__} has no "
            "routed-experts module the built-in engine can split (transformers' fused experts with gate_up_proj "
            "and down_proj); set expert_parallel_size=1"
        )
    sharded = {}
    for name, module in found:
        if module.num_experts % size:
            raise ValueError(
                f"actor_rollout_ref.rollout.expert_parallel_size={size} does not divide the {module.num_experts} "
                f"experts of {name}; use a divisor of {module.num_experts}"
            )
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        sharded[name] = ExpertParallelExperts(module, group, rank, size)
        setattr(parent, attr, sharded[name])
    return sharded
