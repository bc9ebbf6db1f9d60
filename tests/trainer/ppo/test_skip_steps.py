"""Upstream v0.9's `skip.rollout`: listed steps replay per-step dumps (verl/trainer/ppo/rollout_skip.py),
through the same rollout source as a real run, with the scripted rollout stand-in of
test_rollout_source.py (the real worker group needs Ray and a model)."""

from __future__ import annotations

import json

import pytest

from tests.trainer.ppo.test_rollout_source import (
    CORRECT,
    TOKENIZER,
    ScriptedRollout,
    _assert_same_batch,
    _prompts,
    exact_match,
)
from verl.trainer.config import ConfigError, load_ppo_config
from verl.trainer.ppo.rollout_source import PromptStream, RewardScorer, StepState, build_rollout_source


def _source(tmp_path, rollout, batches, steps, action="cache", *overrides):
    config = load_ppo_config(
        [
            "data.train_batch_size=2",
            "data.max_prompt_length=16",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "trainer.experiment_name=exp",
            "trainer.project_name=proj",
            "skip.rollout.enable=true",
            f"skip.rollout.dump_dir={tmp_path}",
            f"skip.rollout.steps={steps}",
            f"skip.rollout.action={action}",
            *overrides,
        ],
        config_name="arith_demo",
    )
    current = [0]
    source = build_rollout_source(
        config,
        prompts=PromptStream(batches, current_step=lambda: current[0]),
        scorer=RewardScorer(exact_match),
        actor_wg=rollout,
        tokenizer=TOKENIZER,
        current_step=lambda: current[0],
        total_steps=lambda: 10,
    )

    def step(k):
        current[0] = k
        state = StepState()
        return source.next_batch(state), state

    return step


def test_cache_replays_each_listed_steps_own_dump_and_generates_the_others(tmp_path):
    root = tmp_path / "exp_proj" / "GBS2_N2_in16_out8"  # upstream's layout of a run's dumps
    batches = [_prompts(2, first=0), _prompts(2, first=2), _prompts(2, first=4)]
    # run 1: steps 1 and 3 are listed: each generates and writes its dump; step 2 generates without one
    rollout = ScriptedRollout([CORRECT, 0, 0, CORRECT], [0, 0, 0, 0], [CORRECT] * 4)
    step = _source(tmp_path, rollout, list(batches), "[1,3]")
    first, state = step(1)
    assert state.metrics["rollout/replayed"] == 0.0
    assert json.loads((root / "1" / "meta.json").read_text()) == {"global_steps": 1}
    second, state = step(2)
    assert "rollout/replayed" not in state.metrics and not (root / "2").exists()
    third, _ = step(3)
    assert len(rollout.inputs) == 3 and (root / "3" / "gen_batch.dp").is_file()

    # run 2: steps 1 and 3 replay their own rollouts (scored against their own prompts); step 2 generates
    engine = ScriptedRollout([CORRECT, CORRECT, CORRECT, CORRECT])
    step = _source(tmp_path, engine, list(batches), "[1,3]")
    replayed, state = step(1)
    assert state.metrics["rollout/replayed"] == 1.0 and engine.inputs == []
    _assert_same_batch(first, replayed)
    assert replayed.batch["token_level_scores"][:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    step(2)
    assert len(engine.inputs) == 1  # not listed: generated
    replayed, _ = step(3)
    _assert_same_batch(third, replayed)
    assert len(engine.inputs) == 1


def test_repeat_replays_the_nearest_dump_earlier_first(tmp_path):
    batches = [_prompts(2, first=0) for _ in range(4)]
    rollout = ScriptedRollout([CORRECT, 0, 0, CORRECT])
    step = _source(tmp_path, rollout, list(batches), "[2,3,4]", "repeat")
    two, state = step(2)  # nothing dumped yet: generates and writes step 2
    assert state.metrics["rollout/replayed"] == 0.0
    three, state = step(3)  # step 3 has no dump: the newest earlier one (step 2)
    assert state.metrics["rollout/replayed"] == 1.0 and len(rollout.inputs) == 1
    _assert_same_batch(two, three)

    # a run listing step 1 only gets the oldest later dump (step 2) when it has none of its own
    engine = ScriptedRollout()
    step = _source(tmp_path, engine, list(batches), "[1]", "repeat")
    one, _ = step(1)
    assert engine.inputs == []
    _assert_same_batch(two, one)

    # cache would have generated step 1 instead
    cached = ScriptedRollout([0, 0, 0, 0])
    step = _source(tmp_path, cached, list(batches), "[1]", "cache")
    step(1)
    assert len(cached.inputs) == 1


def test_a_dump_of_the_wrong_size_is_refused_naming_it(tmp_path):
    step = _source(tmp_path, ScriptedRollout([CORRECT, 0, 0, CORRECT]), [_prompts(2)], "[1]")
    step(1)
    step = _source(tmp_path, ScriptedRollout(), [_prompts(1)], "[1]", "cache", "data.train_batch_size=2")
    with pytest.raises(ValueError, match=r"holds 4 samples, but step 1 needs 1 prompts x rollout.n=2 = 2"):
        step(1)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["skip.rollout.action=random"], "skip.rollout.action='random' is not a valid choice"),
        (["actor_rollout_ref.rollout.skip_rollout=true"], "both replay dumped rollouts"),
        (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"], "dynamic sampling"),
        (["async_training.staleness_threshold=1"], "staleness_threshold > 0: the rollouts"),
        (["skip.rollout_tq.enable=true"], "skip.rollout_tq.enable"),
        (["skip.async_rollout.enable=true"], "skip.async_rollout.enable"),
    ],
)
def test_what_the_skip_cannot_be_combined_with_is_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_ppo_config(["skip.rollout.enable=true", *overrides], config_name="arith_demo")


def test_repeat_prefers_the_newest_earlier_dump_over_a_later_one(tmp_path):
    batches = [_prompts(2, first=0) for _ in range(4)]
    rollout = ScriptedRollout([CORRECT, 0, 0, CORRECT], [0, CORRECT, CORRECT, 0])
    step = _source(tmp_path, rollout, list(batches), "[2,4]")
    two, _ = step(2)
    four, _ = step(4)
    step = _source(tmp_path, ScriptedRollout(), list(batches), "[3,5]", "repeat")
    three, _ = step(3)
    _assert_same_batch(two, three)
    five, _ = step(5)
    _assert_same_batch(four, five)
