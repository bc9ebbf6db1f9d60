"""ActorConfig's own checks, its `validate(n_gpus, train_batch_size, model_config)` and its mutable batch sizes
(upstream's contract for the section), with values worked by hand."""

import dataclasses

import pytest

from verl.workers.config import ActorConfig, FSDPActorConfig, McoreActorConfig


def test_a_micro_batch_size_is_required_unless_packing_by_tokens():
    with pytest.raises(ValueError, match=r"^Please set at least one of actor.ppo_micro_batch_size_per_gpu"):
        FSDPActorConfig()
    with pytest.raises(ValueError, match=r"^Please set at least one"):
        McoreActorConfig(ppo_micro_batch_size=None)
    assert FSDPActorConfig(use_dynamic_bsz=True).ppo_micro_batch_size_per_gpu is None
    assert ActorConfig(ppo_micro_batch_size=8).ppo_micro_batch_size == 8  # the deprecated spelling alone is fine


def test_both_micro_batch_spellings_are_refused():
    with pytest.raises(ValueError, match=r"^You have set both actor.ppo_micro_batch_size=4 and .*_per_gpu=2"):
        ActorConfig(ppo_micro_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    # with token packing neither is read
    assert ActorConfig(ppo_micro_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=True).use_dynamic_bsz


def test_an_unknown_loss_agg_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"Invalid loss_agg_mode: actor.loss_agg_mode='mean'; use one of: token-mean"):
        ActorConfig(ppo_micro_batch_size_per_gpu=1, loss_agg_mode="mean")


def test_batch_sizes_are_mutable_and_other_fields_are_not():
    cfg = FSDPActorConfig(ppo_micro_batch_size_per_gpu=4)
    cfg.ppo_mini_batch_size = 32
    cfg.ppo_micro_batch_size_per_gpu = 2
    assert (cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu) == (32, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_ratio = 0.3
    with pytest.raises(AttributeError):  # FrozenInstanceError is an AttributeError, as upstream's tests expect
        cfg.strategy = "megatron"


def test_validate_checks_the_mini_batch_against_the_step_batch():
    cfg = ActorConfig(ppo_mini_batch_size=64, ppo_micro_batch_size_per_gpu=4)
    cfg.validate(n_gpus=8, train_batch_size=64)  # equal: one optimizer step per batch
    with pytest.raises(ValueError, match=r"^train_batch_size \(63\) must be >= actor.ppo_mini_batch_size \(64\)"):
        cfg.validate(n_gpus=8, train_batch_size=63)
    ActorConfig(ppo_mini_batch_size=64, use_dynamic_bsz=True).validate(n_gpus=8, train_batch_size=1)


def test_validate_checks_the_deprecated_global_micro_batch():
    cfg = ActorConfig(ppo_mini_batch_size=48, ppo_micro_batch_size=16)
    cfg.validate(n_gpus=16, train_batch_size=48)  # 48 % 16 == 0 and 16 >= 16 ranks
    with pytest.raises(ValueError, match=r"ppo_mini_batch_size \(40\) must be divisible by .*micro_batch_size \(16\)"):
        ActorConfig(ppo_mini_batch_size=40, ppo_micro_batch_size=16).validate(n_gpus=8, train_batch_size=40)
    with pytest.raises(ValueError, match=r"\(16\) \* ulysses_sequence_parallel_size \(1\) must be >= n_gpus \(32\)"):
        cfg.validate(n_gpus=32, train_batch_size=48)
    # Ulysses: each micro-batch sequence is split over sp ranks, so 16 x 2 covers 32 ranks
    sp = FSDPActorConfig(ppo_mini_batch_size=48, ppo_micro_batch_size=16, ulysses_sequence_parallel_size=2)
    sp.validate(n_gpus=32, train_batch_size=48, model_config={"use_remove_padding": True})


@pytest.mark.parametrize(
    "sp_where, model_rp, actor_rp, raises",
    [
        ("actor", False, False, True),
        ("engine", False, False, True),  # the engine's spelling of the size counts too
        ("actor", True, False, False),
        ("actor", False, True, False),  # the actor's own key (which follows the model's in the YAML)
        (None, False, False, False),  # no sequence parallelism: nothing to pack
    ],
)
def test_fsdp_validate_needs_remove_padding_with_ulysses(sp_where, model_rp, actor_rp, raises):
    kwargs = {"use_dynamic_bsz": True, "use_remove_padding": actor_rp}
    if sp_where == "actor":
        kwargs["ulysses_sequence_parallel_size"] = 2
    cfg = FSDPActorConfig(**kwargs)
    if sp_where == "engine":
        cfg = dataclasses.replace(
            cfg, fsdp_config=dataclasses.replace(cfg.fsdp_config, ulysses_sequence_parallel_size=2)
        )
    if raises:
        with pytest.raises(
            ValueError, match=r"=2: when using sequence parallelism .*you must enable `use_remove_padding`"
        ):
            cfg.validate(n_gpus=8, train_batch_size=256, model_config={"use_remove_padding": model_rp})
    else:
        cfg.validate(n_gpus=8, train_batch_size=256, model_config={"use_remove_padding": model_rp})
    cfg.validate(n_gpus=8, train_batch_size=256)  # without the model section there is nothing to check


@pytest.mark.parametrize(
    "ref_keys, per_gpu, dynamic",
    [
        ({"log_prob_micro_batch_size_per_gpu": 8, "log_prob_use_dynamic_bsz": False}, 8, False),
        ({"log_prob_micro_batch_size_per_gpu": None, "log_prob_use_dynamic_bsz": True}, None, True),
        # nothing set (a forward-only pass the worker batches itself): token packing, never a refusal
        ({"log_prob_micro_batch_size_per_gpu": None, "log_prob_use_dynamic_bsz": False}, None, True),
    ],
)
def test_a_reference_scorer_built_from_the_ref_section_takes_its_forward_micro_batching(ref_keys, per_gpu, dynamic):
    from verl.workers.actor.ppo_actor import _scorer_section

    ref = {"strategy": "fsdp", "ulysses_sequence_parallel_size": 2, "log_prob_max_token_len_per_gpu": 99, **ref_keys}
    section = _scorer_section(ref, FSDPActorConfig)
    built = FSDPActorConfig(**section)  # the actor class's micro-batch rule holds
    assert (built.ppo_micro_batch_size_per_gpu, built.use_dynamic_bsz) == (per_gpu, dynamic)
    assert built.ulysses_sequence_parallel_size == 2 and "log_prob_max_token_len_per_gpu" not in section


def test_a_scorer_built_from_an_actor_like_section_without_micro_batching_is_not_refused():
    from verl.workers.actor.ppo_actor import _scorer_section

    # upstream builds scorers without the class's checks; a scorer never trains, so token packing stands in
    assert FSDPActorConfig(**_scorer_section({"ppo_mini_batch_size": 1}, FSDPActorConfig)).use_dynamic_bsz
    given = {"ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 2}
    assert _scorer_section(given, FSDPActorConfig) is given  # a section that sets its micro-batching is kept
