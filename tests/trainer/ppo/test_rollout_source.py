"""The rollout sources and their parts (verl/trainer/ppo/rollout_source.py), each built from its
parts alone: a prompt stream over a list of batches, a scripted stand-in for the rollout worker
group (the real group needs Ray and a model: the e2e runs cover it), and a real RewardScorer over
a rule reward function."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.async_rollout import AsyncRolloutSource
from verl.trainer.ppo.core_algos import AdaptiveKLController, FixedKLController
from verl.trainer.ppo.driver_math import apply_kl_in_reward
from verl.trainer.ppo.rollout_source import (
    FilteringRolloutSource,
    PromptStream,
    RewardScorer,
    RolloutGenerator,
    StepState,
    SyncRolloutSource,
    build_rollout_source,
    group_filter_values,
)

CORRECT = 7  # the one-token response the reward function scores 1
TOKENIZER = SimpleNamespace(eos_token_id=0, pad_token_id=0)


def _prompts(num_prompts: int, first: int = 0) -> dict:
    ids = torch.arange(first, first + num_prompts).unsqueeze(1).repeat(1, 2) + 100  # [B, 2] prompt tokens
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(2).repeat(num_prompts, 1),
    }


class ScriptedRollout:
    """Stands in for the rollout worker group: each `generate_sequences` call answers with the next
    scripted list of one-token responses, one per row it was sent."""

    def __init__(self, *calls: list[int]):
        self.calls = list(calls)
        self.inputs: list[DataProto] = []

    def generate_sequences(self, gen: DataProto) -> DataProto:
        self.inputs.append(gen)
        responses = torch.tensor(self.calls.pop(0)).unsqueeze(1)
        assert len(responses) == len(gen), "the script does not match the rows sent"
        prompts = gen.batch["input_ids"]
        out = DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": torch.ones(len(gen), prompts.shape[1] + 1, dtype=torch.long),
                "position_ids": torch.arange(prompts.shape[1] + 1).repeat(len(gen), 1),
                "response_mask": torch.ones(len(gen), 1, dtype=torch.long),
            }
        )
        out.meta_info["metrics"] = {"rollout/calls": [float(len(self.inputs))]}
        return out


def exact_match(batch: DataProto, return_dict: bool = False):
    """A rule reward: 1 for the CORRECT token, with `acc` as extra info and one error on token 9."""
    correct = (batch.batch["responses"][:, -1] == CORRECT).double()
    errors = (batch.batch["responses"][:, -1] == 9).double()
    extra = {"acc": correct.tolist(), "reward_error": errors.tolist()}
    return {"reward_tensor": correct.unsqueeze(1), "reward_extra_info": extra}


def _generator(rollout: ScriptedRollout, n: int, baseline_scorer=None) -> RolloutGenerator:
    return RolloutGenerator(
        rollout, TOKENIZER, n, multi_turn=False, current_step=lambda: 1, baseline_scorer=baseline_scorer
    )


def test_generator_puts_each_prompts_n_samples_next_to_each_other_under_its_uid():
    rollout = ScriptedRollout([1, 2, 3, 4, 5, 6])
    prompts = PromptStream([_prompts(2)], current_step=lambda: 1)
    state = StepState()
    batch = _generator(rollout, n=3)(prompts(), state)
    assert batch.non_tensor_batch["uid"].tolist() == ["1_0"] * 3 + ["1_1"] * 3
    assert batch.batch["responses"][:, 0].tolist() == [1, 2, 3, 4, 5, 6]
    # the rollout's input_ids (prompt + response) replace the prompt's, row by row
    assert batch.batch["input_ids"][:, 0].tolist() == [100] * 3 + [101] * 3
    assert batch.batch["input_ids"][:, -1].tolist() == [1, 2, 3, 4, 5, 6]
    sent = rollout.inputs[0]
    assert len(sent) == 6 and sent.meta_info["n"] == 1 and sent.meta_info["global_steps"] == 1
    assert state.metrics["rollout/calls"] == 1.0 and "gen" in state.timing


def test_remax_baseline_is_the_score_of_each_prompts_greedy_response():
    # sampled: prompt 0 -> (7, 0), prompt 1 -> (0, 0); greedy: prompt 0 -> 0, prompt 1 -> 7
    rollout = ScriptedRollout([CORRECT, 0, 0, 0], [0, CORRECT])
    prompts = PromptStream([_prompts(2)], current_step=lambda: 1)
    state = StepState()
    batch = _generator(rollout, n=2, baseline_scorer=RewardScorer(exact_match))(prompts(), state)
    assert batch.batch["reward_baselines"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert rollout.inputs[1].meta_info["do_sample"] is False and len(rollout.inputs[1]) == 2
    assert "gen_max" in state.timing
    assert "reward/num_errors" not in state.metrics  # the greedy scoring records nothing


def test_sync_source_hands_out_scored_samples_with_the_reward_functions_extra_info():
    rollout = ScriptedRollout([CORRECT, 9, 0, CORRECT])
    source = SyncRolloutSource(
        PromptStream([_prompts(2)], current_step=lambda: 1), _generator(rollout, n=2), RewardScorer(exact_match)
    )
    state = StepState()
    batch = source.next_batch(state)
    assert batch.batch["token_level_scores"][:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert "token_level_rewards" not in batch.batch  # the step makes the final reward
    assert batch.non_tensor_batch["acc"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert state.metrics["reward/num_errors"] == 1.0
    assert source.runs_ahead is False and source.state_dict() == {}


def test_with_a_reward_model_its_scores_are_the_reward_and_one_of_the_two_is_needed():
    rm = SimpleNamespace(
        compute_rm_score=lambda b: DataProto.from_dict(tensors={"rm_scores": torch.full((len(b), 1), 0.25)})
    )
    batch = DataProto.from_dict(tensors={"responses": torch.tensor([[CORRECT], [9]])})
    state = StepState()
    # upstream's reward managers return rm_scores unchanged: no rule reward is added, the rule fn never runs
    assert RewardScorer(exact_match, rm).scores(batch, state)[:, 0].tolist() == [0.25, 0.25]
    assert "reward/num_errors" not in state.metrics
    assert RewardScorer(None, rm).scores(batch)[:, 0].tolist() == [0.25, 0.25]
    assert RewardScorer(exact_match).scores(batch)[:, 0].tolist() == [1.0, 0.0]
    with pytest.raises(RuntimeError, match="custom_reward_function.path"):
        RewardScorer().scores(batch)


def _filtering(rollout, batches, train_batch_size, max_num_gen_batches=0, metric="acc"):
    prompts = PromptStream(batches, current_step=lambda: 1)
    return FilteringRolloutSource(
        prompts,
        _generator(rollout, n=2),
        RewardScorer(exact_match),
        metric=metric,
        max_num_gen_batches=max_num_gen_batches,
        train_batch_size=train_batch_size,
    )


def test_filtering_source_generates_until_enough_groups_vary_and_keeps_only_those():
    # batch 1: prompt 0 all wrong, prompt 1 mixed; batch 2: prompt 2 all right, prompt 3 mixed
    rollout = ScriptedRollout([0, 0, CORRECT, 0], [CORRECT, CORRECT, 0, CORRECT])
    source = _filtering(rollout, [_prompts(2), _prompts(2, first=2)], train_batch_size=2)
    state = StepState()
    batch = source.next_batch(state)
    assert state.metrics["train/num_gen_batches"] == 2
    # the second batch's uids continue the step's count: groups of different prompts never merge
    assert batch.non_tensor_batch["uid"].tolist() == ["1_1", "1_1", "1_3", "1_3"]
    assert batch.batch["input_ids"][:, 0].tolist() == [101, 101, 103, 103]


def test_filtering_source_drops_the_surplus_groups_of_its_last_batch():
    rollout = ScriptedRollout([CORRECT, 0, 0, CORRECT, CORRECT, 0])
    source = _filtering(rollout, [_prompts(3)], train_batch_size=2, metric="seq_final_reward")
    state = StepState()
    batch = source.next_batch(state)
    assert batch.non_tensor_batch["uid"].tolist() == ["1_0", "1_0", "1_1", "1_1"]
    assert state.metrics["train/num_gen_batches"] == 1


def test_filtering_source_gives_up_after_max_num_gen_batches_and_says_what_to_change():
    rollout = ScriptedRollout([0, 0, 0, 0], [0, 0, 0, 0])
    source = _filtering(rollout, [_prompts(2), _prompts(2, first=2)], train_batch_size=1, max_num_gen_batches=2)
    with pytest.raises(RuntimeError, match=r"generated 2 batches but only 0 of 1 prompts.*max_num_gen_batches"):
        source.next_batch(StepState())


def test_group_filter_values_read_the_summed_scores_or_an_extra_info_column():
    batch = DataProto.from_dict(
        tensors={"token_level_scores": torch.tensor([[0.0, 1.0], [0.5, 0.0]])},
        non_tensors={"acc": np.array([1, 0])},
    )
    assert group_filter_values(batch, "seq_final_reward").tolist() == [1.0, 0.5]
    assert group_filter_values(batch, "seq_reward").tolist() == [1.0, 0.5]
    assert group_filter_values(batch, "acc").tolist() == [1.0, 0.0]
    with pytest.raises(KeyError, match=r"metric='score'.*available: \['acc'\]"):
        group_filter_values(batch, "score")


def _kl_batch() -> DataProto:
    d = torch.float64
    return DataProto.from_dict(
        tensors={
            "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]], dtype=d),
            "old_log_probs": torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.4, 0.9]], dtype=d)),
            "ref_log_prob": torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.2, 0.2, 0.1]], dtype=d)),
            "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=d),
        }
    )


def test_kl_in_reward_subtracts_beta_times_the_token_kl_and_reports_the_mean_kl():
    batch = _kl_batch()
    metrics = apply_kl_in_reward(batch, FixedKLController(0.1), "kl", n_steps=2)
    # k1 estimate log(pi_old / pi_ref): row 0 [log 2, 0, 0], row 1 [0, log 2, (masked)]
    log2 = float(np.log(2.0))
    expected = torch.tensor([[-0.1 * log2, 0.0, 1.0], [0.0, 0.5 - 0.1 * log2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(batch.batch["token_level_rewards"], expected)
    # mean over responses of each response's mean token KL: (log2 / 3 + log2 / 2) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((log2 / 3 + log2 / 2) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


def test_kl_in_reward_updates_an_adaptive_coefficient_after_reporting_the_one_it_used():
    controller = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    metrics = apply_kl_in_reward(_kl_batch(), controller, "kl", n_steps=10)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    # KL ~0.29 > target: error clipped to 0.2, beta *= 1 + 0.2 * 10 / 100
    assert controller.value == pytest.approx(0.1 * 1.02)


def _build(*overrides: str, rollout_wg=None):
    from verl.trainer.config import load_ppo_config

    config = load_ppo_config(list(overrides), config_name="arith_demo")
    scorer = RewardScorer(exact_match)
    source = build_rollout_source(
        config,
        prompts=PromptStream([], current_step=lambda: 1),
        scorer=scorer,
        actor_wg=ScriptedRollout(),
        tokenizer=TOKENIZER,
        current_step=lambda: 1,
        total_steps=lambda: 10,
        rollout_wg=rollout_wg,
    )
    return source, scorer


def test_the_config_chooses_the_source_and_hands_it_its_parts():
    source, scorer = _build()
    assert type(source) is SyncRolloutSource and source.scorer is scorer
    assert source.generator.baseline_scorer is None and source.generator.n == 8  # arith_demo's rollout.n

    source, scorer = _build("algorithm.adv_estimator=remax")
    assert source.generator.baseline_scorer is scorer

    dapo = (
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=3",
    )
    source, _ = _build(*dapo)
    assert type(source) is FilteringRolloutSource
    assert (source.metric, source.max_num_gen_batches, source.train_batch_size) == ("acc", 3, 32)
    assert not source.runs_ahead

    pool = SimpleNamespace(world_size=1)  # the async source only keeps its rollout group until the first step
    source, scorer = _build("async_training.staleness_threshold=1", rollout_wg=pool)
    assert type(source) is AsyncRolloutSource and source.runs_ahead
    assert source.rollout_wg is pool and source.score is scorer


def _skip_source(tmp_path, rollout, prompt_batches, *overrides):
    from verl.trainer.config import load_ppo_config

    config = load_ppo_config(
        [
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.skip_rollout=true",
            f"actor_rollout_ref.rollout.skip_dump_dir={tmp_path}",
            *overrides,
        ],
        config_name="arith_demo",
    )
    step = iter(range(1, 100))
    current = [0]

    def current_step():
        return current[0]

    source = build_rollout_source(
        config,
        prompts=PromptStream(prompt_batches, current_step=current_step),
        scorer=RewardScorer(exact_match),
        actor_wg=rollout,
        tokenizer=TOKENIZER,
        current_step=current_step,
        total_steps=lambda: 10,
    )

    def next_batch():
        current[0] = next(step)
        state = StepState()
        return source.next_batch(state), state

    return source, next_batch


def _assert_same_batch(a: DataProto, b: DataProto):
    keys = sorted(a.batch.keys())
    assert keys == sorted(b.batch.keys())
    for key in keys:
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist(), key


def test_skip_rollout_dumps_the_first_rollout_and_replays_it_in_later_steps_and_runs(tmp_path):
    # run 1: step 1 generates (the only scripted call) and writes upstream's file; step 2 replays it
    rollout = ScriptedRollout([CORRECT, 0, 0, CORRECT])
    batches = [_prompts(2, first=0), _prompts(2, first=2)]
    _, next_batch = _skip_source(tmp_path, rollout, batches)
    first, state = next_batch()
    assert (tmp_path / "__GBS2__N2").is_file() and state.metrics["rollout/replayed"] == 0.0
    second, state = next_batch()
    assert len(rollout.inputs) == 1 and state.metrics["rollout/replayed"] == 1.0
    _assert_same_batch(first, second)  # step 1's samples, scored against their own prompts
    assert second.batch["token_level_scores"][:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert second.non_tensor_batch["uid"].tolist() == ["1_0", "1_0", "1_1", "1_1"]

    # run 2 (a fresh source, an engine with nothing scripted): never calls the engine
    engine = ScriptedRollout()
    _, next_batch = _skip_source(tmp_path, engine, batches)
    replayed, _ = next_batch()
    assert engine.inputs == []
    _assert_same_batch(first, replayed)

    # another batch size or n: a file of its own, generated anew
    other = ScriptedRollout([CORRECT] * 6)
    _, next_batch = _skip_source(tmp_path, other, batches, "actor_rollout_ref.rollout.n=3")
    next_batch()
    assert len(other.inputs) == 1 and (tmp_path / "__GBS2__N3").is_file()


def test_skip_rollout_regenerates_over_an_unreadable_dump_and_refuses_a_dump_of_the_wrong_size(tmp_path):
    (tmp_path / "__GBS2__N2").write_bytes(b"not a torch file")
    rollout = ScriptedRollout([CORRECT, 0, 0, CORRECT])
    _, next_batch = _skip_source(tmp_path, rollout, [_prompts(2)])
    next_batch()
    assert len(rollout.inputs) == 1  # regenerated (upstream's rule) and overwritten with a readable dump
    _, next_batch = _skip_source(tmp_path, ScriptedRollout(), [_prompts(1)])  # one prompt: 2 samples, dump has 4
    with pytest.raises(ValueError, match=r"holds 4 samples, but this step needs 1 prompts x rollout.n=2 = 2"):
        next_batch()


def test_skip_rollout_is_refused_with_dynamic_sampling_and_async_training():
    from verl.trainer.config import ConfigError, load_ppo_config

    for extra, match in (
        ("algorithm.filter_groups.enable=true", "filter_groups.enable=true: dynamic sampling"),
        ("async_training.staleness_threshold=1", "staleness_threshold > 0: the rollouts"),
    ):
        with pytest.raises(ConfigError, match=match):  # loading validates
            load_ppo_config(["actor_rollout_ref.rollout.skip_rollout=true", extra], config_name="arith_demo")
