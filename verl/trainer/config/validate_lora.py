"""Validation of LoRA: the FSDP actor's and critic's peft adapters (`model.lora_rank`,
`model.lora_adapter_path`, `critic.model.lora_rank`) and the Megatron actor's and critic's
(`model.lora.rank`, `critic.model.lora.rank`), each on its own backend (the layouts' own rules are HFModelConfig's and CriticModelConfig's)."""

from __future__ import annotations

import os

from verl.trainer.config.validate_batches import need_critic


def _is_megatron(strategy: str) -> bool:
    return strategy == "megatron"


def _peft_missing(setting: str, remedy: str, errors: list[str]) -> bool:
    """Whether peft (the FSDP LoRA's library) is missing; then an error naming `setting` and `remedy`."""
    import importlib.util

    if importlib.util.find_spec("peft") is not None:
        return False
    errors.append(f"{setting} needs the peft package, which is not installed; run `pip install peft`{remedy}")
    return True


def _check_critic_lora(c: dict, errors: list[str]):
    """critic.model.lora_rank (the FSDP critic's peft LoRA) on an FSDP critic, with peft installed;
    critic.model.lora.rank (the Megatron critic's) on a Megatron critic."""
    if not need_critic(c):
        return
    model = c["critic"]["model"] or {}
    strategy = c["critic"]["strategy"]
    megatron_rank = (model.get("lora") or {}).get("rank", 0) or 0
    if megatron_rank > 0 and not _is_megatron(strategy):
        errors.append(
            f"critic.model.lora.rank={megatron_rank} is the megatron critic's LoRA, but critic.strategy={strategy}; "
            "with FSDP set critic.model.lora_rank (and lora_alpha, target_modules) instead, or use "
            "critic.strategy=megatron"
        )
    rank = model.get("lora_rank", 0) or 0
    if rank <= 0:
        return
    if _is_megatron(strategy):
        errors.append(
            f"critic.model.lora_rank={rank} is the FSDP critic's LoRA (peft), but critic.strategy=megatron; with "
            "megatron set critic.model.lora.rank (and lora.alpha, lora.target_modules) instead, or use "
            "critic.strategy=fsdp"
        )
        return
    _peft_missing(f"critic.model.lora_rank={rank}", " or set critic.model.lora_rank=0", errors)


def check_lora(c: dict, errors: list[str], warns: list[str]):
    """LoRA across sections: each backend's key on its own backend, peft installed, a trained adapter usable."""
    _check_critic_lora(c, errors)
    model = c["actor_rollout_ref"]["model"]
    megatron_rank = (model.get("lora") or {}).get("rank", 0)
    if megatron_rank > 0 and not _is_megatron(c["actor_rollout_ref"]["actor"]["strategy"]):
        errors.append(
            f"actor_rollout_ref.model.lora.rank={megatron_rank} is the megatron backend's LoRA, but "
            f"actor_rollout_ref.actor.strategy={c['actor_rollout_ref']['actor']['strategy']}; with FSDP set "
            "actor_rollout_ref.model.lora_rank (and lora_alpha, target_modules) instead, or use strategy=megatron"
        )
    # lora_rank >= 0, lora_alpha > 0 and target_modules are HFModelConfig's own checks
    rank = model["lora_rank"]
    if model["lora_adapter_path"]:
        _check_lora_adapter(model, errors, warns)
        return
    if rank <= 0:
        return
    _peft_missing(f"actor_rollout_ref.model.lora_rank={rank}", " or set lora_rank=0", errors)


def _check_lora_adapter(model: dict, errors: list[str], warns: list[str]):
    """model.lora_adapter_path: a usable adapter directory (a remote one is checked by the workers
    once fetched); warn where a LoRA layout set beside it disagrees with the adapter's, which wins."""
    path = str(model["lora_adapter_path"])
    key = f"actor_rollout_ref.model.lora_adapter_path={path}"
    if _peft_missing(key, "", errors):
        return
    if "://" in path:
        return
    from verl.utils.lora import check_adapter_dir

    try:
        adapter = check_adapter_dir(os.path.expanduser(path))
    except ValueError as e:
        errors.append(f"{key}: {e}")
        return
    if model["lora_rank"] > 0 and (model["lora_rank"], model["lora_alpha"]) != (adapter["r"], adapter["lora_alpha"]):
        warns.append(
            f"actor_rollout_ref.model.lora_rank={model['lora_rank']}, lora_alpha={model['lora_alpha']} differ from the "
            f"adapter's r={adapter['r']}, lora_alpha={adapter['lora_alpha']} in {path}: the adapter's are used (a "
            "trained adapter only fits its own layout); set them to the adapter's, or lora_rank=0"
        )
    targets = model["target_modules"]
    if isinstance(targets, list) and sorted(targets) != sorted(adapter.get("target_modules") or []):
        warns.append(
            f"actor_rollout_ref.model.target_modules={targets} differ from the adapter's "
            f"{adapter.get('target_modules')} in {path}: the adapter's are used; drop the override"
        )
    if adapter.get("lora_dropout"):
        warns.append(
            f"the adapter in {path} was trained with lora_dropout={adapter['lora_dropout']}; it trains on here without "
            "dropout (as fresh adapters do), so the trained function is the one the rollout samples from"
        )
