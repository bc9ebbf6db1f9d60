"""Upstream's launch scripts compose and validate here, and compose to upstream's config.

Test data: upstream/launch_scripts.yaml (the override sets of the 165 launch scripts of upstream's
examples/ and of verl-recipe that call main_ppo), upstream/configs/ (the scripts' own configs) and
upstream's composed defaults (upstream/*_leaves.yaml). For each set:

- left out by the issue (hardware this build does not support): refused in one line naming the hardware;
- refused by upstream's own composition (a key its release does not have, ...): not counted;
- otherwise: it composes and validates here, and our config equals upstream's on every key both
  have, except the sets listed in REFUSED with the reason (docs/upstream.md, "Launch scripts").

Values that name files the validator opens (a reward function, a tool config, a checkpoint) are
replaced by files that exist, in both configs.
"""

from __future__ import annotations

import warnings

import pytest
from upstream_scripts import (
    UpstreamRefuses,
    our_config,
    resolved_leaves,
    script_sets,
    upstream_config,
)

from verl.trainer.config import ConfigError, ConfigWarning

V = "volcengine/verl:examples/"
V9 = "verl-project/verl@v0.9.0:examples/"
R = "verl-project/verl-recipe:"

# Sets refused here, with the start of the reason (each a line of docs/upstream.md, "Launch scripts").
REFUSED = {
    # rollout correction without the rollout's log-probs: upstream silently skips the correction, here it is refused
    # Ulysses groups larger than the GPUs the script asks for: upstream's device mesh fails at start-up too
    f"{R}langgraph_agent/example/run_gpt_oss_20b_bf16.sh": "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 does not divide the 2 workers",
    f"{R}langgraph_agent/example/run_qwen2.5_3b.sh": "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 does not divide the 2 workers",
    # a multi-turn tool format upstream's release has no parser for either
    f"{V}sglang_multiturn/search_r1_like/run_qwen2.5-3b_instruct_search_multiturn.sh": "actor_rollout_ref.rollout.multi_turn.format='qwen'",
    # keys upstream's release does not have (removed before it, or added after it); its dataclasses refuse them too
    f"{V}sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_4xgpu_server.sh": "unknown config key 'actor_rollout_ref.rollout.sglang_rollout_mode'",
    f"{V}sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_server.sh": "unknown config key 'actor_rollout_ref.rollout.sglang_rollout_mode'",
    f"{R}deepeyes/run_deepeyes_grpo.sh": "unknown config key 'trainer.rl_logging_board_dir'",
    f"{R}nemo_gym/submit_math.sh": "unknown config key 'actor_rollout_ref.rollout.agent.agent_loop_manager_class'",
    f"{R}nemo_gym/submit_multienv.sh": "unknown config key 'actor_rollout_ref.rollout.agent.agent_loop_manager_class'",
    f"{R}nemo_gym/submit_workplace.sh": "unknown config key 'actor_rollout_ref.rollout.agent.agent_loop_manager_class'",
    # mixture-of-experts sets (expert parallelism is implemented, docs/megatron.md "Mixture of experts"):
    # an expert layout larger than the ranks (upstream's megatron refuses it when it starts)
    f"{R}dapo/test_dapo_qwen3_moe_30b_megatron_fp16.sh": "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=4 x expert_model_parallel_size=8 x pipeline_model_parallel_size=4 = 128 does not divide the 32 ranks",
    # mini-batches that do not split over the data-parallel ranks (upstream fails when it starts)
    f"{V}grpo_trainer/run_deepseek671b_math_megatron_96gb.sh": "actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = 32 x 8 = 256 sequences is not divisible by the 96 data-parallel ranks",
    f"{V}grpo_trainer/run_moonlight16b_math_megatron.sh": "actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = 64 x 5 = 320 sequences is not divisible by the 24 data-parallel ranks",
    # MoE features of other parts not implemented here
    f"{V}gspo_trainer/test_gspo_qwen30b_a3b_ep.sh": "actor_rollout_ref.rollout.expert_parallel_size=4 with rollout.name=vllm and data_parallel_size=4 is not implemented",
    # router replay R3 from SGLang's routing (R3 is implemented with the built-in engine, which records it)
    f"{V}router_replay/run_qwen30_a3b_megatron_sglang.sh": "actor_rollout_ref.actor.router_replay.mode=R3 needs the rollout engine's routing, and only the built-in engine records it here",
    # upstream v0.9's examples (verl-project/verl@v0.9.0):
    # features not implemented here, refused naming the key
    f"{V9}grpo_trainer/run_qwen2-7b_math_megatron_fsdp.sh": "actor_rollout_ref.actor.megatron.use_megatron_fsdp=true is not implemented",
    f"{V9}grpo_trainer/run_qwen3_5_122b_a10b_megatron.sh": "actor_rollout_ref.actor.checkpoint.strict=false is not implemented",
    f"{V9}grpo_trainer/run_qwen3_5_35b_megatron.sh": "actor_rollout_ref.actor.checkpoint.strict=false is not implemented",
    f"{V9}grpo_trainer/run_qwen3_5_397b_megatron.sh": "actor_rollout_ref.actor.checkpoint.strict=false is not implemented",
    f"{V9}mtp_trainer/run_mimo_7b_mtp_rl_vllm_sgl_megatron.sh": "actor_rollout_ref.model.mtp.enable_rollout=true is not implemented",
    f"{V9}on_policy_distillation_trainer/run_qwen3_5_4b_fsdp.sh": "distillation.enabled=true is not implemented",
    f"{V9}on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh": "distillation.enabled=true is not implemented",
    f"{V9}on_policy_distillation_trainer/run_qwen3_8b_megatron.sh": "distillation.enabled=true is not implemented",
    f"{V9}on_policy_distillation_trainer/run_qwen3_8b_mopd_fsdp.sh": "distillation.enabled=true is not implemented",
    f"{V9}on_policy_distillation_trainer/run_qwen3_vl_8b_fsdp.sh": "distillation.enabled=true is not implemented",
    f"{V9}grpo_trainer/run_qwen3_235b_a22b_megatron.sh": "actor_rollout_ref.rollout.expert_parallel_size=64 with rollout.name=vllm and data_parallel_size=8 is not implemented",
    # what upstream's own config classes assert against when the workers start
    f"{V9}grpo_trainer/run_qwen3_30b_a3b_megatron.sh": "actor_rollout_ref.rollout.moe_tensor_parallel_size=2 is for TensorRT-LLM",
    f"{V9}grpo_trainer/run_deepseek_v3_671b_megatron.sh": "actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = 32 x 8 = 256 sequences is not divisible by the 96 data-parallel ranks",
    f"{V9}grpo_trainer/run_moonlight_16b_a3b_megatron.sh": "actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = 64 x 5 = 320 sequences is not divisible by the 24 data-parallel ranks",
}  # fmt: skip

