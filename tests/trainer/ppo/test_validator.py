"""The Validator's schedule alone (its run() is covered end to end by the trainer tests)."""

from omegaconf import OmegaConf

from verl.trainer.ppo.validator import Validator, due


def _validator(dataloader=(), reward_fn=print, **trainer):
    return Validator(OmegaConf.create(trainer), OmegaConf.create({}), dataloader, reward_fn, None, None)


def test_due_runs_every_freq_steps_and_on_the_last_step_and_never_when_disabled():
    assert [s for s in range(1, 8) if due(3, s, is_last=s == 7)] == [3, 6, 7]
    assert not any(due(0, s, is_last=True) for s in range(1, 5))
    assert not any(due(-1, s, is_last=True) for s in range(1, 5))


def test_should_validate_follows_test_freq_and_needs_data_and_a_reward_fn():
    v = _validator(test_freq=2)
    assert [s for s in range(1, 6) if v.should_validate(s, is_last=False)] == [2, 4]
    assert v.should_validate(5, is_last=True)
    assert not _validator(dataloader=None, test_freq=2).should_validate(2, is_last=False)
    assert not _validator(reward_fn=None, test_freq=2).should_validate(2, is_last=False)


def test_validation_before_training_defaults_on_and_can_be_switched_off():
    assert _validator().should_validate_before_training()
    assert not _validator(val_before_train=False).should_validate_before_training()
    assert not _validator(dataloader=None).should_validate_before_training()
