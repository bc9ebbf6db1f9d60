"""The MoE load-balancing loss against hand-worked float64 numbers, its gradient against the closed
form, transformers' own implementation as a second reference, and the tiny-moe preset."""

from __future__ import annotations

import math

import pytest
import torch

from verl.models.factory import build_model, get_preset, make_tiny
from verl.models.moe import RouterAuxLoss, is_moe, load_balancing_loss


def _logits(probs) -> torch.Tensor:
    """Router logits whose softmax is exactly `probs` (rows summing to 1)."""
    return torch.tensor(probs, dtype=torch.float64).log()


def test_top1_loss_by_hand():
    # token 0 -> expert 0, token 1 -> expert 1: f = [1/2, 1/2, 0], P = [0.35, 0.425, 0.225]
    # loss = 3 * (0.5 * 0.35 + 0.5 * 0.425) = 1.1625
    logits = _logits([[0.5, 0.25, 0.25], [0.2, 0.6, 0.2]])
    assert load_balancing_loss([logits], top_k=1).item() == pytest.approx(1.1625, abs=1e-15)


def test_top2_loss_over_two_layers_by_hand():
    # layer 1: token 0 picks {0, 1}, token 1 picks {1, 2}; layer 2: one token picking {2, 0}
    # choices per expert over the 3 routed rows: [2, 2, 2] -> f = [2/3, 2/3, 2/3]
    # P = mean of the 3 rows = ([0.5, 0.3, 0.2] + [0.1, 0.6, 0.3] + [0.4, 0.1, 0.5]) / 3 = [1/3, 1/3, 1/3]
    # loss = 3 * 3 * (2/3 * 1/3) = 2 (balanced routing with k = 2 gives k)
    layer1 = _logits([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    layer2 = _logits([[0.4, 0.1, 0.5]])
    assert load_balancing_loss([layer1, layer2], top_k=2).item() == pytest.approx(2.0, abs=1e-15)


def test_all_tokens_on_one_expert_with_certainty_gives_the_maximum():
    logits = torch.tensor([[60.0, 0.0, 0.0, 0.0]] * 5, dtype=torch.float64)  # softmax 1, 0, 0, 0 to 1e-26
    assert load_balancing_loss([logits], top_k=1).item() == pytest.approx(4.0, abs=1e-12)


def test_gradient_flows_through_the_probabilities_only_as_the_closed_form_says():
    # L = E/T * sum_t sum_e f_e p_te with f fixed, so dL/dz_tj = E/T * p_tj * (f_j - sum_e f_e p_te)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    load_balancing_loss([logits], top_k=2).backward()
    p = torch.softmax(logits.detach(), dim=-1)
    chosen = torch.topk(p, 2, dim=-1).indices
    f = torch.zeros(4, dtype=torch.float64)
    for row in chosen.tolist():
        for e in row:
            f[e] += 1 / 6
    expected = 4 / 6 * p * (f - (p * f).sum(dim=-1, keepdim=True))
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-15)


def test_equals_transformers_own_implementation():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(1)
    layers = tuple(torch.randn(9, 5, generator=g) for _ in range(3))
    ours = load_balancing_loss(list(layers), top_k=2)
    theirs = load_balancing_loss_func(layers, num_experts=5, top_k=2)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_tiny_moe_preset_is_transformers_qwen3_moe_and_round_trips_through_an_hf_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    preset = get_preset("tiny-moe")
    model, _ = build_model("tiny-moe")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert is_moe(model.config) and model.config.num_experts == preset.num_experts == 4
    assert model.config.num_experts_per_tok == 2 and not model.config.output_router_logits
    path = make_tiny("tiny-moe", str(tmp_path / "moe"))
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    # routing spreads tokens: a router with all-zero weights would tie every expert
    out = loaded(input_ids=ids, output_router_logits=True)
    assert len(out.router_logits) == preset.num_hidden_layers
    assert float(out.router_logits[0].detach().std()) > 0


def test_a_preset_with_experts_must_be_a_moe_architecture():
    from verl.models.factory import ModelPreset

    with pytest.raises(ValueError, match="experts belong to"):
        ModelPreset("qwen2", 128, 2, 2, 2, 256, num_experts=4, num_experts_per_tok=2)


def _moe_model(**config):
    from transformers import AutoModelForCausalLM

    from verl.models.factory import build_config

    cfg = build_config("tiny-moe")
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_aux_loss_is_off_for_dense_models_and_unless_the_config_asks_for_router_logits():
    dense, _ = build_model("tiny")
    assert not RouterAuxLoss(dense, use_remove_padding=True, sp_size=1).enabled
    assert not RouterAuxLoss(_moe_model(), use_remove_padding=True, sp_size=1).enabled


def test_a_reference_policy_that_never_trains_has_no_aux_loss_whatever_its_layout():
    model = _moe_model(output_router_logits=True)
    assert not RouterAuxLoss(model, use_remove_padding=False, sp_size=2, trains=False).enabled


def test_recorded_router_logits_give_the_loss_transformers_reports():
    model = _moe_model(output_router_logits=True, router_aux_loss_coef=0.3)
    aux = RouterAuxLoss(model, use_remove_padding=True, sp_size=1)
    assert aux.enabled and aux.coef == 0.3 and aux.top_k == 2
    ids = torch.tensor([[5, 9, 14, 3, 7, 21]])
    assert not model.config.output_router_logits, "the actor owns the flag: no second copy in the forward"
    with aux.recording() as logits:
        out = model(input_ids=ids, output_router_logits=True)
    assert len(logits) == 2 and all(t.requires_grad for t in logits)
    assert aux.loss(logits).item() == pytest.approx(out.aux_loss.item(), rel=1e-6)
    with aux.recording() as outside:
        pass
    model(input_ids=ids)  # hooks are gone once the block ends
    assert outside == []


@pytest.mark.parametrize(
    ("remove_padding", "sp", "match"),
    [(False, 1, "use_remove_padding=true"), (True, 2, "ulysses_sequence_parallel_size=2")],
)
def test_aux_loss_refuses_layouts_where_it_would_count_other_tokens(remove_padding, sp, match):
    model = _moe_model(output_router_logits=True)
    with pytest.raises(ValueError, match=match):
        RouterAuxLoss(model, use_remove_padding=remove_padding, sp_size=sp)


def test_uniform_router_gives_top_k():
    logits = torch.zeros(8, 4, dtype=torch.float64)  # every probability 1/4; ties pick some k experts
    value = load_balancing_loss([logits], top_k=2).item()
    # f sums to k whatever the ties pick, P = 1/4 each: E * sum_e f_e / 4 = k
    assert math.isclose(value, 2.0, abs_tol=1e-15)
