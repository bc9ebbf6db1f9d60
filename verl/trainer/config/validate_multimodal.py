"""Rules for vision-language policies (docs/multimodal.md), checked before anything starts.

Multi-modal training is built on one path: the FSDP actor and reference without Ulysses sequence
parallelism, an FSDP critic over a vision-language model when the estimator needs one, the built-in
(`hf`) or vLLM rollout engine, single-turn
generation, a rule reward; the model family is Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense or MoE). Every other combination with a
vision-language policy is refused here, naming the key and what to set instead, rather than run without the images.

Design decisions:
- Whether the policy is a vision-language model is read from its `config.json` (a `vision_config`
  and an image token id; `verl.utils.vision.is_vision_language_config`'s rule). The config check
  reads it when `model.path` (or `model.hf_config_path`) is a local directory; for a hub id the
  `TaskRunner` applies the same rules (`vision_language_problems`) to the loaded HF config before
  any worker starts, so a hub id fails a few seconds later, never after the workers have loaded.
- Videos are a property of the data, not of the config: the pre-flight check refuses a data file
  that holds a `data.video_key` column for a vision-language policy (verl/trainer/preflight.py).
"""

from __future__ import annotations

import json
import os

from verl.trainer.config.validate_batches import need_critic
from verl.utils.ulysses_keys import role_sp

_ARR = "actor_rollout_ref"

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
"""Vision-language families whose positions `verl.utils.vision.vl_position_ids` computes (Qwen2-VL's M-RoPE, which
Qwen3-VL keeps for images) and whose image inputs the actor, reference and built-in engine pass through."""


def local_hf_config(model: dict) -> dict | None:
    """The HF config.json of a model section (`hf_config_path`, else `path`) when it is a readable
    local directory; None otherwise (a hub id, or a file the model loader will report)."""
    path = model.get("hf_config_path") or model.get("path")
    file = os.path.join(os.path.expanduser(str(path)), "config.json") if path else None
    if not file or not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def is_vision_language(hf_config: dict) -> bool:
    """A vision tower and an image token: the same rule as `verl.utils.vision.is_vision_language_config`."""
    return hf_config.get("vision_config") is not None and hf_config.get("image_token_id") is not None


def vision_language_problems(c: dict, model_name: str, model_type: str | None) -> list[str]:
    """One line per setting of the plain config `c` that cannot train the vision-language policy
    `model_name` (its path, for the messages) of HF `model_type`."""
    arr = c[_ARR]
    what = f"with the vision-language model {model_name}"
    problems = []
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(
            f"{_ARR}.model.path={model_name} is a vision-language model of type {model_type!r}: only the Qwen-VL "
            f"families ({', '.join(SUPPORTED_MODEL_TYPES)}) are built here (their multimodal rotary positions and "
            "image inputs); train a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE model"
        )
    if arr["actor"]["strategy"] == "megatron":
        problems.append(
            f"{_ARR}.actor.strategy=megatron {what}: Megatron training of vision-language models is not built here "
            f"(upstream's goes through mbridge); use the FSDP actor: {_ARR}.actor.strategy=fsdp2 (ppo_trainer.yaml)"
        )
    if need_critic(c):
        critic_model = (c.get("critic") or {}).get("model") or {}
        critic_config = local_hf_config(critic_model)
        if critic_config is not None and not is_vision_language(critic_config):
            problems.append(
                f"critic.model.path={critic_model.get('path')} is a text-only model {what}: the critic reads "
                "the same image batches as the actor and needs a vision tower; set critic.model.path to a "
                "vision-language model (e.g. the actor's)"
            )
    try:
        sp, sp_key = role_sp(arr["actor"], f"{_ARR}.actor")
    except ValueError:
        sp = 1  # two different sizes: the Ulysses check reports it
    if sp > 1:
        problems.append(
            f"{sp_key}={sp} {what}: the sequence-parallel forward does not split image features across ranks; set "
            f"{sp_key}=1 (actor.use_dynamic_bsz bounds the memory instead)"
        )
    rollout = arr["rollout"]
    if rollout["name"] == "sglang":
        problems.append(
            f"{_ARR}.rollout.name=sglang {what}: generation with images runs on the built-in engine and vLLM only; "
            f"set {_ARR}.rollout.name=hf or vllm"
        )
    multi_turn = (rollout.get("multi_turn") or {}).get("enable")
    agent_file = (rollout.get("agent") or {}).get("agent_loop_config_path")
    if multi_turn or agent_file:
        key = "multi_turn.enable=true" if multi_turn else "agent.agent_loop_config_path"
        problems.append(
            f"{_ARR}.rollout.{key} {what}: agent loops do not pass images to the model here; generate single-turn "
            f"(multi_turn.enable=false, no agent_loop_config_path)"
        )
    reward_model = c.get("reward_model") or {}
    if reward_model.get("enable"):
        problems.append(
            f"reward_model.enable=true {what}: a reward model here scores the text only, without the prompt's "
            "images; score with a rule (reward_model.enable=false and custom_reward_function.path, or a data_source "
            "that verl.utils.reward_score knows)"
        )
    return problems


def check_multimodal(c: dict, errors: list[str]) -> None:
    """The rules above, when the policy's config.json is local and describes a vision-language model."""
    model = c[_ARR]["model"]
    hf_config = local_hf_config(model)
    if hf_config is None or not is_vision_language(hf_config):
        return
    name = str(model.get("hf_config_path") or model.get("path"))
    errors.extend(vision_language_problems(c, name, hf_config.get("model_type")))
