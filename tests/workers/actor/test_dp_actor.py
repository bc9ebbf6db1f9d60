"""DataParallelPPOActor: log-probs against per-sequence HF forwards, update semantics, FSDP2 on 2 ranks.

Single-process tests use a plain float64 module (the actor does not need FSDP); the 2-rank test
shards the same model with FSDP2 over gloo and compares against the single-process actor.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import (
    make_ppo_batch,
    make_tiny_causal_lm,
    one_thread,
    reference_response_log_probs,
    run_distributed,
)
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn
from verl.workers.actor import DataParallelPPOActor

TEMPERATURE = 0.7

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def actor_config(**overrides):
    config = {
        "ppo_mini_batch_size": 8,
        "ppo_micro_batch_size_per_gpu": 2,
        "use_dynamic_bsz": False,
        "ppo_max_token_len_per_gpu": 24,
        "ppo_epochs": 1,
        "grad_clip": 1e9,
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
        "policy_loss": {"loss_mode": "vanilla"},
        "use_remove_padding": False,
        "ulysses_sequence_parallel_size": 1,
    }
    config.update(overrides)
    return config


def training_batch(batch_size=8, seed=0, advantages=None, **kwargs) -> DataProto:
    """A batch whose old log-probs are the model's own (ratio 1) and advantages are +-1 per sequence."""
    td = make_ppo_batch(batch_size=batch_size, seed=seed, **kwargs)
    model = make_tiny_causal_lm()
    old, _ = reference_response_log_probs(model, td, TEMPERATURE)
    if advantages is None:
        sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(batch_size)], dtype=torch.float64)
        advantages = sign[:, None].expand_as(old).clone()
    td["old_log_probs"] = old
    td["advantages"] = advantages * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": TEMPERATURE})


def sgd_actor(config, model=None, lr=1.0):
    model = model or make_tiny_causal_lm()
    return DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=lr))


def param_delta(before: torch.nn.Module, after: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() - before.get_parameter(n).detach() for n, p in after.named_parameters()}


def assert_same_delta(a: dict, b: dict, atol=1e-11):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-9, msg=name)


def reference_full_batch_delta(data: DataProto, loss_agg_mode: str) -> dict[str, torch.Tensor]:
    """-grad of the policy loss over the whole mini-batch in one padded forward (SGD lr=1 delta)."""
    model = make_tiny_causal_lm()
    td = data.batch
    response_length = td["responses"].shape[1]
    logits = model(
        input_ids=td["input_ids"], attention_mask=td["attention_mask"], position_ids=td["position_ids"], use_cache=False
    ).logits[:, -response_length - 1 : -1]
    log_prob = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, td["responses"][..., None])[..., 0]
    loss, _ = get_policy_loss_fn("vanilla")(
        td["old_log_probs"], log_prob, td["advantages"], td["response_mask"], loss_agg_mode
    )
    loss.backward()
    return {n: -p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_log_probs_and_entropy_equal_per_sequence_hf_forward_at_temperature(use_remove_padding):
    data = training_batch()
    model = make_tiny_causal_lm()
    actor = DataParallelPPOActor(actor_config(use_remove_padding=use_remove_padding), model)
    expected_lp, expected_ent = reference_response_log_probs(model, data.batch, TEMPERATURE)
    mask = data.batch["response_mask"].bool()
    for meta in ({"micro_batch_size": 3}, {"use_dynamic_bsz": True, "max_token_len": 20}):
        data.meta_info.update(meta)
        log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
        assert log_probs.shape == data.batch["responses"].shape
        torch.testing.assert_close(log_probs[mask], expected_lp[mask], atol=1e-12, rtol=0)
        torch.testing.assert_close(entropy[mask], expected_ent[mask], atol=1e-12, rtol=0)
        data.meta_info.pop("use_dynamic_bsz", None)
    log_probs_no_entropy, none = actor.compute_log_prob(data)
    assert none is None
    torch.testing.assert_close(log_probs_no_entropy[mask], expected_lp[mask], atol=1e-12, rtol=0)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_fixed_uneven_and_dynamic_micro_batches_give_the_full_batch_gradient(loss_agg_mode):
    """Gradient accumulation must reproduce the loss over the whole mini-batch, however it is split."""
    data = training_batch(batch_size=8, seed=1)
    expected = reference_full_batch_delta(data, loss_agg_mode)
    splits = [
        {"ppo_micro_batch_size_per_gpu": 2},
        {"ppo_micro_batch_size_per_gpu": 3},  # 3 + 3 + 2: unequal micro-batches
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 22},
    ]
    for split in splits:
        actor = sgd_actor(actor_config(loss_agg_mode=loss_agg_mode, **split))
        before = copy.deepcopy(actor.actor_module)
        metrics = actor.update_policy(data)
        assert_same_delta(param_delta(before, actor.actor_module), expected)
        if split.get("use_dynamic_bsz"):
            assert len(metrics["actor/pg_loss"]) >= 3, "the token budget should force several micro-batches"


