"""Packaging for verl: version ranges for installing into your own environment.

Torch is deliberately left open here: install the build you want first (`pip install torch==2.13.0`
for CPU, a CUDA wheel on GPU machines), then `pip install -e .`.

These are ranges, not the tested set. `requirements/constraints-py311.txt` holds the exact versions
the test suite passed with (`make install`, `make test`, CI and the Dockerfiles install through it);
`make lock` re-resolves these ranges, runs the tests and rewrites it. Packages whose API is known to
move between releases (transformers, ray, tensordict, megatron-core, vllm) are capped below their
next major release, or their next minor one while they are at 0.x; `make test-latest` tests the
newest versions the ranges allow.
Policy and how to bump: docs/dependencies.md.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("verl/__init__.py").read_text()).group(1)

install_requires = [
    "torch>=2.4",
    "ray[default]>=2.49,<3",
    "hydra-core>=1.3",
    "omegaconf>=2.3",
    "tensordict>=0.8,<0.16",  # 0.x: minor releases change the API
    "pyarrow>=15",
    "pandas>=2.0",
    "datasets>=2.18,<6",  # upstream's requirement: recipes' dataset classes build HF datasets (verl-recipe's ReTool)
    "numpy>=1.26",
    "transformers>=4.56,<6",  # the cache argument was renamed in 5.24: verl/utils/hf_forward.py
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "tqdm>=4.60",
    "codetiming>=1.4",
    "psutil>=5.9",
    "pydantic>=2",  # agent-loop outputs and tool schemas (upstream's models), read when main_ppo imports them
    "matplotlib>=3.7",
    "peft>=0.21",  # actor LoRA (imported only when lora_rank > 0)
    "einops>=0.7",  # verl.utils.attention_utils.rearrange (upstream's, from flash-attn's bert_padding there)
    "torchdata>=0.8",  # upstream's requirement: users' code imports torchdata.stateful_dataloader.StatefulDataLoader
]

extras_require = {
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "pytest-asyncio>=0.23",  # upstream's async tests (`@pytest.mark.asyncio`; upstream's CI runs --asyncio-mode=auto)
        "ruff>=0.6",
        "pre-commit>=3",
        "tensorboard>=2.15",
        "wandb>=0.17",
        "megatron-core>=0.16.1,<0.17",  # the megatron backend's CPU tests (0.16 is the newest for Python 3.11)
        "mlflow>=2.10",  # the tracker's tests
        "swanlab>=0.10.3,<0.11",  # the tracker's swanlab test (offline mode, read back from its run file)
        "prometheus_client>=0.17",  # the rollout's metrics endpoint test
        "math-verify>=0.7",  # verl.utils.reward_score.math_verify's test
        "clearml>=1.16",  # the tracker's clearml test (offline session, read back from its files)
        "fastmcp>=2.10,<5",  # the MCP tools' tests (real MCP servers over stdio and SSE)
    ],
    "vllm": ["vllm>=0.10.2,<0.34"],  # docker/Dockerfile.cuda installs 0.33
    "sglang": ["sglang>=0.4"],
    "mcore": ["megatron-core>=0.16.1,<0.17"],  # strategy=megatron (docs/megatron.md)
    "bench": ["trl>=1.16,<2", "datasets>=2.18", "accelerate>=1.0"],
    "gpu": ["flash-attn>=2.5", "liger-kernel>=0.5"],
    "mlflow": ["mlflow>=2.10"],  # trainer.logger=[...,mlflow]; imported only then
    "swanlab": ["swanlab>=0.10.3,<0.11"],  # trainer.logger=[...,swanlab]; imported only then
    "clearml": ["clearml>=1.16"],  # trainer.logger=[...,clearml]; imported only then
    "prometheus": ["prometheus_client>=0.17"],  # rollout.prometheus.enable; imported only then
    "math": ["math-verify>=0.7"],  # verl.utils.reward_score.math_verify (symbolic answer checking)
    "mcp": ["fastmcp>=2.10,<5"],  # tool configs with `config.type: mcp` (verl.tools.mcp_base_tool)
    "trackers": ["clearml>=1.16", "mlflow>=2.10", "swanlab>=0.10.3,<0.11", "tensorboard>=2.15", "wandb>=0.17"],
}

setup(
    name="verl",
    version=version,
    description="Ray single-controller framework for RL post-training of language models (PPO, GRPO, ...)",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["verl", "verl.*"]),
    package_data={
        "verl": [
            "trainer/config/*.yaml",
            "trainer/config/**/*.yaml",
            "experimental/*/config/*.yaml",
            "assets/**/*",
        ]
    },
    include_package_data=True,
    install_requires=install_requires,
    extras_require=extras_require,
)
