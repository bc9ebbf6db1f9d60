"""The config keys of Ulysses sequence parallelism, read in one place (torch-free: the config validator
reads them before anything heavy is imported).

Upstream spells a role's size twice (see `role_sp`); every reader, the validator's dict-level checks and
the workers' typed ones alike, takes the size and the name of the key that set it from `role_sp` (the
actor and the reference together from `reference_sp`), so each message names the key the user wrote.
"""

from __future__ import annotations

SP_KEY = "ulysses_sequence_parallel_size"


def _size(value) -> int:
    return int(value or 1)  # null (and upstream's 0) mean no split


def _engine_sections(section) -> list:
    """[(the role's FSDP engine section, its dotted path inside the role)]: `fsdp_config` for the actor and
    the reference; `fsdp` for the critic (upstream v0.9's) and `model.fsdp_config`, its older spelling, which
    the critic's config merges into `fsdp`; none for a Megatron or reward-model section."""
    out = []
    for where in ("fsdp_config", "fsdp"):
        if where in section and section[where] is not None:
            out.append((section[where], where))
    model = section.get("model", None)
    if model is not None and "fsdp_config" in model and model["fsdp_config"] is not None:
        out.append((model["fsdp_config"], "model.fsdp_config"))
    return out


def _engine_sp(section, role: str) -> tuple[int, str | None]:
    """The Ulysses size the role's engine sections set (1, None when none sets one above 1)."""
    found = [
        (_size(engine[SP_KEY]), f"{role}.{where}.{SP_KEY}")
        for engine, where in _engine_sections(section)
        if SP_KEY in engine and _size(engine[SP_KEY]) > 1
    ]
    for size, key in found[1:]:
        if size != found[0][0]:
            raise ValueError(
                f"{found[0][1]}={found[0][0]} and {key}={size} set two different Ulysses sizes for one role; they "
                "are two spellings of the same setting (upstream's older and newer), so set only one of them "
                "(or both to the same value)"
            )
    return found[0] if found else (1, None)


def role_sp(section, role: str) -> tuple[int, str]:
    """A role's Ulysses size and the full key that sets it: every reader of the size goes through here.

    Upstream spells the size twice: the role's own `ulysses_sequence_parallel_size` (its legacy workers
    read it; its dp_actor.yaml marks it deprecated) and its FSDP engine section's (`fsdp_config.` for the
    actor and the reference, `fsdp.` for the critic, or its older `model.fsdp_config.`: what its engine
    workers read, and where its `FSDPActorConfig` copies the role's when that is > 1). Either one alone sets the size here; both
    above 1 and different is a ValueError naming both. `section` is the role's mapping (a dict, a
    DictConfig or its typed config), `role` its dotted path (`actor_rollout_ref.actor`, `critic`, ...).
    Returns (1, the role's own key) when neither is above 1.
    """
    own_key = f"{role}.{SP_KEY}"
    own = _size(section.get(SP_KEY, None))
    from_engine, engine_key = _engine_sp(section, role)
    if engine_key is None:
        return own, own_key
    if own > 1 and own != from_engine:
        raise ValueError(
            f"{own_key}={own} and {engine_key}={from_engine} set two different Ulysses sizes for one role; "
            f"they are two spellings of the same setting (upstream's older and newer), so set only one of them "
            f"(or both to the same value)"
        )
    if own <= 1:
        return from_engine, engine_key
    return own, own_key


def reference_sp(actor, ref, prefix: str = "actor_rollout_ref") -> int:
    """The Ulysses size of the actor and the reference (which runs in the actor's worker processes, on
    their sequence-parallel groups, so it cannot differ). The reference follows the actor when its own
    keys are left alone: its role key at its default (upstream's yaml interpolates the actor's role key
    there) and its engine key at 1. A reference size set apart from the actor's, in either spelling, must
    equal it: a ValueError names the key each side was set with."""
    actor_sp, actor_key = role_sp(actor, f"{prefix}.actor")
    if ref is None:
        return actor_sp
    ref_sp, ref_key = role_sp(ref, f"{prefix}.ref")
    ref_own = ref.get(SP_KEY, None)
    follows = ref_sp == 1 and ref_own in (None, actor.get(SP_KEY, None))
    if ref_sp != actor_sp and not follows:
        raise ValueError(
            f"{ref_key}={ref_sp} differs from {actor_key}={actor_sp}: the reference runs in the actor's worker "
            "processes and uses their sequence-parallel groups; set both to the same value (or leave the "
            "reference's unset)"
        )
    return actor_sp
