import re
from pathlib import Path

import pytest
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


def test_group_backend_adds_gloo_for_host_tensors_on_cuda_only():
    assert device.group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert device.group_backend("cpu") == "gloo"


@pytest.mark.parametrize(
    ("backend", "handles_cpu"),
    [
        ("gloo", True),
        ("nccl", False),
        ("cpu:gloo,cuda:nccl", True),
        ("cuda:nccl,cpu:gloo", True),
        ("cuda:nccl", False),
        ("mpi", True),
        ("undefined", False),
    ],
)
def test_group_handles_cpu_reads_single_and_per_device_backends(backend, handles_cpu):
    assert device.group_handles_cpu(backend) is handles_cpu


def test_collective_device_of_a_gloo_group_is_the_host(monkeypatch):
    import torch.distributed as dist

    from tests.distributed_helpers import free_port

    monkeypatch.setenv("VERL_DEVICE", "cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert device.collective_device() == torch.device("cpu")
        assert device.collective_device(dist.new_group([0])) == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_local_device_index_is_local_rank_unless_ray_names_the_gpu():
    assert device.local_device_index(local_rank=5, device_count=4) == 1
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: every GPU of the node is visible; Ray's id decides
    assert device.local_device_index(local_rank=0, device_count=8, ray_gpu_ids=[3]) == 3
    assert device.local_device_index(local_rank=0, device_count=8, ray_gpu_ids=["6"]) == 6
    # Ray started under CUDA_VISIBLE_DEVICES=4,6: its id 6 is torch's device 1
    assert device.local_device_index(0, 2, ray_gpu_ids=["6"], visible_devices="4,6") == 1
    with pytest.raises(RuntimeError, match="does not list it"):
        device.local_device_index(0, 2, ray_gpu_ids=["5"], visible_devices="4,6")


@pytest.mark.parametrize(("value", "noset"), [("1", True), ("true", True), ("True", True), ("0", False), ("", False)])
def test_ray_noset_variable_is_read_as_ray_reads_it(monkeypatch, value, noset):
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", value)
    assert device._ray_sets_no_visible_devices() is noset


def test_default_compute_dtype_is_float32_on_cpu(monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    assert device.default_compute_dtype() == torch.float32


def test_enable_tf32_switches_cuda_matmuls_only():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has only the allow_tf32 flags")
    saved = (
        matmul.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,
        torch.backends.mkldnn.matmul.fp32_precision,
    )
    try:
        matmul.fp32_precision = "ieee"
        device.enable_tf32()
        assert matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == saved[2]  # CPU matmuls keep full fp32
    finally:
        matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved[:2]


def test_upstream_device_names():
    assert device.is_npu_available is False
    assert device.get_nccl_backend() == "nccl"
    assert device.get_visible_devices_keyword() == "CUDA_VISIBLE_DEVICES"
