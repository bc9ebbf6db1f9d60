"""The actor and critic skip columns that are padding in every row of a micro-batch.

Checked against per-sequence forwards (no padding at all) on batches whose every row has extra
left and right padding, and against a hand-worked window."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, make_tiny_causal_lm, one_thread, reference_response_log_probs
from tests.workers.actor.test_dp_actor import TEMPERATURE, actor_config
from verl.protocol import DataProto
from verl.workers.actor import DataParallelPPOActor
from verl.workers.dp_training import pad_response_columns, token_window

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def test_window_hand_worked():
    # prompt columns 0-3, response columns 4-7; column 0 and columns 6-7 are empty in both rows
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]])
    assert token_window(mask, 4) == (1, 6, 2)
    # every response empty: still one response column (its logits come from the last prompt column)
    assert token_window(torch.tensor([[0, 1, 1, 1, 0, 0]]), 2) == (1, 5, 1)
    # nothing to skip
    assert token_window(torch.ones(2, 5, dtype=torch.long), 2) == (0, 5, 2)
    padded = pad_response_columns(torch.tensor([[1.0, 2.0]]), 4)
    assert padded.tolist() == [[1.0, 2.0, 0.0, 0.0]]


def test_actor_log_probs_on_a_trimmed_batch_equal_per_sequence_forwards():
    # prompts of 2-4 tokens in 9 columns, responses of 1-3 tokens in 7: >= 5 + 4 empty columns
    td = make_ppo_batch(
        batch_size=6,
        prompt_length=9,
        response_length=7,
        prompt_lengths=[2, 4, 3, 2, 4, 3],
        response_lengths=[1, 3, 2, 3, 1, 2],
    )
    start, end, kept = token_window(td["attention_mask"], 7)
    assert (start, end, kept) == (5, 12, 3)
    model = make_tiny_causal_lm()
    expected_lp, expected_ent = reference_response_log_probs(model, td, TEMPERATURE)
    actor = DataParallelPPOActor(actor_config(), model)
    data = DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": TEMPERATURE, "micro_batch_size": 4})
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    mask = td["response_mask"].bool()
    assert log_probs.shape == entropy.shape == (6, 7)
    torch.testing.assert_close(log_probs[mask], expected_lp[mask], atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy[mask], expected_ent[mask], atol=1e-12, rtol=0)
    assert (log_probs[:, kept:] == 0).all() and (entropy[:, kept:] == 0).all()  # skipped columns are padding
