"""verl.workers.rollout.vllm_rollout.utils.build_cli_args_from_config, and the package's import paths."""

import json
import subprocess
import sys

from omegaconf import OmegaConf

from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config


def test_flags_follow_the_value_types_in_the_configs_order():
    config = {
        "model": "/models/m",
        "tensor-parallel-size": 2,
        "gpu-memory-utilization": 0.5,
        "enforce-eager": True,
        "enable-sleep-mode": False,
        "max-num-seqs": 0,  # a zero is a value, not an absent flag
        "lora-modules": None,
        "cuda-graph-sizes": (1, 2, 4),
        "allowed-origins": [],
    }
    assert build_cli_args_from_config(config) == [
        "--model", "/models/m", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5",
        "--enforce-eager", "--max-num-seqs", "0", "--cuda-graph-sizes", "1", "2", "4",
    ]  # fmt: skip


def test_omegaconf_containers_are_lists_and_json_objects():
    config = OmegaConf.create(
        {"cuda-graph-sizes": [8, 16], "compilation-config": {"level": 3, "sizes": [1, 2], "on": True}}
    )
    args = build_cli_args_from_config(config)
    assert args[:4] == ["--cuda-graph-sizes", "8", "16", "--compilation-config"]
    assert json.loads(args[4]) == {"level": 3, "sizes": [1, 2], "on": True} and len(args) == 5


def test_the_package_keeps_the_module_import_paths_and_does_not_import_vllm():
    code = (
        "import sys\n"
        "from verl.workers.rollout.vllm_rollout import vLLMRollout, vllm_engine_kwargs, build_cli_args_from_config\n"
        "from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout as inner\n"
        "from verl.workers.rollout import get_rollout_class\n"
        "assert inner is vLLMRollout and get_rollout_class('vllm') is vLLMRollout\n"
        "assert 'vllm' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
