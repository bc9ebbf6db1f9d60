"""Upstream's small utility names that recipes import: memory logging, nvtx detection, hdfs_io."""

from __future__ import annotations

import importlib.util
import logging

from verl.utils import hdfs_io
from verl.utils.import_utils import is_nvtx_available
from verl.utils.profiler import GPUMemoryLogger, log_gpu_memory_usage


def test_log_gpu_memory_usage_logs_the_process_memory_on_the_chosen_rank(caplog):
    log = logging.getLogger("test.memory")
    with caplog.at_level(logging.INFO, logger="test.memory"):
        log_gpu_memory_usage("after init", logger=log, level=logging.INFO)
        log_gpu_memory_usage("not on this rank", logger=log, level=logging.INFO, rank=1)  # not distributed: rank 0
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["after init"]
    assert "cpu_rss" in caplog.records[0].getMessage() and "GiB" in caplog.records[0].getMessage()


def test_gpu_memory_logger_wraps_a_call_with_two_lines(caplog):
    log = logging.getLogger("test.memory")

    @GPUMemoryLogger(role="actor", logger=log, level=logging.INFO)
    def update(x, y=1):
        """Docstring kept."""
        return x + y

    with caplog.at_level(logging.INFO, logger="test.memory"):
        assert update(2, y=3) == 5
    heads = [r.getMessage().split(":")[0] for r in caplog.records]
    assert heads == ["Before actor update", "After actor update"] and update.__doc__ == "Docstring kept."


def test_is_nvtx_available_says_whether_nvtx_imports():
    assert is_nvtx_available() == (importlib.util.find_spec("nvtx") is not None)


def test_hdfs_io_handles_local_paths(tmp_path):
    target = tmp_path / "a" / "b"
    hdfs_io.makedirs(str(target), exist_ok=True)
    (target / "f.txt").write_text("x")
    assert hdfs_io.exists(str(target / "f.txt")) and not hdfs_io.exists(str(tmp_path / "missing"))
    hdfs_io.copy(str(target / "f.txt"), str(tmp_path / "g.txt"))
    assert (tmp_path / "g.txt").read_text() == "x"


def test_dataset_package_exports_upstream_s_dataset_classes():
    import subprocess
    import sys

    from verl.utils.dataset import RLHFDataset, SFTDataset
    from verl.utils.dataset.rl_dataset import RLHFDataset as rl
    from verl.utils.dataset.sft_dataset import SFTDataset as sft

    assert RLHFDataset is rl and SFTDataset is sft
    code = "import sys, verl.utils.dataset.arith; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"  # a task generator stays light
