"""GPU checks of the profiler tools and the per-token sum of squared probabilities: CUDA kernels in a
`torch` trace, a `torch_memory` snapshot, `nsys` capture ranges that run without Nsight attached,
and `sum_pi_squared_from_logits` on bf16 CUDA logits. Each runs in seconds."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from verl.utils.profiler import DistProfiler, GlobalProfilerConfig, ProfilerConfig, StepProfiler
from verl.utils.profiler.profile import DistProfilerExtension
from verl.utils.torch_functional import sum_pi_squared_from_logits

pytestmark = pytest.mark.gpu


class _CudaWork(DistProfilerExtension):
    def __init__(self, tool: str, save_path: str, **tool_config):
        section = {"tool": tool, "enable": True, "save_path": save_path, "tool_config": {tool: tool_config}}
        self.init_profiler(0, section, "actor")

    @DistProfiler.annotate("matmul_step")
    def step(self) -> torch.Tensor:
        a = torch.randn(512, 512, device="cuda")
        out = a @ a
        torch.cuda.synchronize()
        return out


def test_torch_trace_of_a_listed_step_holds_cuda_kernels(tmp_path):
    work = _CudaWork("torch", str(tmp_path))
    steps = StepProfiler(GlobalProfilerConfig(tool="torch", steps=[2]), [work])
    for step in (1, 2):
        steps.begin(step)
        work.step()
        steps.end(step)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json.gz"))
    assert files == ["step2/actor/prof_rank-0.json.gz"], files
    with gzip.open(tmp_path / files[0], "rt") as f:
        trace = json.load(f)["traceEvents"]
    categories = {e.get("cat") for e in trace}
    assert "kernel" in categories, f"no CUDA kernel events; categories seen: {sorted(c for c in categories if c)}"
    assert any(e.get("name") == "matmul_step" for e in trace)


def test_torch_memory_writes_a_snapshot_of_the_listed_step(tmp_path):
    work = _CudaWork("torch_memory", str(tmp_path))
    steps = StepProfiler(GlobalProfilerConfig(tool="torch_memory", steps=[1]), [work])
    steps.begin(1)
    work.step()
    steps.end(1)
    snapshot = tmp_path / "step1/actor/memory_snapshot_rank-0.pickle"
    assert snapshot.exists() and snapshot.stat().st_size > 0, sorted(str(p) for p in tmp_path.rglob("*"))


def test_nsys_capture_ranges_and_nvtx_labels_run_without_nsight_attached(tmp_path):
    # outside `nsys profile` cudaProfilerStart/Stop are no-ops: the calls must still succeed
    for discrete in (False, True):
        work = _CudaWork("nsys", str(tmp_path), discrete=discrete)
        steps = StepProfiler(GlobalProfilerConfig(tool="nsys", steps=[1]), [work])
        steps.begin(1)
        out = work.step()
        steps.end(1)
        assert out.shape == (512, 512)
        assert work.profiler.is_discrete_mode() is discrete
        assert ProfilerConfig.from_config({"tool": "nsys", "enable": True}).profiles_rank(0)


def test_sum_pi_squared_of_bf16_cuda_logits_matches_float64():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(4, 37, 32000, device="cuda", generator=g) * 3).to(torch.bfloat16)
    expected = torch.softmax(logits.double(), dim=-1).square().sum(-1)  # of the same bf16 values
    got = sum_pi_squared_from_logits(logits)
    assert got.dtype == torch.float32
    err = ((got.double() - expected).abs() / expected).max().item()
    assert err < 1e-4, f"max relative error {err:.3g} of sum pi^2 computed in float32 from bf16 logits"
    exact = sum_pi_squared_from_logits(logits.double())
    max_err = (exact - expected).abs().max().item()
    assert max_err < 1e-12, f"float64 CUDA result differs from softmax by {max_err:.3g}"
