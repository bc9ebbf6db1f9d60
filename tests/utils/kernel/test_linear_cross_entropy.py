"""linear_cross_entropy (upstream's signature) against the logits written out in float64."""

import pytest
import torch

from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy


def _reference(hidden, weight, labels, temperature):
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t() / temperature
    log_probs = -torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="none")
    probs = logits.softmax(-1)
    entropy = torch.logsumexp(logits, -1) - (probs * logits).sum(-1)
    return log_probs, entropy


def _inputs(tokens=37, hidden_size=8, vocab=50):
    torch.manual_seed(0)
    hidden = torch.randn(1, tokens, hidden_size, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_log_probs_entropy_and_their_gradients_equal_the_written_out_logits(reduction):
    hidden, weight, labels = _inputs()
    log_probs, entropy = linear_cross_entropy(hidden, weight, labels, 1.5, reduction)
    ref_lp, ref_ent = _reference(hidden, weight, labels, 1.5)
    ref_lp = {"none": ref_lp, "sum": ref_lp.sum(), "mean": ref_lp.mean()}[reduction]
    assert log_probs.shape == ref_lp.shape and entropy.shape == (37,)
    torch.testing.assert_close(log_probs, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_ent, rtol=1e-12, atol=1e-12)
    g_lp = torch.randn_like(log_probs)
    g_ent = torch.randn_like(entropy)
    grads = torch.autograd.grad((log_probs, entropy), (hidden, weight), (g_lp, g_ent))
    ref_grads = torch.autograd.grad((ref_lp, ref_ent), (hidden, weight), (g_lp, g_ent))
    for mine, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-12)


def test_bfloat16_inputs_give_float32_outputs_close_to_float64():
    hidden, weight, labels = _inputs(tokens=20, hidden_size=128, vocab=300)
    log_probs, entropy = linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), labels, 1.0)
    assert log_probs.dtype == entropy.dtype == torch.float32
    ref_lp, ref_ent = _reference(hidden.bfloat16().double(), weight.bfloat16().double(), labels, 1.0)
    torch.testing.assert_close(log_probs.double(), ref_lp, rtol=1e-2, atol=0.5)
    torch.testing.assert_close(entropy.double(), ref_ent, rtol=1e-2, atol=0.5)


def test_a_bad_reduction_or_label_count_is_refused():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="Invalid reduction"):
        linear_cross_entropy(hidden, weight, labels, 1.0, "max")
    with pytest.raises(ValueError, match="one label per token"):
        linear_cross_entropy(hidden, weight, labels[:, :-1], 1.0)
