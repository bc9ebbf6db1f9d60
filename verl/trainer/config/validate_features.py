"""Config checks of three upstream features against the rest of the config (what each cannot be
combined with), kept apart from validate.py, which calls `check_feature_combinations`:
`rollout.logprobs_mode` (verl.workers.rollout.sampling), `rollout.skip_rollout`
(verl.trainer.ppo.rollout_skip) and `reward_model.reward_loop_source=importlib`
(verl.workers.reward_manager.reward_loop)."""

from __future__ import annotations


def check_feature_combinations(c: dict, errors: list[str], warns: list[str]) -> None:
    """Append to `errors` what the composed config `c` (a plain dict) combines that these features
    refuse, to `warns` what they change elsewhere."""
    _check_logprobs_mode(c, errors, warns)
    _check_skip_rollout(c, errors)
    _check_reward_loop(c, errors)
    _check_reward_model_with_custom_function(c, errors)


def _check_logprobs_mode(c: dict, errors: list[str], warns: list[str]) -> None:
    """rollout.logprobs_mode reaches the built-in engine and vLLM; SGLang has no such setting."""
    rollout = c["actor_rollout_ref"]["rollout"]
    if rollout["calculate_log_probs"] and rollout["logprobs_mode"] != "processed_logprobs":
        warns.append(
            f"actor_rollout_ref.rollout.logprobs_mode={rollout['logprobs_mode']}: rollout_log_probs hold those values, "
            "and everything that reads them takes them for the sampling log-probs (the training/rollout_probs_diff "
            "metrics, actor.tis_imp_ratio_cap, algorithm.rollout_correction), as upstream does; keep "
            "processed_logprobs unless that is what you want"
        )
    if rollout["name"] == "sglang" and rollout["logprobs_mode"] != "processed_logprobs":
        errors.append(
            f"actor_rollout_ref.rollout.logprobs_mode={rollout['logprobs_mode']} with rollout.name=sglang: "
            "SGLang's engine has no such setting (upstream passes the key to vLLM only), so its log-probs would stay "
            "processed_logprobs; use rollout.name=hf or vllm, or logprobs_mode=processed_logprobs"
        )


def _check_skip_rollout(c: dict, errors: list[str]) -> None:
    """rollout.skip_rollout and skip.rollout replay dumped batches (verl.trainer.ppo.rollout_skip): not with
    a source that draws several batches a step or generates in a pool of its own, and not both at once."""
    legacy = bool(c["actor_rollout_ref"]["rollout"]["skip_rollout"])
    per_step = bool((c.get("skip") or {}).get("rollout", {}).get("enable"))
    if legacy and per_step:
        errors.append(
            "actor_rollout_ref.rollout.skip_rollout=true with skip.rollout.enable=true: both replay dumped rollouts "
            "(one file for every step vs the steps skip.rollout.steps lists); keep one of them"
        )
    for key, on in (("actor_rollout_ref.rollout.skip_rollout", legacy), ("skip.rollout.enable", per_step)):
        if not on:
            continue
        if c["algorithm"]["filter_groups"]["enable"]:
            errors.append(
                f"{key}=true with algorithm.filter_groups.enable=true: dynamic sampling would replay the same "
                "dumped batch again and again (the same groups kept twice, or none ever kept); turn one of them off"
            )
        if c["async_training"]["staleness_threshold"] > 0:
            errors.append(
                f"{key}=true with async_training.staleness_threshold > 0: the rollouts come from the asynchronous "
                "rollout pool, which does not replay dumps; set staleness_threshold=0"
            )


def _check_reward_model_with_custom_function(c: dict, errors: list[str]) -> None:
    """A reward model together with custom_reward_function: upstream's reward loop serves the model to the
    function (verl/experimental/reward_loop/reward_model.py); without the loop it never calls the function."""
    rm, custom = c["reward_model"], c["custom_reward_function"]
    if not rm["enable"] or not custom.get("path"):
        return
    if not rm.get("use_reward_loop", True):
        errors.append(
            f"reward_model.enable=true with reward_model.use_reward_loop=false and custom_reward_function.path="
            f"{custom['path']!r}: the reward model's scores are the reward (upstream's reward managers return them "
            "as they are), so the function would never be called; drop one of the two"
        )
        return
    name = (rm.get("rollout") or {}).get("name")
    if not name or name == "???":
        errors.append(
            f"reward_model.enable=true with custom_reward_function.path={custom['path']!r} serves the reward model "
            "to the function (a generative reward model, reached through reward_router_address), so "
            "reward_model.rollout.name must name its engine: hf (built in), vllm or sglang"
        )


def _check_reward_loop(c: dict, errors: list[str]) -> None:
    """reward_model.reward_loop_source=importlib (a custom reward loop class, verl.workers.reward_manager.reward_loop)."""
    rm = c["reward_model"]
    if rm["reward_loop_source"] != "importlib":
        return
    for key in ("reward_loop_module_path", "reward_loop_class_name"):
        if not rm[key]:
            errors.append(
                f"reward_model.reward_loop_source=importlib needs reward_model.{key} (the Python file and the name of "
                "the reward loop class in it); or set reward_loop_source=register"
            )
    if not rm.get("use_reward_loop", True):
        errors.append(
            "reward_model.reward_loop_source=importlib with reward_model.use_reward_loop=false: the custom reward loop "
            "only runs in the reward loop (as upstream), so it would be ignored; set use_reward_loop=true or drop "
            "the reward_loop_* keys"
        )
    if rm["enable"] and not c["custom_reward_function"].get("path"):
        errors.append(
            "reward_model.reward_loop_source=importlib with reward_model.enable=true and no "
            "custom_reward_function.path: upstream then scores with the reward model alone and never calls the "
            "loop; give the loop a reward function (the reward model is then served to both, as upstream's loop "
            "does), or turn one of them off"
        )
    if c["reward_manager"]["source"] == "importlib":
        errors.append(
            "reward_model.reward_loop_source=importlib and reward_manager.source=importlib each name a custom class "
            "that computes the rewards; keep one (set the other to register)"
        )
