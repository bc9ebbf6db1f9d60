"""The actor on a mixture-of-experts model (tiny-moe: transformers' Qwen3MoeForCausalLM), float64.

References: the load-balancing term of an update is checked against a plain packed forward of the
model (its own `router_logits` output, not the actor's hooks) through `load_balancing_loss`, which
tests/models/test_moe.py checks by hand; the FSDP update over 2 ranks against one process.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import one_thread, run_distributed
from tests.workers.actor.test_dp_actor import actor_config, param_delta, sgd_actor, training_batch
from verl.models.moe import METRIC, load_balancing_loss
from verl.utils.remove_padding import unpad_input, unpad_position_ids
from verl.workers.actor import DataParallelPPOActor

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

COEF = 0.5


def moe_lm(output_router_logits: bool = True):
    from transformers import AutoModelForCausalLM

    from verl.models.factory import build_config

    config = build_config("tiny-moe")
    config.output_router_logits = output_router_logits
    config.router_aux_loss_coef = COEF
    torch.manual_seed(0)
    # transformers' default grouped-matmul experts have no float64 kernel on CPU: the plain loop does
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    return model.to(torch.float64)


def moe_config(**overrides):
    # one micro-batch per mini-batch unless told otherwise: the load-balancing loss of a micro-batch
    # is a mean over its own tokens, so the split is part of what is compared
    base = dict(use_remove_padding=True, share_prompt_forward=False, ppo_mini_batch_size=4)
    base.update(ppo_micro_batch_size_per_gpu=4)
    base.update(overrides)
    return actor_config(**base)


def packed_aux_loss_and_grad(model, data):
    """(aux loss, {name: d aux / d weight}) from one plain forward of the packed batch."""
    td = data.batch
    ids, indices = unpad_input(td["input_ids"], td["attention_mask"])
    pos = unpad_position_ids(td["position_ids"], indices)
    out = model(input_ids=ids, position_ids=pos, use_cache=False, output_router_logits=True)
    aux = load_balancing_loss(list(out.router_logits), model.config.num_experts_per_tok)
    grads = torch.autograd.grad(aux, [p for _, p in model.named_parameters()], allow_unused=True)
    names = [n for n, _ in model.named_parameters()]
    return aux.detach(), {
        n: (g if g is not None else torch.zeros_like(p)) for n, g, p in zip(names, grads, model.parameters())
    }


def test_update_adds_coef_times_the_load_balancing_gradient_and_logs_the_loss():
    data = training_batch(batch_size=4, seed=3)
    with_aux = sgd_actor(moe_config(), moe_lm(output_router_logits=True))
    without = sgd_actor(moe_config(), moe_lm(output_router_logits=False))
    assert with_aux.router_aux.enabled and not without.router_aux.enabled
    metrics = with_aux.update_policy(data)
    plain_metrics = without.update_policy(data)

    aux, grads = packed_aux_loss_and_grad(moe_lm(), data)
    assert metrics[METRIC] == [pytest.approx(aux.item(), rel=1e-12)]
    assert METRIC not in plain_metrics
    # SGD lr=1, one micro-batch holding the whole mini-batch: the two updates differ by -coef * grad
    delta_with, delta_without = (
        param_delta(moe_lm(), with_aux.actor_module),
        param_delta(moe_lm(), without.actor_module),
    )
    router_moved = 0.0
    for name, grad in grads.items():
        # Not float64-tight: transformers' Qwen3-MoE router takes its softmax in float32, so a gradient
        # crossing a lower layer's router is rounded to float32 there, and the rounding of (pg + aux)
        # is not the sum of the roundings (measured: <= 1.4e-8 against gradients up to 0.08; the layer
        # above the last router crossing matches to 1e-16). A wrong coefficient or weight is off by ~1e-2.
        torch.testing.assert_close(delta_with[name] - delta_without[name], -COEF * grad, atol=1e-7, rtol=0, msg=name)
        if "gate" in name and "proj" not in name:
            router_moved = max(router_moved, grad.abs().max().item())
    assert router_moved > 1e-4, "the load-balancing loss must reach the router weights"


def test_aux_loss_also_equals_the_one_transformers_reports():
    model = moe_lm()
    data = training_batch(batch_size=4, seed=3)
    aux, _ = packed_aux_loss_and_grad(model, data)
    td = data.batch
    ids, indices = unpad_input(td["input_ids"], td["attention_mask"])
    out = model(input_ids=ids, position_ids=unpad_position_ids(td["position_ids"], indices), use_cache=False)
    assert aux.item() == pytest.approx(out.aux_loss.item(), rel=1e-6)  # transformers sums in float32


def test_shared_prompt_forward_records_the_routers_of_both_of_its_passes():
    # GRPO-shaped: every prompt twice, so the shared-prompt forward (a prompt pass, then the responses
    # packed on its cache, with a 4-D mask transformers' own aux loss cannot read) is taken
    data = training_batch(batch_size=4, seed=3).repeat(2, interleave=True)
    actor = sgd_actor(
        moe_config(share_prompt_forward=True, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8), moe_lm()
    )
    assert actor.share_prompt_forward
    calls = []
    with actor.router_aux.recording() as logits:
        actor.actor_module.register_forward_hook(lambda *_: calls.append(1))
        metrics = actor.update_policy(data)
    assert 0 < metrics[METRIC][0] <= 8.0, metrics[METRIC]  # <= E * k = 4 * 2
    assert len(calls) == 2 and len(logits) == 2 * 2, "two forwards x two MoE layers"
    tokens = sum(t.shape[0] for t in logits[::2])
    assert tokens < int(data.batch["attention_mask"].sum()), "each prompt routed once, not once per row"


def test_padded_forward_with_the_aux_loss_is_refused_when_the_actor_is_built():
    with pytest.raises(ValueError, match="use_remove_padding=true"):
        sgd_actor(moe_config(use_remove_padding=False), moe_lm())


def _two_rank_moe_update(rank, world_size):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params

    data = training_batch(batch_size=8, seed=5)
    local = data.slice(rank * 4, (rank + 1) * 4)
    model = apply_fsdp2(moe_lm(), {"fsdp_size": -1})  # expert weights [E, ...] sharded over both ranks
    actor = DataParallelPPOActor(moe_config(), model, torch.optim.SGD(model.parameters(), lr=1.0))
    metrics = actor.update_policy(local)
    # one process, the same micro-batches (rows 0-3 and 4-7) one after the other
    single = sgd_actor(moe_config(ppo_mini_batch_size=8), moe_lm())
    single_metrics = single.update_policy(data)
    full = dict(iter_full_params(model))
    moved = 0.0
    for name, tensor in single.actor_module.state_dict().items():
        torch.testing.assert_close(full[name], tensor, atol=1e-11, rtol=1e-9, msg=name)
        moved = max(moved, (tensor - moe_lm().get_parameter(name)).abs().max().item())
    assert moved > 1e-3, "the update must move the weights for the comparison to mean anything"
    assert metrics["actor/grad_norm"][0] == pytest.approx(single_metrics["actor/grad_norm"][0], rel=1e-9)
    assert metrics[METRIC][0] == pytest.approx(single_metrics[METRIC][rank], rel=1e-12)


def test_fsdp_update_of_a_moe_model_on_two_ranks_equals_one_process():
    run_distributed(_two_rank_moe_update, 2)


@pytest.mark.gpu
def test_moe_update_on_the_gpu_logs_the_load_balancing_loss_of_a_plain_forward(monkeypatch):
    """transformers' default experts kernel (grouped matmul where the GPU has it) in float32 on CUDA:
    the update runs, and the logged loss is the one a plain packed forward of the same weights gives."""
    from transformers import AutoModelForCausalLM

    from verl.models.factory import build_config

    monkeypatch.setenv("VERL_DEVICE", "auto")
    config = build_config("tiny-moe")
    config.output_router_logits, config.router_aux_loss_coef = True, COEF
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to("cuda")
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to("cuda")
    reference.load_state_dict(model.state_dict())
    data = training_batch(batch_size=4, seed=3)
    for key in ("old_log_probs", "advantages"):
        data.batch[key] = data.batch[key].float()
    actor = sgd_actor(moe_config(), model, lr=1e-2)
    metrics = actor.update_policy(data)
    td = data.batch.to("cuda")
    ids, indices = unpad_input(td["input_ids"], td["attention_mask"])
    with torch.no_grad():
        # asked for explicitly: some transformers releases share the config object between the two
        # models, whose `output_router_logits` the actor switched off when it took the loss over
        out = reference(
            input_ids=ids,
            position_ids=unpad_position_ids(td["position_ids"], indices),
            use_cache=False,
            output_router_logits=True,
        )
        expected = load_balancing_loss(list(out.router_logits), 2).item()
    got = metrics[METRIC][0]
    assert got == pytest.approx(expected, rel=1e-4), f"logged {got}, plain forward {expected}"
    assert 0 < got <= 8.0, got
    moved = (model.model.layers[0].mlp.gate.weight - reference.model.layers[0].mlp.gate.weight).abs().max().item()
    assert moved > 0, "the update must move the router"