def test_remove_padding_and_gradient_checkpointing_give_the_padded_update():
    from verl.utils.model import enable_gradient_checkpointing

    data = training_batch(seed=2)
    deltas = []
    for rmpad, checkpointing in ((False, False), (True, False), (True, True)):
        model = make_tiny_causal_lm()
        if checkpointing:
            enable_gradient_checkpointing(model)
        actor = sgd_actor(actor_config(use_remove_padding=rmpad), model)
        before = copy.deepcopy(model)
        actor.update_policy(data)
        deltas.append(param_delta(before, model))
    assert_same_delta(deltas[1], deltas[0])
    assert_same_delta(deltas[2], deltas[0])


def test_one_update_raises_positive_and_lowers_negative_advantage_log_probs():
    data = training_batch(seed=3)
    model = make_tiny_causal_lm()
    actor = DataParallelPPOActor(actor_config(), model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    data.meta_info["micro_batch_size"] = 4
    before, _ = actor.compute_log_prob(data)
    metrics = actor.update_policy(data)
    after, _ = actor.compute_log_prob(data)
    mask = data.batch["response_mask"].bool()
    adv = data.batch["advantages"]
    change = after - before
    assert change[mask & (adv > 0)].mean() > 1e-3
    assert change[mask & (adv < 0)].mean() < -1e-3
    # first step: old == current policy, so the ratio is 1 and nothing is clipped
    assert max(abs(v) for v in metrics["actor/ppo_kl"]) < 1e-12
    assert metrics["actor/pg_clipfrac"] == [0.0] * 4
    assert metrics["actor/lr"] == [3e-3]
    assert metrics["actor/skipped_nonfinite_grad"] == [0.0]


def test_entropy_bonus_and_kl_loss_are_reported_and_kl_is_zero_against_itself():
    data = training_batch(seed=4)
    data.batch["ref_log_prob"] = data.batch["old_log_probs"].clone()
    actor = sgd_actor(actor_config(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1), lr=0.0)
    metrics = actor.update_policy(data)
    assert len(metrics["actor/entropy"]) == 4 and all(e > 0 for e in metrics["actor/entropy"])
    assert max(abs(k) for k in metrics["actor/kl_loss"]) < 1e-12
    assert metrics["actor/kl_coef"] == [0.1] * 4
    _, expected_ent = reference_response_log_probs(make_tiny_causal_lm(), data.batch, TEMPERATURE)
    first = data.batch[:2]
    expected_first = float(agg_loss(expected_ent[:2], first["response_mask"], "token-mean"))
    assert metrics["actor/entropy"][0] == pytest.approx(expected_first, abs=1e-12)


def test_zero_advantage_minibatch_skips_the_adamw_step_unless_disabled():
    data = training_batch(seed=5, advantages=torch.zeros(8, 5, dtype=torch.float64))
    for skip in (True, False):
        model = make_tiny_causal_lm()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        actor = DataParallelPPOActor(
            actor_config(skip_zero_advantage_step=skip, ppo_mini_batch_size=4), model, optimizer
        )
        before = copy.deepcopy(model)
        metrics = actor.update_policy(data)
        moved = max(float(d.abs().max()) for d in param_delta(before, model).values())
        if skip:
            assert metrics["actor/skipped_zero_adv"] == [1.0, 1.0] and "actor/pg_loss" not in metrics
            assert moved == 0.0
        else:
            assert metrics["actor/skipped_zero_adv"] == [0.0, 0.0]
            assert moved > 0.0, "AdamW's weight decay moves weights even with a zero gradient"


def test_nonfinite_gradient_skips_the_step_and_is_counted():
    advantages = torch.ones(8, 5, dtype=torch.float64)
    advantages[0, 0] = float("nan")
    data = training_batch(seed=6, advantages=advantages)
    actor = sgd_actor(actor_config(ppo_mini_batch_size=4), lr=0.1)
    before = copy.deepcopy(actor.actor_module)
    metrics = actor.update_policy(data)
    assert metrics["actor/skipped_nonfinite_grad"] == [1.0, 0.0]
    assert not torch.isfinite(torch.tensor(metrics["actor/grad_norm"][0]))
    delta = param_delta(before, actor.actor_module)
    assert all(torch.isfinite(d).all() for d in delta.values()), "a NaN step must not reach the weights"
    assert max(float(d.abs().max()) for d in delta.values()) > 0, "the second, finite mini-batch still steps"


def test_user_errors_say_what_to_change():
    model = make_tiny_causal_lm()
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 needs actor.use_remove_padding"):
        DataParallelPPOActor(actor_config(ulysses_sequence_parallel_size=2), model)
    with pytest.raises(ValueError, match="group given has None ranks"):
        DataParallelPPOActor(actor_config(ulysses_sequence_parallel_size=2, use_remove_padding=True), model)
    actor = sgd_actor(actor_config(ppo_mini_batch_size=3), model)
    data = training_batch()
    with pytest.raises(ValueError, match="ppo_mini_batch_size=3"):
        actor.update_policy(data)
    del data.meta_info["temperature"]
    with pytest.raises(KeyError, match="temperature"):
        actor.compute_log_prob(data)
    with pytest.raises(KeyError, match="ref_log_prob"):
        sgd_actor(actor_config(use_kl_loss=True), model).update_policy(training_batch())
    # also when zero-advantage rows are left out, which re-cuts the micro-batches
    zero_rows = training_batch(advantages=torch.tensor([[1.0], [0.0]]).repeat(4, 5))
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu"):
        sgd_actor(actor_config(ppo_micro_batch_size_per_gpu=0), model).update_policy(zero_rows)


# ---------------------------------------------------------------------------------------- 2 ranks


def _two_rank_actor(rank, world_size, fsdp_size=-1):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params

    data = training_batch(batch_size=8, seed=7)
    # rank 0 gets the long sequences, rank 1 the short ones: token budgets then need different
    # numbers of micro-batches per rank, which the actor must equalise
    lengths = data.batch["attention_mask"].sum(-1)
    order = torch.argsort(lengths, descending=True, stable=True)
    local = data.select_idxs(order[rank * 4 : (rank + 1) * 4])

    # fsdp_size -1 shards every parameter over both ranks; 1 replicates them (HSDP with shard groups of
    # one rank: gradients are all-reduced, as the CPU example runs a model this small)
    fsdp_model = apply_fsdp2(make_tiny_causal_lm(), {"fsdp_size": fsdp_size})
    config = actor_config(ppo_mini_batch_size=4, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=14)
    actor = DataParallelPPOActor(config, fsdp_model, torch.optim.SGD(fsdp_model.parameters(), lr=1.0))

    # log-probs of the sharded model equal the unsharded per-sequence forward
    reference_model = make_tiny_causal_lm()
    expected, _ = reference_response_log_probs(reference_model, local.batch, TEMPERATURE)
    local.meta_info.update(use_dynamic_bsz=True, max_token_len=14)
    log_probs, _ = actor.compute_log_prob(local)
    mask = local.batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-12, rtol=0)

    # one update over 2 ranks x token-budget micro-batches == one single-process update of all 8
    metrics = actor.update_policy(local)
    single = sgd_actor(actor_config(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8))
    single_metrics = single.update_policy(data)
    full = dict(iter_full_params(fsdp_model))
    for name, tensor in single.actor_module.state_dict().items():
        torch.testing.assert_close(full[name], tensor, atol=1e-11, rtol=1e-9, msg=name)
    # the gradient norm is the full model's, identical on both ranks and to the single process
    assert metrics["actor/grad_norm"][0] == pytest.approx(single_metrics["actor/grad_norm"][0], rel=1e-9)
    assert len(metrics["actor/pg_loss"]) >= 2


