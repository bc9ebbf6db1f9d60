"""BaseCheckpointManager retention (register_checkpoint / ensure_checkpoint_capacity) and should_save_ckpt_esi."""

import os
import time

import pytest

from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager, should_save_ckpt_esi


def _dirs(tmp_path, n):
    paths = []
    for i in range(n):
        path = tmp_path / f"global_step_{i}"
        path.mkdir()
        paths.append(str(path))
    return paths


def test_register_checkpoint_keeps_the_newest(tmp_path):
    manager = BaseCheckpointManager(model=None)
    paths = _dirs(tmp_path, 4)
    for path in paths:
        manager.register_checkpoint(path, max_ckpt_to_keep=2)
    assert manager.previous_saved_paths == paths[2:]
    assert [os.path.exists(p) for p in paths] == [False, False, True, True]
    manager.register_checkpoint(paths[2], max_ckpt_to_keep=2)  # saved again: it becomes the newest
    assert manager.previous_saved_paths == [paths[3], paths[2]]
    keep_all = BaseCheckpointManager(model=None)
    (tmp_path / "other").mkdir()
    for path in _dirs(tmp_path / "other", 3):
        keep_all.register_checkpoint(path, max_ckpt_to_keep=None)
    assert len(keep_all.previous_saved_paths) == 3


def test_ensure_checkpoint_capacity_makes_room_before_a_save(tmp_path):
    manager = BaseCheckpointManager(model=None)
    paths = _dirs(tmp_path, 3)
    manager.previous_saved_paths = list(paths)
    manager.ensure_checkpoint_capacity(1)  # never deletes the only checkpoint before its replacement exists
    assert manager.previous_saved_paths == paths
    manager.ensure_checkpoint_capacity(2)
    assert manager.previous_saved_paths == paths[2:] and not os.path.exists(paths[0]) and not os.path.exists(paths[1])


def test_should_save_ckpt_esi_reads_the_expiry_timestamps(monkeypatch):
    monkeypatch.delenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", raising=False)
    monkeypatch.delenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", raising=False)
    assert should_save_ckpt_esi(100.0) is False
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() + 150))
    assert should_save_ckpt_esi(100.0) is True  # 150 s left < 60 s save + 100 s step
    assert should_save_ckpt_esi(50.0) is False  # 150 s left > 110 s
    assert should_save_ckpt_esi(50.0, redundant_time=60) is True
    assert should_save_ckpt_esi(0.0) is False  # no step timed yet
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() - 10))
    assert should_save_ckpt_esi(100.0) is False  # already expired
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "soon")
    assert should_save_ckpt_esi(100.0) is False
    monkeypatch.delenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
    monkeypatch.setenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(int(time.time()) + 150))
    assert should_save_ckpt_esi(100.0) is True and should_save_ckpt_esi(10.0) is False


@pytest.mark.parametrize("keep", [0, -1])
def test_non_positive_limits_keep_everything(tmp_path, keep):
    manager = BaseCheckpointManager(model=None)
    for path in _dirs(tmp_path, 3):
        manager.register_checkpoint(path, max_ckpt_to_keep=keep)
    assert len(manager.previous_saved_paths) == 3
