"""Security: checkpoints load without running code from them, nothing serves HTTP unless asked, and the
docs say what runs user code.

A malicious checkpoint is built the way an attacker would: a pickle whose `__reduce__` calls a
function that leaves a marker file. Loading it must fail with `UnsafeCheckpointError` and the
marker must not appear.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from reliability_helpers import ROOT

from verl.utils.checkpoint.safe_load import UnsafeCheckpointError, dcp_load, dcp_metadata, torch_load


class _Payload:
    """Unpickling this creates `marker` (stands in for arbitrary code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_driver_and_worker_state_files_load_with_weights_only(tmp_path):
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    state = {"rng": BaseCheckpointManager.get_rng_state(), "global_steps": 7}
    torch.save(state, tmp_path / "data.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    BaseCheckpointManager.load_rng_state(torch_load(str(tmp_path / "data.pt"), "state")["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_state_file_with_a_code_payload_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"global_steps": 1, "rng": _Payload(marker)}, tmp_path / "data.pt")
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True"):
        torch_load(str(tmp_path / "data.pt"), "driver checkpoint state")
    assert not marker.exists()


def _dcp_checkpoint(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():  # DCP notes that it saves in a single process: the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(get_model_state_dict(model), checkpoint_id=str(path / "model"))
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(path / "optim"))
    return model, optimizer


def test_sharded_checkpoints_load_through_the_safe_reader(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optimizer = _dcp_checkpoint(tmp_path)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    fresh(torch.randn(3, 4)).sum().backward()
    fresh_optimizer.step()
    model_state = get_model_state_dict(fresh)
    optim_state = get_optimizer_state_dict(fresh, fresh_optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(model_state, str(tmp_path / "model"))
        dcp_load(optim_state, str(tmp_path / "optim"))
    for name, tensor in get_model_state_dict(model).items():
        assert torch.equal(model_state[name], tensor)
    assert optim_state["param_groups"][0]["lr"] == 1e-3 and optim_state["param_groups"][0]["betas"] == (0.8, 0.9)


def test_sharded_checkpoint_metadata_with_a_code_payload_is_refused_and_not_run(tmp_path):
    _dcp_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    metadata_file = tmp_path / "model" / ".metadata"
    metadata_file.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match="pathlib.Path.touch|Path.touch|touch"):
        dcp_metadata(str(tmp_path / "model"))
    with pytest.raises(UnsafeCheckpointError):
        dcp_load({"0.weight": torch.empty(4, 4)}, str(tmp_path / "model"))
    assert not marker.exists()


def test_no_checkpoint_loader_in_verl_unpickles_without_weights_only():
    """The guard for the two tests above: every load in verl/ goes through the safe loaders."""
    offenders = []
    for path in (ROOT / "verl").rglob("*.py"):
        text = path.read_text()
        for pattern in (r"weights_only\s*=\s*False", r"\bpickle\.loads?\(", r"torch\.load\("):
            for match in re.finditer(pattern, text):
                if match.group(0) == "torch.load(" and "weights_only=True" in text[match.end() : match.end() + 200]:
                    continue
                line = text[: match.start()].count("\n") + 1
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
    allowed = {
        "verl/utils/checkpoint/safe_load.py",  # the safe loaders themselves
        "verl/protocol/_wire.py",  # DataProto's Ray transport (the pickles its own processes wrote)
        "verl/protocol/_data_proto.py",  # upstream's DataProto.load_from_disk (documented: trusted files)
        "verl/single_controller/base/worker.py",  # checks that an exception pickles; loads no file
        # the shared-memory channel: the same pickles Ray would carry, between the same processes,
        # through 0600 segments of the same user; no checkpoint or other file is loaded
        "verl/single_controller/shm.py",
        # copies of its own in-process Hydra composition (bytes it pickled itself); reads no file
        "verl/trainer/config/loader.py",
    }
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []


def test_ray_serves_no_dashboard_and_a_dashboard_binds_localhost_unless_configured():
    from verl.trainer.config import load_ppo_config
    from verl.trainer.main_ppo import _ray_init_kwargs

    kwargs = _ray_init_kwargs(load_ppo_config(["trainer.progress_bar=false"], config_name="arith_demo"))
    assert kwargs["include_dashboard"] is False and kwargs["dashboard_host"] == "127.0.0.1"
    assert kwargs["runtime_env"]["env_vars"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    opened = _ray_init_kwargs(
        load_ppo_config(
            ["+ray_kwargs.ray_init.include_dashboard=true", "+ray_kwargs.ray_init.dashboard_host=0.0.0.0"],
            config_name="arith_demo",
        )
    )
    assert opened["include_dashboard"] is True and opened["dashboard_host"] == "0.0.0.0"


def test_docs_say_what_runs_user_code():
    reliability = (ROOT / "docs" / "reliability.md").read_text()
    assert "`custom_reward_function.path` executes" in reliability
    assert "sandbox" in reliability
    reference = (ROOT / "docs" / "config_reference.md").read_text()
    assert "run in the trainer's processes with your permissions" in reference


def test_the_payload_would_have_run_without_the_guard(tmp_path):
    """The attack in these tests is real: plain unpickling creates the marker."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()
    os.remove(marker)
