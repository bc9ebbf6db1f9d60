"""The config check's rules for vision-language policies (verl/trainer/config/validate_multimodal.py),
on upstream's own launch sets with the model swapped for the local tiny-vl preset (a real Qwen2.5-VL
config.json): the FSDP + vLLM sets validate, every other path is refused in one line naming the key."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from upstream_scripts import our_config, script_sets

from verl.trainer.config import ConfigError, ConfigWarning, load_ppo_config

V = "volcengine/verl:examples/"
SETS = {e.script: e for e in script_sets()}
MEGATRON = "actor_rollout_ref.actor.strategy=megatron with the vision-language model"
SGLANG = "actor_rollout_ref.rollout.name=sglang with the vision-language model"
MULTI_TURN = "actor_rollout_ref.rollout.multi_turn.enable=true with the vision-language model"


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from verl.models.factory import make_tiny

    return make_tiny("tiny-vl", str(tmp_path_factory.mktemp("tiny-vl")))


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tools") / "tools.yaml"
    path.write_text("tools: []\n")
    return str(path)


def _validate(script: str, model: str, tools: str):
    """Our config of the set with the model path (and the files the check opens) replaced; None or the ConfigError."""
    entry = SETS[script]
    subs = {"actor_rollout_ref.model.path": model}
    for text in entry.overrides:
        key = text.split("=", 1)[0].lstrip("+~")
        if key.endswith(("tool_config_path", "interaction_config_path", "dist_checkpointing_path")):
            subs[key] = tools
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        try:
            our_config(entry, subs)
        except ConfigError as e:
            return e
    return None


@pytest.mark.parametrize(
    "script",
    [
        f"{V}grpo_trainer/run_qwen2_5_vl-7b.sh",
        f"{V}grpo_trainer/run_qwen2_5_vl-7b_freeze_vision.sh",
        f"{V}grpo_trainer/run_qwen2_5_vl-7b_lora.sh",
        f"{V}grpo_trainer/run_qwen2_5_vl-7b_seq_balance.sh",
    ],
)
def test_upstreams_qwen2_5_vl_fsdp_sets_validate_with_a_vision_language_model(script, tiny_vl, tools):
    assert _validate(script, tiny_vl, tools) is None


@pytest.mark.parametrize(
    "script, expected",
    [
        (f"{V}grpo_trainer/run_qwen2_5_vl-7b-megatron.sh", [MEGATRON]),
        (f"{V}grpo_trainer/run_qwen3_vl-8b-megatron.sh", [MEGATRON]),
        (f"{V}grpo_trainer/run_qwen2_5_vl-7b-sglang.sh", [SGLANG]),
        (f"{V}sglang_multiturn/geo3k/run_qwen2.5-3b_geo3k_multiturn.sh", [SGLANG, MULTI_TURN]),
    ],
)
def test_vision_language_paths_not_built_here_are_refused_naming_the_key(script, expected, tiny_vl, tools):
    error = _validate(script, tiny_vl, tools)
    assert error is not None
    vision_lines = [e for e in error.errors if "vision-language" in e]
    assert [e[: len(p)] for e, p in zip(vision_lines, expected)] == expected, error.errors
    assert len(vision_lines) == len(expected)
    assert "/tiny-vl" in vision_lines[0]


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory) -> str:
    from verl.models.factory import make_tiny

    return make_tiny("tiny-qwen3-vl", str(tmp_path_factory.mktemp("tiny-qwen3-vl")))


def test_a_qwen3_vl_policy_validates_on_the_fsdp_sets_and_its_megatron_sets_say_why_not(tiny_qwen3_vl, tools):
    """Upstream runs Qwen3-VL on Megatron only; its FSDP Qwen2.5-VL sets with a Qwen3-VL model validate here,
    and the Qwen3-VL Megatron sets are refused for the backend alone, not for the family."""
    for script in (f"{V}grpo_trainer/run_qwen2_5_vl-7b.sh", f"{V}grpo_trainer/run_qwen2_5_vl-7b_seq_balance.sh"):
        assert _validate(script, tiny_qwen3_vl, tools) is None
    for script in (f"{V}grpo_trainer/run_qwen3_vl-8b-megatron.sh", f"{V}grpo_trainer/run_qwen3_vl-30b-megatron.sh"):
        error = _validate(script, tiny_qwen3_vl, tools)
        assert error is not None
        vision_lines = [e for e in error.errors if "vision-language" in e]
        assert len(vision_lines) == 1 and vision_lines[0].startswith(MEGATRON), error.errors


def test_the_same_sets_with_a_text_model_meet_no_vision_rule(tmp_path, tools):
    """The rules read the model's config.json: a local text-only model is not a vision-language one."""
    from verl.models.factory import make_tiny

    text_model = make_tiny("tiny", str(tmp_path / "tiny"))
    for script in (f"{V}grpo_trainer/run_qwen2_5_vl-7b-sglang.sh", f"{V}grpo_trainer/run_qwen2_5_vl-7b-megatron.sh"):
        error = _validate(script, text_model, tools)
        assert error is None or not any("vision-language" in e for e in error.errors), error.errors


