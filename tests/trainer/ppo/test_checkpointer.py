"""The driver's Checkpointer alone: layout, tracker, pruning, resume discovery, driver state."""

import os

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo.checkpointer import Checkpointer


class DirWorkerGroup:
    """A stand-in worker group that saves a marker file and records what it loaded."""

    def __init__(self):
        self.loaded = []

    def save_checkpoint(self, path, step, max_to_keep):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.txt"), "w") as f:
            f.write(str(step))

    def load_checkpoint(self, path):
        with open(os.path.join(path, "state.txt")) as f:
            self.loaded.append(int(f.read()))


def _cfg(root, **kw):
    base = dict(default_local_dir=str(root), resume_mode="auto", resume_from_path=None)
    base.update(kw)
    return OmegaConf.create(base)


def test_save_writes_step_dir_tracker_and_driver_state_and_load_returns_it(tmp_path):
    actor, critic = DirWorkerGroup(), DirWorkerGroup()
    ckpt = Checkpointer(_cfg(tmp_path), actor, critic)
    step_dir = ckpt.save(3, {"global_steps": 3, "x": torch.tensor([1.5])})
    assert step_dir == os.path.join(str(tmp_path), "global_step_3")
    assert sorted(os.listdir(step_dir)) == ["actor", "critic", "data.pt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    actor2, critic2 = DirWorkerGroup(), DirWorkerGroup()
    state = Checkpointer(_cfg(tmp_path), actor2, critic2).load()
    assert state["global_steps"] == 3 and state["x"].tolist() == [1.5]
    assert state["step_dir"] == step_dir
    assert actor2.loaded == [3] and critic2.loaded == [3]


def test_max_actor_ckpt_to_keep_prunes_oldest_steps(tmp_path):
    ckpt = Checkpointer(_cfg(tmp_path, max_actor_ckpt_to_keep=2), DirWorkerGroup())
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"global_steps": step})
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("global_step_")) == [
        "global_step_3",
        "global_step_4",
    ]


def test_resume_latest_in_auto_mode_and_nothing_when_disabled(tmp_path):
    ckpt = Checkpointer(_cfg(tmp_path), DirWorkerGroup())
    assert ckpt.load() is None  # nothing saved yet
    ckpt.save(1, {"global_steps": 1})
    ckpt.save(2, {"global_steps": 2})
    assert ckpt.load()["global_steps"] == 2
    assert Checkpointer(_cfg(tmp_path, resume_mode="disable"), DirWorkerGroup()).load() is None


def test_resume_path_mode_loads_the_named_step_and_rejects_bad_paths(tmp_path):
    Checkpointer(_cfg(tmp_path), DirWorkerGroup()).save(1, {"global_steps": 1})
    Checkpointer(_cfg(tmp_path), DirWorkerGroup()).save(2, {"global_steps": 2})
    named = Checkpointer(
        _cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(tmp_path / "global_step_1")), DirWorkerGroup()
    )
    assert named.load()["global_steps"] == 1
    with pytest.raises(ValueError, match="global_step_N"):
        Checkpointer(_cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(tmp_path)), DirWorkerGroup()).load()
    with pytest.raises(FileNotFoundError):
        Checkpointer(
            _cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(tmp_path / "global_step_9")),
            DirWorkerGroup(),
        ).load()
    with pytest.raises(ValueError, match="resume_mode='bogus'"):
        Checkpointer(_cfg(tmp_path, resume_mode="bogus"), DirWorkerGroup()).load()