@pytest.mark.parametrize("fsdp_size", [-1, 1])
def test_fsdp2_actor_on_two_ranks_matches_single_process(fsdp_size):
    run_distributed(_two_rank_actor, 2, fsdp_size)


# ------------------------------------------------------------------------- zero-advantage rows

ZERO_ROWS = (1, 2, 5)


def _with_zero_rows(data: DataProto, zero_rows=ZERO_ROWS) -> DataProto:
    data.batch["advantages"][list(zero_rows)] = 0.0
    return data


def _count_forward_rows(model: torch.nn.Module) -> list[int]:
    rows = []
    model.register_forward_hook(
        lambda module, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    return rows


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize(
    "split",
    [{"ppo_micro_batch_size_per_gpu": 2}, {"ppo_micro_batch_size_per_gpu": 3}, {"use_dynamic_bsz": True}],
    ids=["micro2", "micro3", "dynamic"],
)
def test_zero_advantage_rows_are_not_forwarded_and_the_gradient_is_the_full_batch_one(loss_agg_mode, split):
    data = _with_zero_rows(training_batch(batch_size=8, seed=8))
    expected = reference_full_batch_delta(data, loss_agg_mode)  # one forward over all 8 rows
    actor = sgd_actor(actor_config(loss_agg_mode=loss_agg_mode, **split))
    forwarded = _count_forward_rows(actor.actor_module)
    before = copy.deepcopy(actor.actor_module)
    metrics = actor.update_policy(data)
    assert_same_delta(param_delta(before, actor.actor_module), expected)
    assert sum(forwarded) == 8 - len(ZERO_ROWS)
    assert metrics["actor/zero_adv_rows_skipped"] == [len(ZERO_ROWS) / 8]


def test_zero_advantage_rows_are_trained_when_they_add_to_the_loss_or_when_disabled():
    """An entropy bonus, a KL loss or a batch-coupled policy loss (kl_cov penalises any row) give
    zero-advantage rows a gradient of their own: every row is forwarded then, as with the switch off."""
    data = _with_zero_rows(training_batch(batch_size=8, seed=9))
    data.batch["ref_log_prob"] = data.batch["old_log_probs"] - 0.1
    for overrides in (
        {"entropy_coeff": 0.01},
        {"use_kl_loss": True},
        {"policy_loss": {"loss_mode": "kl_cov"}},
        {"skip_zero_advantage_rows": False},
    ):
        actor = sgd_actor(actor_config(**overrides))
        forwarded = _count_forward_rows(actor.actor_module)
        metrics = actor.update_policy(data)
        assert sum(forwarded) == 8, overrides
        assert "actor/zero_adv_rows_skipped" not in metrics, overrides


def _two_rank_zero_rows(rank, world_size, fsdp_size, split):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params

    # rank 0 holds 3 rows to train, rank 1 only 1: rank 0 needs two micro-batches (of 2 rows, or of
    # 14 tokens), and rank 1 must run two as well (FSDP's collectives), one on a zero-advantage row
    data = _with_zero_rows(training_batch(batch_size=8, seed=10), zero_rows=(1, 4, 5, 6))
    local = data.select_idxs(torch.arange(rank * 4, (rank + 1) * 4))
    fsdp_model = apply_fsdp2(make_tiny_causal_lm(), {"fsdp_size": fsdp_size})
    config = actor_config(ppo_mini_batch_size=4, **split)
    actor = DataParallelPPOActor(config, fsdp_model, torch.optim.SGD(fsdp_model.parameters(), lr=1.0))
    metrics = actor.update_policy(local)
    single = sgd_actor(
        actor_config(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8, skip_zero_advantage_rows=False)
    )
    single.update_policy(data)
    full = dict(iter_full_params(fsdp_model))
    for name, tensor in single.actor_module.state_dict().items():
        torch.testing.assert_close(full[name], tensor, atol=1e-11, rtol=1e-9, msg=name)
    # rank 0's 3 rows need 2 micro-batches under either split; rank 1 trains one zero-advantage row
    assert metrics["actor/zero_adv_rows_skipped"] == [0.25 if rank == 0 else 0.5]


@pytest.mark.parametrize("fsdp_size", [-1, 1])
@pytest.mark.parametrize(
    "split",
    [{"ppo_micro_batch_size_per_gpu": 2}, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 14}],
    ids=["micro2", "dynamic"],
)
def test_ranks_with_unequal_rows_to_train_run_equally_many_micro_batches(fsdp_size, split):
    run_distributed(_two_rank_zero_rows, 2, fsdp_size, split)


