"""Upstream's availability checks, `deprecated`, `load_class_from_fqn`, device queries,
`verl.utils.memory_utils` and `verl.utils.torch_dtypes`, on this CPU machine."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from verl.utils import device, import_utils, memory_utils
from verl.utils.torch_dtypes import BFLOAT_LIST, FLOAT_LIST, HALF_LIST, PrecisionType


@pytest.mark.parametrize(
    ("check", "module"),
    [
        (import_utils.is_megatron_core_available, "megatron.core"),
        (import_utils.is_vllm_available, "vllm"),
        (import_utils.is_sglang_available, "sglang"),
        (import_utils.is_trl_available, "trl"),
    ],
)
def test_availability_checks_say_whether_the_package_is_installed(check, module):
    top = module.split(".")[0]
    expected = importlib.util.find_spec(top) is not None and importlib.util.find_spec(module) is not None
    assert check() is expected


def test_deprecated_function_warns_naming_the_replacement_and_still_runs():
    @import_utils.deprecated(replacement="new_add")
    def old_add(a, b):
        """Adds."""
        return a + b

    with pytest.warns(FutureWarning, match=r"Function '.*old_add' is deprecated\. Please use 'new_add' instead\."):
        assert old_add(1, 2) == 3
    assert old_add.__doc__ == "Adds." and old_add.__name__ == "old_add"


def test_deprecated_class_warns_on_construction_only():
    @import_utils.deprecated()
    class Old:
        def __init__(self, x):
            self.x = x

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Old(4).x == 4
    assert len(caught) == 1 and caught[0].category is FutureWarning
    assert "Class '" in str(caught[0].message) and "Please use" not in str(caught[0].message)
    assert isinstance(Old(1), Old)


def test_load_class_from_fqn_loads_and_explains_failures():
    assert import_utils.load_class_from_fqn("collections.OrderedDict") is __import__("collections").OrderedDict
    with pytest.raises(ValueError, match="Expected fully qualified class name"):
        import_utils.load_class_from_fqn("OrderedDict", description="AgentLoopManager")
    with pytest.raises(ImportError, match="Failed to import module 'no_such_pkg_x' for AgentLoopManager"):
        import_utils.load_class_from_fqn("no_such_pkg_x.Cls", description="AgentLoopManager")
    with pytest.raises(AttributeError, match="Class 'Nope' not found in module 'collections'"):
        import_utils.load_class_from_fqn("collections.Nope")


def test_device_queries_on_a_cpu_process(monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    assert device.is_torch_npu_available() is False and device.is_torch_npu_available(check_device=False) is False
    assert device.get_resource_name() == "CPU"
    assert device.get_device_capability() == (None, None)
    device.set_expandable_segments(True)  # no CUDA: nothing to configure, no error


def test_memory_utils_are_no_ops_without_cuda(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    memory_utils.aggressive_empty_cache()
    memory_utils.reset_memory_stats()
    memory_utils.log_memory_usage("x")
    memory_utils.optimize_memory_for_inference()
    memory_utils.optimize_memory_for_training()
    assert memory_utils.get_memory_info() == {}
    with caplog.at_level("WARNING", logger=memory_utils.logger.name):
        memory_utils.enable_memory_visualize()
        sampler = memory_utils.MemorySnapshotSampler(out_dir=str(tmp_path), tag="t")
        assert sampler.dump_memory_snapshot(out_dir=str(tmp_path), sub_dir="s") is None
    assert [r.getMessage() for r in caplog.records] == [
        "[memory_visualize] Memory history recording is only available on CUDA devices",
        "[memory_visualize] is only available on CUDA devices.",
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_memory_utils_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    memory_utils.enable_memory_visualize(trace_alloc_max_entries=1000)
    x = torch.empty(2**20, device=device.get_device())
    info = memory_utils.get_memory_info()
    assert info["allocated_memory_gb"] >= 4 / 1024 and info["total_memory_gb"] > info["reserved_memory_gb"]
    path = memory_utils.MemorySnapshotSampler().dump_memory_snapshot(out_dir=str(tmp_path), tag="t", sub_dir="s")
    assert path is not None and (tmp_path / "s").is_dir() and path.endswith(".pickle")
    del x
    memory_utils.aggressive_empty_cache()
    memory_utils.reset_memory_stats()
    assert device.get_device_capability()[0] >= 7 and device.get_resource_name() == "GPU"


def test_precision_type_classifies_and_converts_every_spelling():
    for names, dtype, short in (
        (HALF_LIST, torch.float16, "fp16"),
        (FLOAT_LIST, torch.float32, "fp32"),
        (BFLOAT_LIST, torch.bfloat16, "bf16"),
    ):
        for name in names:
            assert PrecisionType.to_dtype(name) is dtype
        assert PrecisionType.to_str(dtype) == short
    assert PrecisionType.is_fp16(16) and PrecisionType.is_fp16("float16") and not PrecisionType.is_fp16("bf16")
    assert PrecisionType.is_fp32(torch.float32) and not PrecisionType.is_fp32(torch.float64)
    assert PrecisionType.is_bf16("bfloat16") and not PrecisionType.is_bf16(16)
    assert PrecisionType.supported_types() == ["16", "32", "64", "bf16", "mixed"]
    assert PrecisionType.supported_type("mixed") and PrecisionType.supported_type(16)
    assert not PrecisionType.supported_type("fp8")
    with pytest.raises(RuntimeError, match="unexpected precision: 'fp8'"):
        PrecisionType.to_dtype("fp8")
    with pytest.raises(RuntimeError, match="unexpected precision: torch.float64"):
        PrecisionType.to_str(torch.float64)
