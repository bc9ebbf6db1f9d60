"""Rules of MoE router replay (`actor.router_replay`, `rollout.enable_rollout_routing_replay`).

Split from validate.py. R2 and R3 run on a megatron actor without pipeline parallelism
(verl/models/mcore/router_replay.py); R3 replays the routing the built-in engine records while it
generates, so it needs that engine, its recording switched on, and plain generation (agent loops
and partial rollouts do not carry the routing). Whether the model is MoE is checked when it is built.
"""

from __future__ import annotations


def _check_router_replay(c: dict, errors: list[str]):
    """MoE router replay (verl/models/mcore/router_replay.py): modes R2 and R3 on a megatron actor
    without pipeline parallelism; R3 replays what the built-in engine records
    (`rollout.enable_rollout_routing_replay`). Whether the model is MoE is checked when it is built."""
    arr = c["actor_rollout_ref"]
    key = "actor_rollout_ref.actor.router_replay.mode"
    mode = arr["actor"]["router_replay"]["mode"]
    if arr["ref"]["router_replay"]["mode"] != "disabled":
        errors.append(
            f"actor_rollout_ref.ref.router_replay.mode={arr['ref']['router_replay']['mode']}: the reference only "
            f"scores (there is no update whose routing replay would keep consistent); set it to disabled and "
            f"{key} for the actor"
        )
    if mode == "R3" or arr["rollout"]["enable_rollout_routing_replay"]:
        _check_rollout_routing(c, mode, key, errors)
    if mode == "disabled":
        return
    if arr["actor"]["strategy"] != "megatron":
        errors.append(
            f"{key}={mode} is implemented for actor_rollout_ref.actor.strategy=megatron only (as upstream); "
            f"set strategy=megatron or {key}=disabled"
        )
        return
    pp = arr["actor"]["megatron"]["pipeline_model_parallel_size"]
    if pp != 1:
        errors.append(
            f"{key}={mode} with actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}: replay is "
            "implemented without pipeline parallelism (expert, tensor and context parallelism are supported); set "
            f"it to 1 or {key}=disabled"
        )


def _check_rollout_routing(c: dict, mode: str, key: str, errors: list[str]):
    """R3 and the rollout's recording go together; only the built-in engine records, and only in
    plain generation (agent loops and partial rollouts do not carry it)."""
    rollout = c["actor_rollout_ref"]["rollout"]
    flag = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
    if mode != "R3":
        errors.append(
            f"{flag}=true records routing that only {key}=R3 replays ({key}={mode}"
            + (": the old-log-prob pass records its own" if mode == "R2" else ": nothing is replayed")
            + f"); set {key}=R3 or {flag}=false"
        )
        return
    if not rollout["enable_rollout_routing_replay"]:
        errors.append(
            f"{key}=R3 replays the routing the rollout engine records, which it records only with {flag}=true "
            f"(upstream's update fails without it); set {flag}=true, or {key}=R2 to record it in the old-log-prob pass"
        )
    if rollout["name"] != "hf":
        errors.append(
            f"{key}=R3 needs the rollout engine's routing, and only the built-in engine records it here "
            f"(actor_rollout_ref.rollout.name={rollout['name']} returns none: vLLM and SGLang need the patches "
            f"upstream's router_replay README names); set actor_rollout_ref.rollout.name=hf or {key}=R2"
        )
    if rollout["multi_turn"]["enable"] or (rollout.get("agent") or {}).get("agent_loop_config_path"):
        errors.append(
            f"{key}=R3 with agent loops (multi_turn.enable or agent.agent_loop_config_path): their trajectories do "
            f"not carry the engine's routing here; use {key}=R2"
        )
    if (c.get("async_training") or {}).get("partial_rollout"):
        errors.append(
            f"{key}=R3 with async_training.partial_rollout=true: a row resumed under newer weights is re-prefilled, "
            f"so its routing would come from two policies; set partial_rollout=false or {key}=R2"
        )
