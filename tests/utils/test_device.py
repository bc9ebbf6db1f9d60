import re
from pathlib import Path

import torch

from verl.utils import device

PKG = Path(__file__).resolve().parents[2] / "verl"


def test_cpu_machine_reports_cpu_and_gloo(monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    assert device.get_device_name() == "cpu"
    assert device.get_dist_backend() == "gloo"
    assert device.get_device() == torch.device("cpu")
    assert "cpu_rss_gb" in device.memory_stats()
    device.empty_cache()
    device.synchronize()


def test_auto_follows_torch(monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "auto")
    assert device.get_device_name() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_unknown_preference_is_a_clear_error():
    try:
        device.set_device_preference("tpu")
    except ValueError as e:
        assert "trainer.device" in str(e) and "auto" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_no_hardcoded_accelerator_outside_device_module():
    """Device code goes through verl/utils/device.py; nothing else names the accelerator."""
    pattern = re.compile(r"""\.cuda\(|["']cuda(:\d+)?["']""")
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "device.py" and path.parent.name == "utils":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(PKG.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "hard-coded accelerator; use verl.utils.device:\n" + "\n".join(offenders)
