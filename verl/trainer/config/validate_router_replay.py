"""Rules of MoE router replay (`actor.router_replay`, `rollout.enable_rollout_routing_replay`).

Split from validate.py. R2 and R3 run on a megatron actor, over pipeline stages only without
virtual pipeline or activation recomputation (verl/models/mcore/router_replay.py); R3 replays the routing the built-in engine records while it
generates, so it needs that engine and its recording switched on, in plain generation or agent loops
(each episode carries its last model call's routing); partial rollouts are refused (a resumed row's
routing would come from two policies). Whether the model is MoE is checked when it is built.
"""

from __future__ import annotations


def _check_router_replay(c: dict, errors: list[str]):
    """MoE router replay (verl/models/mcore/router_replay.py): modes R2 and R3 on a megatron actor
    (with pipeline stages: no virtual pipeline, no activation recomputation); R3 replays what the built-in engine records
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
    megatron = arr["actor"]["megatron"]
    pp, vpp = megatron["pipeline_model_parallel_size"], megatron["virtual_pipeline_model_parallel_size"]
    if pp != 1 and vpp not in (None, 1):
        errors.append(
            f"{key}={mode} with actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size={vpp}: replay "
            "over pipeline stages tracks one model chunk per stage; set it to null"
        )
    recompute = (megatron.get("override_transformer_config") or {}).get("recompute_granularity")
    if pp != 1 and recompute is not None:
        errors.append(
            f"{key}={mode} with pipeline_model_parallel_size={pp} and "
            f"actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity={recompute}: 1F1B "
            "recomputes a micro-batch's routers after later micro-batches' forwards replaced their replay targets; "
            "set recompute_granularity=null or pipeline_model_parallel_size=1"
        )


def _check_rollout_routing(c: dict, mode: str, key: str, errors: list[str]):
    """R3 and the rollout's recording go together; only the built-in engine records, and partial
    rollouts cannot carry it."""
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
    if (c.get("async_training") or {}).get("partial_rollout"):
        errors.append(
            f"{key}=R3 with async_training.partial_rollout=true: a row resumed under newer weights is re-prefilled, "
            f"so its routing would come from two policies; set partial_rollout=false or {key}=R2"
        )
