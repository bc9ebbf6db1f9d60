"""Validation of the critic's two spellings of its FSDP engine section: `critic.fsdp` (upstream v0.9's) and
`critic.model.fsdp_config` (upstream's before v0.9, still read: `FSDPCriticConfig` merges a key set there
into `critic.fsdp`, and refuses one set in both to different values, which the typed-section check reports)."""

from __future__ import annotations


def check_critic_fsdp_spelling(c: dict, warns: list[str]) -> None:
    """Warn once per key an FSDP critic takes from its older `model.fsdp_config` spelling."""
    from verl.workers.config.critic import merge_legacy_fsdp_config

    critic = c["critic"]
    legacy = (critic.get("model") or {}).get("fsdp_config")
    if critic.get("strategy") == "megatron" or not isinstance(legacy, dict) or "fsdp" not in critic:
        return
    try:
        adopted = merge_legacy_fsdp_config(legacy, critic["fsdp"] or {})
    except ValueError:
        return  # the conflict is the typed critic section's error
    for key in adopted:
        warns.append(
            f"critic.model.fsdp_config.{key} is upstream's spelling before v0.9; it is read as critic.fsdp.{key} "
            f"(write critic.fsdp.{key})"
        )
