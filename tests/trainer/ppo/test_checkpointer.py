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
    base = dict(
        default_local_dir=str(root),
        resume_mode="auto",
        resume_from_path=None,
        max_actor_ckpt_to_keep=None,
        max_critic_ckpt_to_keep=None,
    )
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


class BackgroundWorkerGroup(DirWorkerGroup):
    """A stand-in for a group writing in the background: `save_checkpoint` returns at once, and the
    directory appears when the test calls `complete()` (or the write fails with `fail`)."""

    def __init__(self, ranks=2):
        super().__init__()
        self.ranks, self.pending, self.fail, self.max_to_keep = ranks, None, None, []

    def save_checkpoint(self, path, step, max_to_keep):
        self.max_to_keep.append(max_to_keep)
        self.pending = (path, step)

    def complete(self):
        super().save_checkpoint(*self.pending, None)
        self.pending = None

    def finish_checkpoint(self, wait):
        if self.fail is not None:
            self.pending = None
            raise self.fail
        if self.pending is not None and wait:
            self.complete()
        return [self.pending is None] * self.ranks


def _tracker(root):
    path = root / "latest_checkpointed_iteration.txt"
    return path.read_text().strip() if path.exists() else None


def test_async_save_moves_the_tracker_only_once_every_group_has_finished_writing(tmp_path):
    actor, critic = BackgroundWorkerGroup(), BackgroundWorkerGroup()
    ckpt = Checkpointer(_cfg(tmp_path, max_actor_ckpt_to_keep=1), actor, critic, async_save=True)
    ckpt.save(1, {"global_steps": 1})
    assert _tracker(tmp_path) is None and not (tmp_path / "global_step_1" / "data.pt").exists()
    assert not ckpt.finish_pending(wait=False)  # nothing written yet
    actor.complete()
    assert not ckpt.finish_pending(wait=False) and _tracker(tmp_path) is None  # the critic is still writing
    critic.complete()
    assert ckpt.finish_pending(wait=False) and _tracker(tmp_path) == "1"
    # the workers get no retention limit: the driver prunes after the tracker moved
    assert actor.max_to_keep == critic.max_to_keep == [None]

    ckpt.save(2, {"global_steps": 2})
    assert _tracker(tmp_path) == "1" and (tmp_path / "global_step_1").is_dir(), "the tracked step is kept"
    ckpt.save(3, {"global_steps": 3})  # waits for step 2 first: one write in flight
    assert _tracker(tmp_path) == "2" and not (tmp_path / "global_step_1").exists()
    assert ckpt.finish_pending(wait=True) and _tracker(tmp_path) == "3"
    assert sorted(os.listdir(tmp_path / "global_step_3")) == ["actor", "critic", "data.pt"]
    assert Checkpointer(_cfg(tmp_path), DirWorkerGroup()).load()["global_steps"] == 3


def test_a_failed_background_write_is_raised_and_the_previous_step_stays_the_latest(tmp_path):
    actor = BackgroundWorkerGroup()
    ckpt = Checkpointer(_cfg(tmp_path), actor, async_save=True)
    ckpt.save(1, {"global_steps": 1})
    ckpt.finish_pending(wait=True)
    ckpt.save(2, {"global_steps": 2})
    actor.fail = RuntimeError("writing checkpoint .../global_step_2/actor in the background failed")
    with pytest.raises(RuntimeError, match="global_step_2/actor in the background failed"):
        ckpt.finish_pending(wait=False)
    assert _tracker(tmp_path) == "1"
    assert Checkpointer(_cfg(tmp_path), DirWorkerGroup()).load()["global_steps"] == 1
    assert ckpt.finish_pending(wait=True)  # reported once, not again at the end of the run


def _tree(root):
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
        for d, _, files in os.walk(root)
        for f in files
    }


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_default_hdfs_dir_gets_a_copy_of_each_complete_step_and_keeps_old_ones(tmp_path, scheme):
    local, remote = tmp_path / "local", tmp_path / "remote"
    cfg = _cfg(local, max_actor_ckpt_to_keep=1, default_hdfs_dir=f"{scheme}{remote}")
    actor = BackgroundWorkerGroup()
    ckpt = Checkpointer(cfg, actor, BackgroundWorkerGroup(), async_save=True)
    ckpt.save(1, {"global_steps": 1, "x": torch.arange(3)})
    assert not remote.exists(), "nothing is copied before the step is complete"
    ckpt.finish_pending(wait=True)
    ckpt.save(2, {"global_steps": 2})
    ckpt.finish_pending(wait=True)
    assert _tree(remote / "global_step_2") == _tree(local / "global_step_2") != {}
    assert sorted(os.listdir(remote)) == ["global_step_1", "global_step_2", "latest_checkpointed_iteration.txt"]
    assert _tracker(remote) == "2" and not (local / "global_step_1").exists()
    # the copy is a checkpoint directory of its own: training resumes from it
    state = Checkpointer(_cfg(remote), DirWorkerGroup(), DirWorkerGroup()).load()
    assert state["global_steps"] == 2


def test_default_hdfs_dir_on_hdfs_is_put_with_the_hdfs_command(tmp_path, monkeypatch):
    """A stand-in `hdfs` on PATH with the Hadoop CLI's semantics: `-put -f SRC DIR` puts SRC into an existing DIR."""
    import stat
    import textwrap

    remote = tmp_path / "namenode"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "hdfs"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/usr/bin/env python3
            import os, shutil, sys
            args = sys.argv[2:]
            open({str(tmp_path / "calls.log")!r}, "a").write(" ".join(args) + "\\n")
            loc = lambda p: p.replace("hdfs://nn", {str(remote)!r}) if p.startswith("hdfs://") else p
            if args[:2] == ["-mkdir", "-p"]:
                os.makedirs(loc(args[2]), exist_ok=True); sys.exit(0)
            if args[:2] == ["-put", "-f"]:
                src, dst = args[2], loc(args[3])
                if os.path.isdir(dst):
                    dst = os.path.join(dst, os.path.basename(src))
                (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst); sys.exit(0)
            sys.exit(2)
            """
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    local = tmp_path / "local"
    ckpt = Checkpointer(_cfg(local, default_hdfs_dir="hdfs://nn/ckpt"), DirWorkerGroup())
    ckpt.save(4, {"global_steps": 4})
    assert _tree(remote / "ckpt" / "global_step_4") == _tree(local / "global_step_4") != {}
    assert _tracker(remote / "ckpt") == "4"
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0] == "-mkdir -p hdfs://nn/ckpt"
    assert calls[1] == f"-put -f {local / 'global_step_4'} hdfs://nn/ckpt"
