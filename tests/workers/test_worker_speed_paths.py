"""The speed paths a training or scoring worker reports for its model: remove padding where its
trainer packs rows, fused kernels never (not implemented), each with the reason it is off."""

from __future__ import annotations

from verl.utils.speed_paths import SpeedPath
from verl.workers.engine_workers import _model_speed_paths


class _Packs:
    use_remove_padding = True


class _RunsPaddedRows:
    use_remove_padding = False


def test_nothing_asked_for_is_reported_off_without_a_reason():
    assert _model_speed_paths({}, _Packs()) == [
        SpeedPath("remove_padding", False, False),
        SpeedPath("fused_kernels", False, False),
    ]


def test_remove_padding_is_on_where_the_trainer_packs_and_says_which_one_does_not():
    [on, _] = _model_speed_paths({"use_remove_padding": True}, _Packs())
    assert on == SpeedPath("remove_padding", True, True)
    [off, _] = _model_speed_paths({"use_remove_padding": True}, _RunsPaddedRows())
    assert off == SpeedPath("remove_padding", True, False, "_RunsPaddedRows does not implement it: it runs padded rows")


def test_fused_kernels_and_liger_are_asked_for_but_never_on():
    for key in ("use_fused_kernels", "use_liger"):
        [_, fused] = _model_speed_paths({key: True}, _Packs())
        assert fused.requested and not fused.active and fused.reason.startswith("not implemented"), fused


def test_actor_use_fused_kernels_alone_is_reported_as_asked_for_and_off():
    # upstream's YAML copies model.use_fused_kernels into actor.use_fused_kernels; a user may set the actor's only
    [_, fused] = _model_speed_paths({}, _Packs(), {"use_fused_kernels": True})
    assert fused.requested and not fused.active and fused.reason.startswith("not implemented"), fused
    [_, quiet] = _model_speed_paths({}, _Packs(), {"use_fused_kernels": False})
    assert not quiet.requested
