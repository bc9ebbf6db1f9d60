"""The fused linear -> log-softmax -> gather (+ entropy) against a float64 unfused reference: values
and both gradients, at temperatures other than 1, with a weight shared with an embedding (tied), and
as the LM head of a real (tiny) HF model."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import make_tiny_causal_lm
from verl.utils.experimental.torch_functional import (
    FusedLinearForPPO,
    check_fused_backend,
    fused_linear_for_ppo,
    fused_lm_head,
)


def _reference(hidden, weight, labels, temperature):
    """Unfused float64: the full logits, log_softmax, gather; entropy from the probabilities."""
    logits = (hidden.double() @ weight.double().t()) / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def _inputs(tokens=37, hidden_size=16, vocab=53, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    # a loss that weights every token's log-prob and entropy differently, so a wrong gradient shows
    w_lp = torch.randn(tokens, generator=gen, dtype=torch.float64)
    w_ent = torch.randn(tokens, generator=gen, dtype=torch.float64)
    return hidden, weight, labels, w_lp, w_ent


def _grads(fn, hidden, weight, labels, temperature, w_lp, w_ent, dtype):
    hidden = hidden.detach().to(dtype).clone().requires_grad_()
    weight = weight.detach().to(dtype).clone().requires_grad_()
    log_probs, entropy = fn(hidden, weight, labels, temperature)
    ((log_probs.double() * w_lp).sum() + (entropy.double() * w_ent).sum()).backward()
    return log_probs.detach().double(), entropy.detach().double(), hidden.grad.double(), weight.grad.double()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", [5, 512])  # several chunks with a ragged last one, and one chunk
def test_values_and_gradients_equal_the_float64_unfused_reference(temperature, chunk_size):
    hidden, weight, labels, w_lp, w_ent = _inputs()
    want = _grads(_reference, hidden, weight, labels, temperature, w_lp, w_ent, torch.float64)

    def fused(h, w, y, t):
        return fused_linear_for_ppo(h, w, y, t, chunk_size=chunk_size)

    got = _grads(fused, hidden, weight, labels, temperature, w_lp, w_ent, torch.float32)
    for name, g, r in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=2e-5, atol=2e-5, msg=name)
    # float64 inputs stay float64: the fused path is then exact to rounding
    exact = _grads(fused, hidden, weight, labels, temperature, w_lp, w_ent, torch.float64)
    for g, r in zip(exact, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_log_prob_only_loss_skips_the_entropy_gradient_and_matches_the_reference():
    hidden, weight, labels, w_lp, _ = _inputs(seed=1)
    h = hidden.clone().requires_grad_()
    log_probs, _ = fused_linear_for_ppo(h, weight, labels, 0.9, chunk_size=8)
    (log_probs.double() * w_lp).sum().backward()
    h_ref = hidden.double().requires_grad_()
    ref, _ = _reference(h_ref, weight, labels, 0.9)
    (ref * w_lp).sum().backward()
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=2e-5, atol=2e-5)


def test_tied_weight_gets_the_sum_of_its_embedding_and_head_gradients():
    gen = torch.Generator().manual_seed(2)
    vocab, hidden_size, tokens = 41, 12, 23
    table = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    labels = torch.roll(ids, -1)
    mix = torch.randn(hidden_size, hidden_size, generator=gen, dtype=torch.float64)

    def loss(fn, dtype):
        weight = table.to(dtype).requires_grad_()
        hidden = torch.tanh(weight[ids] @ mix.to(dtype))  # the same weight as embedding and as head
        log_probs, entropy = fn(hidden, weight, labels, 1.3)
        (log_probs.double().sum() + 0.1 * entropy.double().sum()).backward()
        return weight.grad.double()

    want = loss(_reference, torch.float64)
    got = loss(fused_linear_for_ppo, torch.float32)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_module_form_and_leading_dimensions():
    hidden, weight, labels, _, _ = _inputs()
    lp, ent = FusedLinearForPPO(chunk_size=7)(hidden[None], weight, labels[None], temperature=0.5)
    ref_lp, ref_ent = _reference(hidden, weight, labels, 0.5)
    assert lp.shape == ent.shape == (1, hidden.shape[0])
    torch.testing.assert_close(lp[0].double(), ref_lp, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent[0].double(), ref_ent, rtol=2e-5, atol=2e-5)


def test_bad_inputs_are_refused_with_the_reason():
    hidden, weight, labels, _, _ = _inputs()
    with pytest.raises(ValueError, match="temperature=0"):
        fused_linear_for_ppo(hidden, weight, labels, 0.0)
    with pytest.raises(ValueError, match="agree on every dimension"):
        fused_linear_for_ppo(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match=r"must be \[vocab, 16\]"):
        fused_linear_for_ppo(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="impl_backend='triton' is not implemented"):
        check_fused_backend({"impl_backend": "triton"})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['chunk_size'\]"):
        check_fused_backend({"impl_backend": "torch", "chunk_size": 64})
    assert check_fused_backend({"impl_backend": "torch"}) == check_fused_backend(None) == "torch"


def test_fused_lm_head_makes_a_tiny_hf_model_return_log_probs_and_entropy():
    model = make_tiny_causal_lm(seed=3, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings  # the head is the embedding
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double() / 0.8
        with fused_lm_head(model, labels, 0.8):
            out = model(input_ids=ids).logits
    log_softmax = torch.log_softmax(logits, -1)
    torch.testing.assert_close(
        out[..., 0].double(), log_softmax.gather(-1, labels[..., None])[..., 0], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(out[..., 1].double(), -(log_softmax.exp() * log_softmax).sum(-1), rtol=1e-5, atol=1e-5)
    # the head is itself again after the block
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size


def test_fused_lm_head_refuses_a_head_with_a_bias():
    model = make_tiny_causal_lm(dtype=torch.float32, tie_word_embeddings=False)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with pytest.raises(ValueError, match="has a bias"), fused_lm_head(model, torch.zeros(1, 1, dtype=torch.long), 1.0):
        pass


def test_masked_ids_are_outside_the_policy_in_values_and_gradients():
    """`masked_ids` (a vision-language model's input-only markers): the float64 reference with those
    logits at -inf, values and gradients; the masked tokens' rows of the weight get no gradient."""
    hidden, weight, labels, w_lp, w_ent = _inputs()
    masked = [3, 17, 51]
    labels = torch.where(torch.isin(labels, torch.tensor(masked)), labels + 1, labels)  # sampled tokens never masked

    def reference(h, w, y, t):
        logits = ((h.double() @ w.double().t()) / t).index_fill(-1, torch.tensor(masked), float("-inf"))
        log_softmax = torch.log_softmax(logits, dim=-1)
        probs = log_softmax.exp()
        entropy = -(probs * log_softmax.clamp(min=-1e300)).sum(-1)
        return log_softmax.gather(-1, y[..., None]).squeeze(-1), entropy

    def fused(h, w, y, t):
        return fused_linear_for_ppo(h, w, y, t, chunk_size=5, masked_ids=masked)

    want = _grads(reference, hidden, weight, labels, 0.7, w_lp, w_ent, torch.float64)
    got = _grads(fused, hidden, weight, labels, 0.7, w_lp, w_ent, torch.float64)
    for name, g, r in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=name)
    assert torch.equal(got[3][masked], torch.zeros_like(got[3][masked]))
    # and it differs from the unmasked policy
    unmasked = _grads(_reference, hidden, weight, labels, 0.7, w_lp, w_ent, torch.float64)
    assert (unmasked[0] - got[0]).abs().min() > 1e-6
