"""The profiler's config is upstream's one set of classes: the composed YAML builds every role's
`profiler` section into `verl.utils.profiler.ProfilerConfig` with each `tool_config` entry in its tool
class, `global_profiler` (upstream's `_target_` included) into `GlobalProfilerConfig`, and a worker
profiled from the typed section still writes its trace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from verl.trainer.config import load_ppo_config
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.profiler import (
    GlobalProfilerConfig,
    NPUToolConfig,
    NsightToolConfig,
    ProfilerConfig,
    TorchMemoryToolConfig,
    TorchProfilerToolConfig,
    resolve_role_profilers,
)
from verl.utils.profiler.config import PrecisionDebuggerToolConfig
from verl.workers.config import RefConfig, RewardModelConfig

TOOL_CLASSES = {
    "nsys": NsightToolConfig,
    "npu": NPUToolConfig,
    "torch": TorchProfilerToolConfig,
    "torch_memory": TorchMemoryToolConfig,
    "precision_debugger": PrecisionDebuggerToolConfig,
}
ROLE_SECTIONS = {
    "actor_rollout_ref.actor": None,  # the YAML's _target_ names the class
    "actor_rollout_ref.rollout": None,
    "actor_rollout_ref.ref": RefConfig,
    "critic": None,
    "reward_model": RewardModelConfig,
}


def _section(cfg, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = node[key]
    return node


@pytest.mark.parametrize("config_name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_every_role_profiler_builds_into_upstreams_classes(config_name):
    cfg = load_ppo_config(
        [
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # an actor section needs one, as upstream's
            "global_profiler.global_tool_config.nsys.discrete=true",
            "global_profiler.global_tool_config.torch_memory.stack_depth=7",
        ],
        config_name=config_name,
        validate=False,  # the section builds are the check here
    )
    for dotted, cls in ROLE_SECTIONS.items():
        profiler = omega_conf_to_dataclass(_section(cfg, dotted), cls).profiler
        assert type(profiler) is ProfilerConfig, dotted
        assert {name: type(entry) for name, entry in profiler.tool_config.items()} == TOOL_CLASSES, dotted
        # the YAML's interpolations of global_profiler reach the built tool classes
        assert profiler.tool_config["nsys"].discrete is True, dotted
        assert profiler.tool_config["torch_memory"].stack_depth == 7, dotted
        assert profiler.tool_config["npu"].analysis is True  # the YAML's value, not the class default
        assert (profiler.tool, profiler.enable, profiler.ranks, profiler.save_path) == (
            None,
            False,
            [],
            "outputs/profile",
        )


def test_the_workers_section_class_is_the_profilers():
    from verl.workers.config import actor, critic, reward_model, rollout

    for module in (actor, critic, reward_model, rollout):
        assert module.ProfilerConfig is ProfilerConfig


def test_global_profiler_accepts_upstreams_target_and_builds_the_nsight_options():
    cfg = load_ppo_config(["global_profiler.tool=nsys", "global_profiler.steps=[3,1]"], validate=False)
    assert cfg.global_profiler._target_ == "verl.utils.profiler.ProfilerConfig"  # upstream's YAML says so
    glob = omega_conf_to_dataclass(cfg.global_profiler, GlobalProfilerConfig)
    assert glob.steps == [1, 3]
    nsys = glob.global_tool_config["nsys"]
    assert type(nsys) is NsightToolConfig
    assert nsys.worker_nsight_options["capture-range"] == "cudaProfilerApi"
    # 6 capture ranges per profiled step unless the options name an end
    assert glob.worker_runtime_env()["nsight"]["capture-range-end"] == "repeat-shutdown:12"
    assert glob.controller_runtime_env() == {
        "nsight": {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph"}
    }


def test_npu_settings_build_but_selecting_the_npu_tool_is_refused():
    npu = NPUToolConfig(contents=["npu", "cpu"], level="level1")
    assert (npu.contents, npu.level, npu.analysis, npu.discrete) == (["npu", "cpu"], "level1", False, False)
    with pytest.raises(ValueError, match="level='level9' is unknown"):
        NPUToolConfig(level="level9")
    with pytest.raises(ValueError, match="Ascend NPUs"):
        ProfilerConfig(tool="npu")
    with pytest.raises(ValueError, match="global_profiler.tool=npu profiles Ascend NPUs"):
        GlobalProfilerConfig(tool="npu", steps=[1])


def test_tool_config_refuses_an_unknown_tool_and_fills_the_others_with_defaults():
    with pytest.raises(ValueError, match=r"unknown tool\(s\) \['perf'\]"):
        ProfilerConfig(tool_config={"perf": {}})
    built = ProfilerConfig(tool="torch", tool_config={"torch": {"contents": ["cpu"]}})
    assert built.selected_tool_config() == TorchProfilerToolConfig(contents=["cpu"])
    assert built.tool_config["torch_memory"] == TorchMemoryToolConfig()


def test_union_and_intersect_combine_the_rank_selections():
    a = ProfilerConfig(tool="torch", enable=True, ranks=[0, 2])
    b = ProfilerConfig(tool="torch", enable=False, all_ranks=True, ranks=[2, 3])
    assert (a.union(b).enable, a.union(b).all_ranks, a.union(b).ranks) == (True, True, [0, 2, 3])
    assert (a.intersect(b).enable, a.intersect(b).all_ranks, a.intersect(b).ranks) == (False, False, [2])
    with pytest.raises(ValueError, match="different tools: torch vs nsys"):
        a.union(dataclasses.replace(b, tool="nsys"))


def test_a_worker_profiled_from_the_typed_actor_section_writes_its_trace(tmp_path: Path):
    from tests.utils.test_profiler import TinyTrainer, run_steps, traces

    cfg = load_ppo_config(
        [
            "global_profiler.tool=torch",
            "global_profiler.steps=[2]",
            f"global_profiler.save_path={tmp_path}",
            "actor_rollout_ref.actor.profiler.enable=true",
            "actor_rollout_ref.actor.profiler.ranks=[1]",
            "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true",
        ],
        config_name="arith_demo",
    )
    glob = resolve_role_profilers(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.profiler.tool == "torch" and actor.profiler.save_path == str(tmp_path)
    workers = [TinyTrainer(rank, actor.profiler) for rank in range(2)]
    run_steps(workers, glob, num_steps=3)
    assert traces(tmp_path) == ["step2/actor/train_step_prof_rank-1.json.gz"]


def test_a_role_section_read_apart_from_its_full_config_builds():
    """A role's `nsys.discrete` interpolates the global tool config without a default (upstream's
    YAML); read apart from the full config (as an agent loop reads the rollout section) it is null,
    which reads as False instead of failing the section's build."""
    from omegaconf import OmegaConf

    from verl.trainer.config.loader import compose_config

    full = compose_config(["actor_rollout_ref.rollout.name=hf"], config_name="ppo_trainer")  # unresolved
    apart = OmegaConf.create({"actor_rollout_ref": OmegaConf.to_container(full.actor_rollout_ref)})
    assert apart.actor_rollout_ref.rollout.profiler.tool_config.nsys.discrete is None
    config = omega_conf_to_dataclass(apart.actor_rollout_ref.rollout.profiler, ProfilerConfig)
    assert config.tool_config["nsys"].discrete is False
