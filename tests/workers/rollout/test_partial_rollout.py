"""Partial rollouts in the built-in engine: newer weights arriving mid-generation are loaded
between two decode steps and the unfinished rows go on with them.

The reference scores every sampled token with each weight version in float64 by a plain HF
forward over prompt + response (no KV cache, nothing shared with the engine): the rollout's
log-prob of a token must be the one of the version that sampled it.
"""

from __future__ import annotations

import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import SwapTo, build_model, response_log_probs, sampled_prompt_batch
from verl.protocol import DataProto
from verl.workers.rollout.hf_rollout import HFRollout

PAD = 0
# Many stop tokens, so that with 8 sampled rows some stop before the pause and some go on past it.
EOS = list(range(2, 10))
R = 10
PAUSE_AFTER = 3  # partial_rollout_check_steps: the first check comes after 3 sampled columns
LENGTHS = [6, 2, 4, 5, 3, 6, 4, 2, 5, 3, 4, 6]


def _prompts(**meta) -> DataProto:
    return sampled_prompt_batch(LENGTHS, EOS, PAD, **meta)


def _rollout(model) -> HFRollout:
    return HFRollout(model, engine_config(response_length=R, calculate_log_probs=True, temperature=1.0), device="cpu")


def test_interrupted_rows_hold_tokens_of_two_versions_each_with_the_log_probs_of_the_version_that_sampled_it():
    v0, v1 = build_model("qwen2", seed=0), build_model("qwen2", seed=1)
    rollout = _rollout(v0)
    rollout.weight_refresh = SwapTo(rollout, v1)
    torch.manual_seed(0)
    out = rollout.generate_sequences(_prompts(partial_rollout=True, partial_rollout_check_steps=PAUSE_AFTER))

    mask = out.batch["response_mask"].bool()
    interrupted = mask[:, PAUSE_AFTER].numpy()  # still generating when the new weights came in
    assert interrupted.sum() >= 2 and (~interrupted).sum() >= 1, "need rows on both sides for the test to mean much"
    assert out.non_tensor_batch["weight_version"].tolist() == [0] * len(LENGTHS)
    assert out.non_tensor_batch["weight_version_max"].tolist() == interrupted.astype(int).tolist()

    got = out.batch["rollout_log_probs"].double()
    lp0, lp1 = response_log_probs(v0, out), response_log_probs(v1, out)
    before, after = slice(0, PAUSE_AFTER), slice(PAUSE_AFTER, R)
    torch.testing.assert_close(got[:, before], lp0[:, before], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[:, after], lp1[:, after], atol=1e-4, rtol=0)
    # the two versions disagree on the continued tokens, so the check above tells them apart
    assert (lp0[:, after] - lp1[:, after]).abs().max() > 0.1
    # and the tokens after the pause are what v1 samples: the engine really switched weights
    assert rollout.weight_refresh.version == 1
    torch.testing.assert_close(
        dict(rollout.engine.decoder._targets)["model.norm.weight"], v1.state_dict()["model.norm.weight"]
    )


def test_without_partial_rollout_or_without_new_weights_generation_is_unchanged():
    v0, v1 = build_model("qwen2", seed=0), build_model("qwen2", seed=1)
    torch.manual_seed(5)
    plain = _rollout(v0).generate_sequences(_prompts())

    # partial rollouts off: weights waiting are not looked at, every token comes from v0
    off = _rollout(v0)
    off.weight_refresh = SwapTo(off, v1, waiting=True)
    torch.manual_seed(5)
    out_off = off.generate_sequences(_prompts(partial_rollout=False, partial_rollout_check_steps=1))
    assert off.weight_refresh.num_checks == 0 and off.weight_refresh.version == 0
    assert "weight_version" not in out_off.non_tensor_batch  # the worker stamps its single version

    # partial rollouts on but nothing newer arrives: checked every step, same samples
    on = _rollout(v0)
    on.weight_refresh = SwapTo(on, v1, waiting=False)
    torch.manual_seed(5)
    out_on = on.generate_sequences(_prompts(partial_rollout=True, partial_rollout_check_steps=1))
    assert on.weight_refresh.num_checks > 0
    assert out_on.non_tensor_batch["weight_version_max"].tolist() == [0] * len(LENGTHS)

    for out in (out_off, out_on):
        for key in ("responses", "response_mask", "rollout_log_probs", "input_ids", "position_ids"):
            assert torch.equal(out.batch[key], plain.batch[key]), key
    lp0 = response_log_probs(v0, plain)
    torch.testing.assert_close(plain.batch["rollout_log_probs"].double(), lp0, atol=1e-4, rtol=0)
