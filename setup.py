"""Packaging for verl. Torch is deliberately unpinned here: install the build you want first
(`pip install torch==2.13.0` for CPU, a CUDA wheel on GPU machines), then `pip install -e .`."""

import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("verl/__init__.py").read_text()).group(1)

install_requires = [
    "torch>=2.4",
    "ray[default]>=2.49",
    "hydra-core>=1.3",
    "omegaconf>=2.3",
    "tensordict>=0.8",
    "pyarrow>=15",
    "pandas>=2.0",
    "numpy>=1.26",
    "transformers>=4.56",
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "tqdm>=4.60",
    "codetiming>=1.4",
    "psutil>=5.9",
    "mlflow>=2.10",
    "matplotlib>=3.7",
    "peft>=0.21",  # actor LoRA (imported only when lora_rank > 0)
]

extras_require = {
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "ruff>=0.6",
        "pre-commit>=3",
        "tensorboard>=2.15",
        "wandb>=0.17",
        "megatron-core>=0.16.1,<0.17",  # the megatron backend's CPU tests (0.16 is the newest for Python 3.11)
    ],
    "vllm": ["vllm>=0.10.2"],
    "sglang": ["sglang>=0.4"],
    "mcore": ["megatron-core>=0.16.1"],  # strategy=megatron (docs/megatron.md)
    "bench": ["trl>=1.16,<2", "datasets>=2.18", "accelerate>=1.0"],
    "gpu": ["flash-attn>=2.5", "liger-kernel>=0.5"],
    "trackers": ["tensorboard>=2.15", "wandb>=0.17"],
}

setup(
    name="verl",
    version=version,
    description="Ray single-controller framework for RL post-training of language models (PPO, GRPO, ...)",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["verl", "verl.*"]),
    package_data={"verl": ["trainer/config/*.yaml", "trainer/config/**/*.yaml", "assets/**/*"]},
    include_package_data=True,
    install_requires=install_requires,
    extras_require=extras_require,
)
