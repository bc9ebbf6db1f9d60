"""The Ulysses all-to-all on 2 real gloo ranks against a single-process reference."""

import torch
import torch.distributed as dist

from tests.distributed_helpers import run_distributed
from verl.utils.ulysses import all_to_all


def _seq_to_head_and_back(rank, world_size):
    torch.manual_seed(0)
    full = torch.randn(2, 6, 4, 3, dtype=torch.float64)  # [batch, seq, heads, dim]
    local = full.chunk(world_size, dim=1)[rank].clone().requires_grad_(True)
    heads = all_to_all(local, scatter_dim=2, gather_dim=1)
    # Full sequence, this rank's heads only.
    torch.testing.assert_close(heads, full.chunk(world_size, dim=2)[rank], rtol=0, atol=0)
    weight = torch.arange(heads.numel(), dtype=torch.float64).reshape(heads.shape)
    (heads * weight).sum().backward()
    # d/d local of sum(all_to_all(local) * w) is the inverse all-to-all of w.
    expected = torch.zeros_like(full)
    expected_heads = list(expected.chunk(world_size, dim=2))
    weights = [torch.empty_like(weight) for _ in range(world_size)]
    dist.all_gather(weights, weight)
    for r, w in enumerate(weights):
        expected_heads[r].copy_(w)
    torch.testing.assert_close(local.grad, expected.chunk(world_size, dim=1)[rank], rtol=0, atol=0)
    back = all_to_all(heads, scatter_dim=1, gather_dim=2)
    torch.testing.assert_close(back, local.detach(), rtol=0, atol=0)


def test_all_to_all_trades_sequence_split_for_head_split_and_backward_inverts_it():
    run_distributed(_seq_to_head_and_back, 2)
