"""Validation of the expert-parallel layouts: Megatron's expert groups and the rollout's expert parallelism
(the rules that span sections; each size's own rules live with its dataclass)."""

from __future__ import annotations

from verl.trainer.config.validate_batches import world_size
from verl.utils.ulysses_keys import role_sp


def _actor_sp(actor: dict) -> tuple[int, str]:
    """The actor's Ulysses size and the key that set it (two different sizes: validate._check_ulysses reports it)."""
    try:
        return role_sp(actor, "actor_rollout_ref.actor")
    except ValueError:
        return 1, ""


def check_megatron_experts(name: str, m: dict, world: int, errors: list[str]) -> None:
    """Expert parallelism (docs/megatron.md, "Mixture of experts"): the expert layout must fit the ranks
    (whether ep divides the model's experts is checked when the model is built, from its HF config)."""
    tp, pp = m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"]
    ep, etp = m.get("expert_model_parallel_size", 1), m.get("expert_tensor_parallel_size")
    etp = tp if etp is None else etp
    for key, value in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if not isinstance(value, int) or value < 1:
            errors.append(f"{name}.megatron.{key}={value!r} must be a positive integer (or null for etp)")
            return
    if world % (etp * ep * pp):
        errors.append(
            f"{name}.megatron.expert_tensor_parallel_size={etp} x expert_model_parallel_size={ep} x "
            f"pipeline_model_parallel_size={pp} = {etp * ep * pp} does not divide the {world} ranks (megatron "
            f"carves its expert groups out of the same ranks); choose sizes whose product divides {world}"
        )
    # etp > tp is allowed: megatron's expert-tensor groups then run across data-parallel ranks (their
    # uneven token gather on gloo is `verl.utils.megatron.gloo_collectives`), and the distributed
    # optimizer splits the Adam state over the ranks holding the same expert shards
    # (`verl.utils.megatron.parallel_state.parameter_replica_group`)


def check_rollout_experts(c: dict, errors: list[str]):
    """`rollout.expert_parallel_size` across sections (its own rules are RolloutConfig's): the groups tile
    the workers, and the built-in engine's groups need every worker to hold an engine in lock-step."""
    arr = c["actor_rollout_ref"]
    ep = arr["rollout"]["expert_parallel_size"]
    if ep <= 1:
        return
    key = f"actor_rollout_ref.rollout.expert_parallel_size={ep}"
    world = world_size(c)
    if world % ep:
        errors.append(
            f"{key} does not divide the {world} workers (trainer.nnodes x trainer.n_gpus_per_node), so the "
            f"expert-parallel groups cannot be formed; use a divisor of {world}"
        )
    if arr["rollout"]["name"] != "hf":
        return
    sp, sp_key = _actor_sp(arr["actor"])
    clashes = {
        "actor_rollout_ref.actor.strategy=megatron": arr["actor"]["strategy"] == "megatron",
        f"{sp_key} > 1": sp > 1,
        "async_training.staleness_threshold > 0 (a rollout pool of its own)": c["async_training"]["staleness_threshold"]
        > 0,
    }
    for what, clash in clashes.items():
        if clash:
            errors.append(
                f"{key} with rollout.name=hf is not implemented with {what}: the built-in engine splits the experts "
                "over the colocated workers, every one of which must hold an engine; set expert_parallel_size=1 or "
                "turn that option off"
            )
