"""The speed paths a training or scoring worker reports for its model: remove padding where its
trainer packs rows, fused kernels where its trainer takes them, each with the reason it is off."""

from __future__ import annotations

import pytest

from verl.utils.speed_paths import SpeedPath, model_speed_paths
from verl.workers.config import FSDPActorConfig, HFModelConfig
from verl.workers.engine_workers import _policy_asks_for_fused_kernels, policy_uses_fused_kernels


class _Packs:
    use_remove_padding = True


class _Fuses:
    use_remove_padding = False
    use_fused_kernels = True


class _ActorWithoutFused:  # an actor built with use_fused_kernels=false (the config asked for use_liger only)
    use_remove_padding = False
    use_fused_kernels = False


class _RunsPaddedRows:
    use_remove_padding = False


def test_nothing_asked_for_is_reported_off_without_a_reason():
    assert model_speed_paths(_Packs(), remove_padding=False, fused=False) == [
        SpeedPath("remove_padding", False, False),
        SpeedPath("fused_kernels", False, False),
    ]


def test_remove_padding_is_on_where_the_trainer_packs_and_says_which_one_does_not():
    [on, _] = model_speed_paths(_Packs(), remove_padding=True, fused=False)
    assert on == SpeedPath("remove_padding", True, True)
    [off, _] = model_speed_paths(_RunsPaddedRows(), remove_padding=True, fused=False)
    assert off == SpeedPath("remove_padding", True, False, "_RunsPaddedRows does not implement it: it runs padded rows")


def test_fused_kernels_are_on_where_the_trainer_takes_them_and_say_why_not_elsewhere():
    [_, on] = model_speed_paths(_Fuses(), remove_padding=False, fused=True)
    assert on == SpeedPath("fused_kernels", True, True)
    partly = _Fuses()
    partly.fused_kernels_note = (
        "micro-batches that take the shared-prompt forward compute their response logits unfused"
    )
    [_, limited] = model_speed_paths(partly, remove_padding=False, fused=True)
    assert limited == SpeedPath("fused_kernels", True, True, partly.fused_kernels_note)
    [_, liger] = model_speed_paths(_ActorWithoutFused(), remove_padding=False, fused=True)
    assert liger.requested and not liger.active and liger.reason.startswith("use_liger is not implemented"), liger
    [_, critic] = model_speed_paths(_Packs(), remove_padding=False, fused=True)
    assert not critic.active and critic.reason == "_Packs does not implement it: it computes full logits", critic


def _actor(**kw) -> FSDPActorConfig:
    return FSDPActorConfig(ppo_micro_batch_size_per_gpu=1, **kw)  # a micro-batch size is required (upstream's rule)


def test_the_policy_uses_fused_kernels_from_the_model_or_actor_section_and_refuses_triton():
    assert policy_uses_fused_kernels(HFModelConfig(use_fused_kernels=True), _actor())
    assert policy_uses_fused_kernels(HFModelConfig(), _actor(use_fused_kernels=True))
    assert not policy_uses_fused_kernels(HFModelConfig(use_liger=True), _actor())
    triton = HFModelConfig(use_fused_kernels=True, fused_kernel_options={"impl_backend": "triton"})
    with pytest.raises(ValueError, match="impl_backend='triton' is not implemented"):
        policy_uses_fused_kernels(triton, _actor())


@pytest.mark.parametrize(
    "model, actor, asked",
    [
        ({}, {}, False),
        ({"use_fused_kernels": True}, {}, True),
        ({"use_liger": True}, {}, True),
        # upstream's YAML copies model.use_fused_kernels into actor.use_fused_kernels; a user may set the actor's only
        ({}, {"use_fused_kernels": True}, True),
    ],
)
def test_the_policys_model_or_actor_section_asks_for_fused_kernels(model, actor, asked):
    assert _policy_asks_for_fused_kernels(HFModelConfig(**model), _actor(**actor)) is asked
