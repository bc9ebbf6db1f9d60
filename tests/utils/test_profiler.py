"""`global_profiler` / per-role `profiler` with tool `torch`: CPU runs of a few training steps write
torch.profiler traces for the listed steps and ranks only, into `save_path`; config errors name the
key; `nsys` is refused where Nsight Systems is not installed."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf, open_dict

from verl.utils.profiler import (
    DistProfiler,
    DistProfilerExtension,
    GlobalProfilerConfig,
    ProfilerConfig,
    StepProfiler,
    check_tool_available,
    resolve_role_profilers,
)


class TinyTrainer(DistProfilerExtension):
    """A worker-like object: a small model trained one step per `train_step` call."""

    def __init__(self, rank: int, profiler: dict, role: str = "actor"):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.init_profiler(rank, profiler, role)

    @DistProfiler.annotate("train_step")
    def train_step(self) -> float:
        loss = self.model(torch.randn(4, 8)).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.detach())


def torch_profiler(save_path: Path, **overrides) -> dict:
    section = {"tool": "torch", "enable": True, "save_path": str(save_path), "tool_config": {"torch": {}}}
    section.update(overrides)
    return section


def run_steps(workers, config: GlobalProfilerConfig, num_steps: int) -> None:
    profiler = StepProfiler(config, workers)
    for step in range(1, num_steps + 1):
        profiler.begin(step)
        for worker in workers:
            worker.train_step()
        profiler.end(step)


def traces(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.json.gz"))


def events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_traces_are_written_for_the_listed_steps_and_ranks_only(tmp_path):
    workers = [TinyTrainer(rank, torch_profiler(tmp_path, ranks=[1])) for rank in range(2)]
    run_steps(workers, GlobalProfilerConfig(tool="torch", steps=[2, 4], save_path=str(tmp_path)), num_steps=5)
    assert traces(tmp_path) == ["step2/actor/prof_rank-1.json.gz", "step4/actor/prof_rank-1.json.gz"]
    names = {e.get("name") for e in events(tmp_path / "step4/actor/prof_rank-1.json.gz")}
    assert "train_step" in names, sorted(n for n in names if n)[:20]  # the annotated call is labelled
    assert any(n and n.startswith("aten::") for n in names)  # and the ops under it recorded


def test_default_rank_is_zero_and_all_ranks_selects_every_rank(tmp_path):
    default = [TinyTrainer(rank, torch_profiler(tmp_path / "default")) for rank in range(2)]
    run_steps(default, GlobalProfilerConfig(tool="torch", steps=[1]), num_steps=2)
    assert traces(tmp_path / "default") == ["step1/actor/prof_rank-0.json.gz"]
    # one process records one trace at a time, so the two ranks run one after the other here
    for rank in range(2):
        worker = TinyTrainer(rank, torch_profiler(tmp_path / "all", all_ranks=True))
        run_steps([worker], GlobalProfilerConfig(tool="torch", steps=[1]), num_steps=1)
    assert traces(tmp_path / "all") == ["step1/actor/prof_rank-0.json.gz", "step1/actor/prof_rank-1.json.gz"]


def test_a_role_that_does_not_enable_profiling_writes_nothing(tmp_path):
    worker = TinyTrainer(0, torch_profiler(tmp_path, enable=False))
    run_steps([worker], GlobalProfilerConfig(tool="torch", steps=[1, 2]), num_steps=2)
    assert traces(tmp_path) == []


def test_continuous_steps_share_one_trace_named_after_the_first(tmp_path):
    worker = TinyTrainer(0, torch_profiler(tmp_path))
    config = GlobalProfilerConfig(tool="torch", steps=[2, 3, 5], profile_continuous_steps=True)
    run_steps([worker], config, num_steps=5)
    assert traces(tmp_path) == ["step2/actor/prof_rank-0.json.gz", "step5/actor/prof_rank-0.json.gz"]
    calls = [e for e in events(tmp_path / "step2/actor/prof_rank-0.json.gz") if e.get("name") == "train_step"]
    assert len([e for e in calls if e.get("cat") == "user_annotation"]) == 2  # steps 2 and 3


def test_discrete_mode_writes_one_trace_per_annotated_call(tmp_path):
    worker = TinyTrainer(0, torch_profiler(tmp_path, tool_config={"torch": {"discrete": True}}))
    run_steps([worker], GlobalProfilerConfig(tool="torch", steps=[3]), num_steps=3)
    assert traces(tmp_path) == ["step3/actor/train_step_prof_rank-0.json.gz"]


def test_actor_worker_compute_log_prob_is_traced_on_cpu(tmp_path, monkeypatch):
    """The FSDP actor worker, in one process on CPU, profiled through its start/stop RPCs."""
    from verl.models import bundled_model_path
    from verl.trainer.config import load_ppo_config
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    cfg = load_ppo_config(
        [f"actor_rollout_ref.model.path={bundled_model_path()}", "trainer.n_gpus_per_node=1"], config_name="arith_demo"
    )
    with open_dict(cfg):
        cfg.global_profiler = {"tool": "torch", "steps": [2], "save_path": str(tmp_path)}
        cfg.actor_rollout_ref.actor.profiler = {"enable": True, "tool": None, "save_path": None}
    resolve_role_profilers(cfg)  # fills the role's tool and save_path, as the trainer does
    try:
        worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
        worker.init_model()
        data = _batch(worker.tokenizer)
        steps = StepProfiler(GlobalProfilerConfig.from_config(cfg.global_profiler), [worker])
        for step in (1, 2, 3):
            steps.begin(step)
            out = worker.compute_log_prob(data)
            steps.end(step)
        assert out.batch["old_log_probs"].shape == data.batch["responses"].shape
        assert traces(tmp_path) == ["step2/actor/prof_rank-0.json.gz"]
        names = {e.get("name") for e in events(tmp_path / "step2/actor/prof_rank-0.json.gz")}
        assert "compute_log_prob" in names
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _batch(tokenizer):
    from tests.distributed_helpers import ppo_tensors
    from verl.protocol import DataProto

    prompts = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    responses = torch.tensor([[12, 13, 14], [15, 16, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0]])
    tensors = ppo_tensors(prompts, responses, attention_mask, attention_mask[:, 4:])
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0, "micro_batch_size": 2})


# --------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "section, match",
    [
        ({"tool": "npu"}, "Ascend NPUs"),
        ({"tool": "perf"}, "not a profiler tool"),
        ({"tool": "torch", "tool_config": {"torch": {"contents": ["profile-by-stage"]}}}, "SGLang"),
        ({"tool": "torch", "tool_config": {"torch": {"contents": ["gpu"]}}}, "unknown"),
        ({"tool": "torch", "tool_config": {"torch": {"step_start": 3}}}, "global_profiler.steps"),
        ({"tool": "torch", "rank": [0]}, "unknown key"),
    ],
)
def test_role_profiler_errors_name_the_setting(section, match):
    with pytest.raises(ValueError, match=match):
        ProfilerConfig.from_config({"enable": True, **section}).selected_tool_config()


def test_global_steps_are_validated_and_nsys_workers_get_a_capture_range_end():
    with pytest.raises(ValueError, match="count from 1"):
        GlobalProfilerConfig(tool="torch", steps=[0, 1])
    with pytest.raises(ValueError, match="list of training steps"):
        GlobalProfilerConfig(tool="torch", steps=3)
    nsys = GlobalProfilerConfig.from_config(
        {
            "_target_": "verl.utils.profiler.ProfilerConfig",
            "tool": "nsys",
            "steps": [1, 2],
            "global_tool_config": {
                "nsys": {"worker_nsight_options": {"trace": "cuda,nvtx", "capture-range-end": None}}
            },
        }
    )
    assert nsys.worker_runtime_env() == {"nsight": {"trace": "cuda,nvtx", "capture-range-end": "repeat-shutdown:12"}}
    assert GlobalProfilerConfig(tool="torch", steps=[1]).worker_runtime_env() == {}


@pytest.mark.skipif(shutil.which("nsys") is not None, reason="Nsight Systems is installed here")
def test_nsys_is_refused_where_it_is_not_installed():
    with pytest.raises(RuntimeError, match="nsys.*not installed.*global_profiler.tool=torch"):
        check_tool_available("nsys")
    check_tool_available("torch")


def test_roles_inherit_the_global_tool_and_save_path_and_cannot_enable_without_a_tool(tmp_path):
    cfg = OmegaConf.create(
        {
            "global_profiler": {"tool": "torch", "steps": [1], "save_path": str(tmp_path)},
            "actor_rollout_ref": {"actor": {"profiler": {"enable": True, "tool": None, "save_path": None}}},
            "critic": {"profiler": {"enable": False, "tool": None, "save_path": "elsewhere"}},
        }
    )
    resolve_role_profilers(cfg)
    assert cfg.actor_rollout_ref.actor.profiler.tool == "torch"
    assert cfg.actor_rollout_ref.actor.profiler.save_path == str(tmp_path)
    assert cfg.critic.profiler.save_path == "elsewhere"
    no_tool = OmegaConf.create(
        {"global_profiler": {"tool": None, "steps": [1]}, "critic": {"profiler": {"enable": True, "tool": None}}}
    )
    with pytest.raises(ValueError, match="critic.profiler.enable=true but no tool"):
        resolve_role_profilers(no_tool)
