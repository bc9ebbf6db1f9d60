"""Upstream's hand-driven `Profiler` (`verl.utils.profiler.torch_profile`, also in `profile`): a
continuous trace lands at <save_path>/<role>/<prefix>_prof_rank-<rank>.json.gz and names the
annotated call; discrete mode writes one trace per call; both upstream signatures construct it."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from omegaconf import OmegaConf

from verl.utils.profiler.config import ProfilerConfig, TorchProfilerToolConfig
from verl.utils.profiler.profile import Profiler


def _events(path) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {event.get("name") for event in json.load(f)["traceEvents"]}


def test_continuous_trace_is_written_on_stop_with_prefix_role_and_rank(tmp_path):
    config = ProfilerConfig(enable=True, save_path=str(tmp_path))
    prof = Profiler(3, config, TorchProfilerToolConfig(contents=["cpu"]), save_file_prefix="actor")

    @prof.annotate("my_update")
    def update(x):
        return x * 2

    prof.start(role="train")
    second = Profiler(4, config, TorchProfilerToolConfig(contents=["cpu"]))
    second.start()  # one continuous trace per process: ignored
    assert prof.check() and not second.check()
    assert update(torch.ones(2)).tolist() == [2.0, 2.0]
    prof.stop()
    assert not prof.check()
    assert "my_update" in _events(tmp_path / "train" / "actor_prof_rank-3.json.gz")


def test_discrete_mode_writes_one_trace_per_annotated_call(tmp_path):
    config = ProfilerConfig(enable=True, save_path=str(tmp_path))
    prof = Profiler(0, config, TorchProfilerToolConfig(contents=["cpu"], discrete=True))
    prof.start()
    assert not prof.check()
    prof.annotate(role="ref")(lambda: torch.zeros(1))()
    assert (tmp_path / "ref" / "prof_rank-0.json.gz").exists()


def test_earlier_signature_takes_the_config_first_and_refuses_enabled_without_tool_config():
    prof = Profiler(OmegaConf.create({"enable": False, "save_path": "unused"}))
    assert prof.rank == 0 and not prof.check()
    with pytest.raises(ValueError, match="no tool_config"):
        Profiler(0, ProfilerConfig(enable=True))