HARDWARE = {"npu": "Ascend NPUs", "trtllm": "TensorRT-LLM", "engine": "which this build of verl does not have"}
FILE_KEYS = ("custom_reward_function.path", "tool_config_path", "interaction_config_path", "dist_checkpointing_path")
SETS = script_sets()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """Stand-ins for the files the validator opens."""
    tmp = tmp_path_factory.mktemp("files")
    (tmp / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    (tmp / "tools.yaml").write_text("tools: []\n")
    adapter = tmp / "lora_adapter"  # what the config check opens of a peft LoRA adapter directory
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}'
    )
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    agents = tmp / "agent.yaml"  # the langgraph recipe's, whose class the start-up check does not import
    agents.write_text("- name: math_expression\n  _target_: recipe.langgraph_agent.example.math_expression.Loop\n")
    return {
        "path": str(tmp / "reward.py"),
        "config": str(tmp / "tools.yaml"),
        "dir": str(tmp),
        "adapter": str(adapter),
        "agents": str(agents),
    }


def substitutes(entry, files: dict) -> dict[str, str]:
    out = {}
    for text in entry.overrides:
        key = text.split("=", 1)[0].lstrip("+~")
        if key.endswith("dist_checkpointing_path"):
            out[key] = files["dir"]
        elif key.endswith("custom_reward_function.path"):
            out[key] = files["path"]
        elif key.endswith("lora_adapter_path"):
            out[key] = files["adapter"]
        elif key.endswith("agent_loop_config_path"):
            out[key] = files["agents"]
        elif key.endswith(FILE_KEYS):
            out[key] = files["config"]
    return out


_OUTCOMES: dict[str, tuple] = {}


def outcome(entry, files):
    """(upstream's config or its refusal, our config or our ConfigError), computed once per set."""
    if entry.script not in _OUTCOMES:
        _OUTCOMES[entry.script] = _outcome(entry, files)
    return _OUTCOMES[entry.script]


def _outcome(entry, files):
    try:
        theirs = upstream_config(entry)
    except UpstreamRefuses as e:
        theirs = e
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        try:
            ours = our_config(entry, substitutes(entry, files))
        except ConfigError as e:
            ours = e
    return theirs, ours


@pytest.mark.parametrize("entry", SETS, ids=[e.script for e in SETS])
def test_upstream_launch_script(entry, files):
    excluded = entry.excluded()
    theirs, ours = outcome(entry, files)
    if excluded in HARDWARE:
        if isinstance(ours, ConfigError) and any(HARDWARE[excluded] in e for e in ours.errors):
            return  # refused in one line naming the hardware
        pytest.skip(f"left out by the issue ({excluded}); it sets no {excluded}-only key")
    if excluded:
        pytest.skip(f"left out by the issue: {excluded}")
    if isinstance(theirs, UpstreamRefuses):
        pytest.skip(f"upstream's own composition refuses it: {theirs}")
    if entry.script in REFUSED:
        assert isinstance(ours, ConfigError), f"{entry.script} now composes and validates: drop it from REFUSED"
        assert any(e.startswith(REFUSED[entry.script]) for e in ours.errors), ours.errors
        return
    assert not isinstance(ours, ConfigError), f"{entry.script} is refused:\n{ours}"
    subs = substitutes(entry, files)
    upstream, here = resolved_leaves(theirs), resolved_leaves(ours)
    skip = {k for k in upstream if any(k.endswith(s) for s in subs) or k == "data.tool_config_path"}
    different = {k: (upstream[k], here[k]) for k in upstream if k in here and k not in skip and upstream[k] != here[k]}
    assert not different, f"{entry.script}: our composed config differs from upstream's (upstream, ours): {different}"


def test_the_counts_reported_in_docs_upstream(files):
    """docs/upstream.md reports these numbers; a change here is a change there."""
    counts = {"accepted": 0, "refused": 0, "excluded": 0, "upstream refuses": 0}
    for entry in SETS:
        theirs, ours = outcome(entry, files)
        if entry.excluded():
            counts["excluded"] += 1
        elif isinstance(theirs, UpstreamRefuses):
            counts["upstream refuses"] += 1
        else:
            counts["refused" if isinstance(ours, ConfigError) else "accepted"] += 1
    assert counts == {"accepted": 160, "refused": 27, "excluded": 36, "upstream refuses": 30}, counts