# ----------------------------------------------------------------------------------------- FLOPs


def _eager_qwen2(seed: int = 0):
    """A tiny Qwen2 with eager attention: its QK^T and AV are plain batched matmuls, which torch's
    operator count sees (and separates from the projections' mm / addmm)."""
    from transformers import AutoModelForCausalLM

    from tests.distributed_helpers import tiny_qwen2_config

    torch.manual_seed(seed)
    config = tiny_qwen2_config(tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def _counted_update(actor, data):
    """(the actor's FLOPs, torch's projection FLOPs (mm / addmm), torch's total) of one update."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        actor.update_policy(data)
    by_op = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    projections = sum(flops for op, flops in by_op.items() if op.split(".")[-1] in ("mm", "addmm"))
    return actor.flops.total(), projections, counter.get_total_flops()


def _unpadded_batch(prompts: list[list[int]], n: int, response_length: int, advantages: list[float]):
    """Every prompt repeated `n` times (GRPO), no padding anywhere; advantage `advantages[i]` on row i."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(1)
    rows = len(prompts) * n
    prompt = torch.tensor([p for p in prompts for _ in range(n)])
    responses = torch.randint(3, 40, (rows, response_length), generator=g)
    input_ids = torch.cat([prompt, responses], dim=1)
    mask = torch.ones_like(input_ids)
    td = TensorDict(
        {
            "prompts": prompt,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
            "response_mask": torch.ones_like(responses),
            "old_log_probs": torch.full(responses.shape, -3.0),
            "advantages": torch.tensor(advantages)[:, None].expand(rows, response_length).clone(),
        },
        batch_size=[rows],
    )
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": 1.0})


def test_update_flops_count_whole_rows_as_run_on_the_padded_path():
    """Without prompt sharing every row runs whole. The count is hand-computed here (B rows of P + R
    tokens, the LM head at the R positions that predict a response token); torch's operator count of
    the same update runs the head at one more position per row (logits_to_keep = R + 1) and adds
    the rotary angles: otherwise the two agree, and the count never exceeds torch's."""
    from verl.utils.flops_counter import FlopsCounter

    P, R, B = 5, 4, 8
    data = _unpadded_batch([[7, 8, 9, 10, 11]] * 2, n=4, response_length=R, advantages=[1.0, -1.0] * 4)
    model = _eager_qwen2()
    config = actor_config(ppo_micro_batch_size_per_gpu=4, share_prompt_forward=False)
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.0))
    counted, projections, total = _counted_update(actor, data)
    counter = FlopsCounter(model.config)
    assert counted == 3 * counter.forward_flops(B * (P + R), B * (P + R) ** 2, B * R)
    extra_head = 3 * counter.forward_flops(0, 0, B)  # the (R + 1)-th logits position of each row
    assert counted - 3 * counter.forward_flops(0, B * (P + R) ** 2, 0) + extra_head == pytest.approx(
        projections, rel=1e-9
    )
    assert counted <= total, (counted, total)


