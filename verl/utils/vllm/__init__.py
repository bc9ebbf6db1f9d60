"""Helpers around the vLLM package (upstream's `verl.utils.vllm`); importing this package never imports vLLM.

`is_version_ge` reads installed package versions from their metadata; `verl.utils.vllm.patch`
holds the fixes applied to a live vLLM model (imported on use, after the engine exists).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

__all__ = ["is_version_ge"]


def is_version_ge(pkg: str = "vllm", minver: str = "0.7.3") -> bool:
    """Whether the installed `pkg` is at version `minver` or later (pre-releases count as theirs:
    0.8.0rc1 < 0.8.0). Raises ModuleNotFoundError when `pkg` is not installed."""
    try:
        installed = version(pkg)
    except PackageNotFoundError:
        raise ModuleNotFoundError(
            f"is_version_ge({pkg!r}, {minver!r}): the package {pkg!r} is not installed in this environment"
        ) from None
    return Version(installed) >= Version(minver)
