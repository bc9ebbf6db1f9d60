"""`role_sp` / `reference_sp`: the one reading of a role's Ulysses size, in upstream's two spellings
(the role's own key and its FSDP engine section's), with the key that set it for messages."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl.utils.ulysses_keys import reference_sp, role_sp

SP = "ulysses_sequence_parallel_size"
A = "actor_rollout_ref.actor"


def actor(own=1, engine=1) -> dict:
    return {SP: own, "fsdp_config": {SP: engine}}


@pytest.mark.parametrize("wrap", [dict, OmegaConf.create], ids=["dict", "DictConfig"])
@pytest.mark.parametrize(
    ("own", "engine", "expected"),
    [
        (1, 1, (1, f"{A}.{SP}")),
        (2, 1, (2, f"{A}.{SP}")),
        (1, 2, (2, f"{A}.fsdp_config.{SP}")),
        (None, 4, (4, f"{A}.fsdp_config.{SP}")),
        (2, 2, (2, f"{A}.{SP}")),
    ],
)
def test_either_spelling_alone_sets_the_size_and_is_named(wrap, own, engine, expected):
    assert role_sp(wrap(actor(own, engine)), A) == expected


def test_two_different_sizes_name_both_keys():
    with pytest.raises(ValueError, match=rf"^{A}.{SP}=2 and {A}.fsdp_config.{SP}=4 set two different"):
        role_sp(actor(2, 4), A)


def test_the_critic_s_engine_key_is_under_its_model():
    critic = {SP: 1, "model": {"fsdp_config": {SP: 2}}}
    assert role_sp(critic, "critic") == (2, f"critic.model.fsdp_config.{SP}")
    # upstream v0.9's critic.fsdp, alone or beside the older spelling at 1
    assert role_sp({SP: 1, "fsdp": {SP: 2}, "model": {"fsdp_config": {SP: 1}}}, "critic") == (2, f"critic.fsdp.{SP}")
    with pytest.raises(ValueError, match=rf"critic.fsdp.{SP}=2 and critic.model.fsdp_config.{SP}=4 set two different"):
        role_sp({"fsdp": {SP: 2}, "model": {"fsdp_config": {SP: 4}}}, "critic")


def test_sections_without_an_fsdp_engine_read_the_role_key_only():
    assert role_sp({"megatron": {"context_parallel_size": 2}}, A) == (1, f"{A}.{SP}")
    assert role_sp({SP: 2, "model": {"fsdp_config": {"param_offload": False}}}, "reward_model") == (
        2,
        f"reward_model.{SP}",
    )


def test_the_reference_follows_the_actor_unless_set_apart():
    # upstream's yaml gives the reference's role key the actor's role key; its engine key defaults to 1
    assert reference_sp(actor(1, 2), actor(1, 1)) == 2
    assert reference_sp(actor(2, 1), actor(2, 1)) == 2
    assert reference_sp(actor(1, 2), actor(1, 2)) == 2
    assert reference_sp(actor(2, 1), None) == 2
    with pytest.raises(ValueError, match=rf"^actor_rollout_ref.ref.{SP}=1 differs from {A}.{SP}=2"):
        reference_sp(actor(2, 1), actor(1, 1))
    with pytest.raises(ValueError, match=rf"^actor_rollout_ref.ref.fsdp_config.{SP}=4 differs from {A}.fsdp_config"):
        reference_sp(actor(1, 2), actor(1, 4))