def test_a_reward_model_and_agent_loop_files_are_refused_with_a_vision_language_policy(tiny_vl, tmp_path):
    agents = tmp_path / "agents.yaml"
    agents.write_text("- name: mine\n  _target_: somewhere.Loop\n")
    base = [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={tiny_vl}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    ]
    with pytest.raises(ConfigError) as info:
        load_ppo_config(
            [
                *base,
                "reward_model.enable=true",
                f"reward_model.model.path={tiny_vl}",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agents}",
            ]
        )
    lines = [e for e in info.value.errors if "vision-language" in e]
    assert [e.split(" ", 1)[0] for e in lines] == [
        "actor_rollout_ref.rollout.agent.agent_loop_config_path",
        "reward_model.enable=true",
    ], info.value.errors
    # GRPO with the built-in engine on FSDP: nothing to refuse
    load_ppo_config([*base, "actor_rollout_ref.rollout.name=hf", "trainer.device=cpu"])


def test_a_vision_language_family_other_than_qwen2_vl_is_refused(tiny_vl, tmp_path, tools):
    """GLM-4.1V's config (here tiny-vl's with GLM-4.1V's model type): its positions are not Qwen2-VL's."""
    import json

    config = json.loads((Path(tiny_vl) / "config.json").read_text())
    config["model_type"] = "glm4v"
    (tmp_path / "config.json").write_text(json.dumps(config))
    error = _validate(f"{V}grpo_trainer/run_glm41v_9b.sh", str(tmp_path), tools)
    assert error is not None
    assert [e for e in error.errors if "vision-language" in e] == [
        f"actor_rollout_ref.model.path={tmp_path} is a vision-language model of type 'glm4v': only the Qwen-VL "
        "families (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe) are built here (their multimodal rotary positions "
        "and image inputs); train a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE model"
    ]


def test_a_text_only_critic_and_ulysses_are_refused_with_a_vision_language_policy(tiny_vl, tmp_path):
    from verl.models.factory import make_tiny

    text_model = make_tiny("tiny", str(tmp_path / "tiny"))
    base = [
        f"actor_rollout_ref.model.path={tiny_vl}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.model.use_remove_padding=true",
        "trainer.n_gpus_per_node=2",
        "algorithm.adv_estimator=gae",
    ]
    with pytest.raises(ConfigError) as info:
        load_ppo_config(
            [*base, f"critic.model.path={text_model}", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
        )
    lines = [e for e in info.value.errors if "vision-language" in e]
    assert [e.split(" ", 1)[0] for e in lines] == [
        f"critic.model.path={text_model}",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    ], info.value.errors
    assert "needs a vision tower" in lines[0] and "does not split image features" in lines[1]
    # a vision-language critic (GAE) is accepted
    config = load_ppo_config([*base, f"critic.model.path={tiny_vl}"])
    assert config.algorithm.adv_estimator == "gae"
