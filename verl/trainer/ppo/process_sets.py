"""Which roles of one resource pool share worker processes.

The roles of a pool (actor+rollout, reference, critic, reward model) normally live in one set of
worker processes, fused into one Ray actor class. Megatron's parallel state (its tensor, pipeline
and context groups) is one per process, though, so a megatron critic or reward model whose layout
differs from the actor's cannot share the actor's processes: it gets a worker group of its own on
the same pool (each bundle takes up to `max_colocate_count` worker groups, as upstream's colocated
groups do).
"""

from __future__ import annotations


def megatron_layout(megatron_cfg) -> tuple:
    """(tp, pp, vpp, cp, ep, etp) of a `megatron` section; a vpp of 1 or null is no virtual pipeline,
    an etp of null is tp (megatron's expert groups are process-global like the others)."""
    vpp = megatron_cfg.virtual_pipeline_model_parallel_size
    vpp = vpp if (vpp or 1) > 1 else None
    tp = int(megatron_cfg.tensor_model_parallel_size)
    etp = getattr(megatron_cfg, "expert_tensor_parallel_size", None)
    return (
        tp,
        int(megatron_cfg.pipeline_model_parallel_size),
        vpp,
        int(megatron_cfg.context_parallel_size),
        int(getattr(megatron_cfg, "expert_model_parallel_size", 1) or 1),
        tp if etp is None else int(etp),
    )


def megatron_process_sets(config, class_dict: dict) -> list[dict]:
    """Split one pool's roles into the sets that share worker processes.

    Megatron's parallel state (its tensor/pipeline/context groups) is one per process, so a megatron
    critic or reward model whose layout differs from the actor's cannot live in the actor's
    processes: it gets worker processes of its own on the same pool (the pool's bundles take up to
    `max_colocate_count` actors each, as upstream's colocated groups do). Every other role stays
    with the actor, as before.
    """
    actor = config.actor_rollout_ref.actor
    actor_layout = megatron_layout(actor.megatron) if actor.strategy == "megatron" else None
    sections = {"critic": config.critic, "rm": config.reward_model}
    shared, own = {}, []
    for name, cls in class_dict.items():
        section = sections.get(name)
        if section is not None and section.strategy == "megatron":
            layout = megatron_layout(section.megatron)
            if layout != actor_layout:
                own.append({name: cls})
                continue
        shared[name] = cls
    return ([shared] if shared else []) + own
