"""Module-scoped tiny models for the rollout tests (helpers: rollout_helpers.py)."""

from __future__ import annotations

import pytest

from tests.workers.rollout.rollout_helpers import build_model


@pytest.fixture(scope="module")
def qwen2_model():
    return build_model("qwen2")


@pytest.fixture(scope="module")
def llama_model():
    return build_model("llama")
