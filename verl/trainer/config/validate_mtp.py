"""Rules of `actor_rollout_ref.model.mtp` (multi-token prediction, `verl.models.mcore.mtp`).

Split from validate.py. MTP layers are trained on the megatron actor only (tensor, pipeline and
context parallelism; no virtual pipeline stages), from the HF checkpoint (not a dist checkpoint) and without LoRA; every other
combination is refused here, before anything starts, rather than ignored.
"""

from __future__ import annotations

_KEY = "actor_rollout_ref.model.mtp"


def check_mtp(c: dict, errors: list[str]) -> None:
    arr = c["actor_rollout_ref"]
    mtp = arr["model"].get("mtp") or {}
    if not mtp.get("enable", False):
        if mtp.get("enable_train", False):
            errors.append(
                f"{_KEY}.enable_train=true needs {_KEY}.enable=true (the MTP layers are only built with it); set both "
                "or neither"
            )
        return
    actor = arr["actor"]
    if actor["strategy"] != "megatron":
        errors.append(
            f"{_KEY}.enable=true is implemented on the megatron actor (as upstream); actor_rollout_ref.actor.strategy="
            f"{actor['strategy']} would load the model without its MTP layers; start from "
            f"--config-name=ppo_megatron_trainer or set {_KEY}.enable=false"
        )
        return
    meg = actor["megatron"]
    if (meg.get("virtual_pipeline_model_parallel_size") or 1) > 1:
        errors.append(
            f"{_KEY}.enable=true with actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size="
            f"{meg['virtual_pipeline_model_parallel_size']}: multi-token prediction is implemented without virtual "
            f"pipeline stages (tensor, pipeline and context parallelism work); set it to null or {_KEY}.enable=false"
        )
    if meg.get("use_dist_checkpointing"):
        errors.append(
            f"{_KEY}.enable=true with actor_rollout_ref.actor.megatron.use_dist_checkpointing=true: the MTP layers are "
            "read from the HF checkpoint (the dist-checkpoint converter does not write them); set "
            "use_dist_checkpointing=false"
        )
    if ((arr["model"].get("lora") or {}).get("rank") or 0) > 0:
        errors.append(
            f"{_KEY}.enable=true with actor_rollout_ref.model.lora.rank > 0: LoRA adapters on a model with MTP layers "
            f"are not implemented; set model.lora.rank=0 or {_KEY}.enable=false"
        )
    factor = mtp.get("mtp_loss_scaling_factor", 0.1)
    if factor is None or factor < 0:
        errors.append(f"{_KEY}.mtp_loss_scaling_factor={factor} must be >= 0 (the MTP loss's weight)")