def test_update_flops_count_each_shared_prompt_once_and_skip_zero_advantage_rows():
    """GRPO at n=8 on the shared-prompt path: each distinct prompt runs once and each response's
    R - 1 input tokens on top of it; a group whose advantages are all zero is left out of the update,
    so it is not counted. The projections' FLOPs (layers and LM head) are exactly torch's operator
    count; attention is a lower bound of it (the packed response pass attends over whole groups)."""
    from verl.utils.flops_counter import FlopsCounter

    P, R, n = 5, 4, 8
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19, 20, 21]]
    advantages = [1.0, -1.0] * 4 + [0.0] * 8 + [-1.0, 1.0] * 4  # the second group scored all the same
    data = _unpadded_batch(prompts, n=n, response_length=R, advantages=advantages)
    model = _eager_qwen2()
    config = actor_config(ppo_mini_batch_size=3 * n, ppo_micro_batch_size_per_gpu=3 * n)
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.0))
    if not actor.share_prompt_forward:
        pytest.skip("this transformers' causal LM takes no past_key_values, so the actor cannot share prompts")
    counted, projections, total = _counted_update(actor, data)
    groups, rows = 2, 2 * n  # trained: the first and third group
    tokens = groups * P + rows * (R - 1)
    attended = groups * P * P + rows * (R - 1) * (P + R - 1)
    head = groups + rows * (R - 1)
    counter = FlopsCounter(model.config)
    assert counted == pytest.approx(3 * counter.forward_flops(tokens, attended, head), rel=1e-12)
    assert 3 * counter.forward_flops(tokens, 0, head) == pytest.approx(projections, rel=1e-9)
    assert counted <= total, (counted, total)
    # what the old count (6 x params x (P + R) for every row of the batch) claimed: far more than ran
    assert counter.training_flops([P + R] * 3 * n) > 2 * total
