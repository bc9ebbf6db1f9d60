"""Shared-prompt forward (actor.share_prompt_forward): same log-probs, entropies and gradients as one padded
forward per sample, on 1 process and on 2 FSDP2 ranks; the plain path when prompts do not repeat.

Batches repeat each prompt several times (GRPO's rollout.n) and shuffle the rows, so a group's rows
are not contiguous; responses differ in content and length within a group.

Gradient comparisons use `float64_rms_norm`: HF's Qwen2RMSNorm computes in float32 even for a
float64 model, so the shared path's gradient (one prompt forward, the group's gradients summed
before the norm's backward) and the per-sample one (summed after it) differ by float32 rounding,
~1e-7 relative. With the norm in float64 they agree to 1e-11; one test also bounds the difference
with the stock float32 norm.
"""

from __future__ import annotations

import copy

import pytest
import torch

import verl.utils.shared_prompt as shared_prompt_module
import verl.workers.actor.dp_actor as dp_actor_module
from tests.distributed_helpers import (
    make_ppo_batch,
    make_tiny_causal_lm,
    one_thread,
    ppo_tensors,
    reference_response_log_probs,
    run_distributed,
)
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.utils.shared_prompt import prompt_groups
from verl.utils.speed_paths import SpeedPath
from verl.workers.actor import DataParallelPPOActor

TEMPERATURE = 0.7
PROMPT_LENGTH = 6
RESPONSE_LENGTH = 5

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def repeated_prompt_batch(num_prompts: int = 3, n: int = 4, seed: int = 0) -> DataProto:
    """`num_prompts` prompts x `n` responses each, rows shuffled; advantages +-1 per row; old log-probs = current."""
    g = torch.Generator().manual_seed(seed)
    base = make_ppo_batch(batch_size=num_prompts, prompt_length=PROMPT_LENGTH, seed=seed)
    rows = num_prompts * n
    order = torch.arange(num_prompts).repeat(n)[torch.randperm(rows, generator=g)]
    prompts, prompt_mask = base["prompts"][order], base["attention_mask"][order, :PROMPT_LENGTH]
    lengths = torch.randint(1, RESPONSE_LENGTH + 1, (rows,), generator=g)
    response_mask = (torch.arange(RESPONSE_LENGTH)[None] < lengths[:, None]).long()
    responses = torch.randint(3, 40, (rows, RESPONSE_LENGTH), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    tensors = ppo_tensors(prompts, responses, attention_mask, response_mask)
    data = DataProto.from_dict(tensors=tensors, meta_info={"temperature": TEMPERATURE})
    old, _ = reference_response_log_probs(make_tiny_causal_lm(), data.batch, TEMPERATURE)
    sign = torch.where(torch.arange(rows) % 3 == 0, 1.0, -1.0).to(torch.float64)
    data.batch["old_log_probs"] = old
    data.batch["advantages"] = sign[:, None] * response_mask
    return data


def _rms_norm_in_input_dtype(self, hidden_states):
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(dtype)


def use_float64_rms_norm():
    from transformers.models.qwen2 import modeling_qwen2

    modeling_qwen2.Qwen2RMSNorm.forward = _rms_norm_in_input_dtype


@pytest.fixture
def float64_rms_norm(monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", _rms_norm_in_input_dtype)


def actor_config(**overrides):
    config = {
        "ppo_mini_batch_size": 12,
        "ppo_micro_batch_size_per_gpu": 12,
        "ppo_epochs": 1,
        "grad_clip": 1e9,
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.01,
        "share_prompt_forward": True,
    }
    config.update(overrides)
    return config


@pytest.fixture
def shared_calls(monkeypatch):
    """Counts the micro-batches that took the shared-prompt path."""
    use_float64_rms_norm()
    calls = []
    original = dp_actor_module.shared_prompt_logits

    def counting(*args, **kwargs):
        calls.append(len(args[1]))
        return original(*args, **kwargs)

    monkeypatch.setattr(dp_actor_module, "shared_prompt_logits", counting)
    return calls


@pytest.fixture(params=["packed", "padded"])
def response_layout(request, monkeypatch):
    """Runs the test with the response pass in one layout; yields the list of layouts taken."""
    taken = []
    original = shared_prompt_module.packed_response_layout

    def choose(*args, **kwargs):
        layout = original(*args, **kwargs) if request.param == "packed" else None
        taken.append("padded" if layout is None else "packed")
        return layout

    monkeypatch.setattr(shared_prompt_module, "packed_response_layout", choose)
    yield taken
    assert taken and set(taken) == {request.param}, f"expected the {request.param} layout, took {taken}"


def sgd_update_delta(config, data: DataProto, model=None) -> dict[str, torch.Tensor]:
    model = model or make_tiny_causal_lm()
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))
    before = copy.deepcopy(model)
    actor.update_policy(data)
    return {n: p.detach() - before.get_parameter(n).detach() for n, p in model.named_parameters()}


def test_prompt_groups_match_rows_with_equal_real_prompt_tokens():
    input_ids = torch.tensor([[0, 5, 6, 1], [9, 5, 6, 2], [0, 0, 6, 3], [0, 5, 6, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    first_rows, inverse = prompt_groups(input_ids, mask, compute_position_id_with_mask(mask), prompt_length=3)
    # rows 0, 1, 3 share "5 6" (the token under row 1's padding does not count); row 2 is "6" alone
    assert inverse[0] == inverse[1] == inverse[3] != inverse[2]
    assert first_rows[inverse].tolist() == [0, 0, 2, 0]


@pytest.mark.parametrize("micro_batch", [{"micro_batch_size": 12}, {"use_dynamic_bsz": True, "max_token_len": 48}])
def test_log_probs_and_entropy_equal_per_sequence_references(shared_calls, response_layout, micro_batch):
    data = repeated_prompt_batch()
    model = make_tiny_causal_lm()
    expected_lp, expected_ent = reference_response_log_probs(model, data.batch, TEMPERATURE)
    data.meta_info.update(micro_batch)
    log_probs, entropy = DataParallelPPOActor(actor_config(), model).compute_log_prob(data, calculate_entropy=True)
    assert shared_calls, "the repeated prompts should take the shared-prompt path"
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], expected_lp[mask], atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy[mask], expected_ent[mask], atol=1e-12, rtol=0)


def test_single_response_column_is_predicted_by_the_prompt_pass_alone(shared_calls):
    data = repeated_prompt_batch(seed=1)
    data.batch["attention_mask"][:, PROMPT_LENGTH + 1 :] = 0
    data.batch["response_mask"][:, 1:] = 0
    data.batch["responses"][:, 1:] = 0
    model = make_tiny_causal_lm()
    expected, _ = reference_response_log_probs(model, data.batch, TEMPERATURE)
    data.meta_info["micro_batch_size"] = 12
    log_probs, _ = DataParallelPPOActor(actor_config(), model).compute_log_prob(data)
    assert shared_calls == [12]
    torch.testing.assert_close(log_probs[:, 0], expected[:, 0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_update_equals_the_per_sample_forward_update(shared_calls, float64_rms_norm, response_layout, loss_agg_mode):
    data = repeated_prompt_batch(seed=2)
    config = actor_config(loss_agg_mode=loss_agg_mode, ppo_micro_batch_size_per_gpu=6)
    shared = sgd_update_delta(config, data)
    assert len(shared_calls) == 2
    plain = sgd_update_delta({**config, "share_prompt_forward": False}, data)
    assert len(shared_calls) == 2
    assert max(float(d.abs().max()) for d in plain.values()) > 1e-3, "the update must move the weights"
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], atol=1e-11, rtol=1e-9, msg=name)


def test_update_with_the_stock_float32_rms_norm_differs_only_by_float32_rounding(shared_calls, response_layout):
    data = repeated_prompt_batch(seed=2)
    shared = sgd_update_delta(actor_config(), data)
    plain = sgd_update_delta(actor_config(share_prompt_forward=False), data)
    assert len(shared_calls) == 1
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], atol=1e-6 * float(plain[name].abs().max()), rtol=0)


def test_distinct_prompts_and_gradient_checkpointing_take_the_plain_path(shared_calls):
    from verl.utils.model import enable_gradient_checkpointing

    distinct = repeated_prompt_batch(num_prompts=12, n=1, seed=3)
    distinct.meta_info["micro_batch_size"] = 12
    DataParallelPPOActor(actor_config(), make_tiny_causal_lm()).compute_log_prob(distinct)
    DataParallelPPOActor(actor_config(use_remove_padding=True), make_tiny_causal_lm()).compute_log_prob(distinct)
    repeated = repeated_prompt_batch(seed=3)
    repeated.meta_info["micro_batch_size"] = 12
    DataParallelPPOActor(actor_config(share_prompt_forward=False), make_tiny_causal_lm()).compute_log_prob(repeated)
    assert shared_calls == []
    # HF drops the KV cache of checkpointed layers in training: the update runs the plain path
    checkpointed = make_tiny_causal_lm()
    enable_gradient_checkpointing(checkpointed)
    sgd_update_delta(actor_config(), repeated_prompt_batch(seed=3), checkpointed)
    assert shared_calls == []


def test_remove_padding_shares_prompts_in_the_packed_layout_or_not_at_all(shared_calls, monkeypatch):
    data = repeated_prompt_batch(seed=7)
    data.meta_info["micro_batch_size"] = 12
    model = make_tiny_causal_lm()
    expected, _ = reference_response_log_probs(model, data.batch, TEMPERATURE)
    mask = data.batch["response_mask"].bool()
    taken = []
    original = shared_prompt_module.packed_response_layout
    monkeypatch.setattr(
        shared_prompt_module,
        "packed_response_layout",
        lambda *a, **k: taken.append(k["padded_positions"]) or original(*a, **k),
    )
    actor = DataParallelPPOActor(actor_config(use_remove_padding=True), model)
    log_probs, _ = actor.compute_log_prob(data)
    # packed (no cost comparison: the remove-padding path would recompute each prompt per row)
    assert shared_calls == [12] and taken == [None]
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-12, rtol=0)
    # a layout that cannot be packed (here: over the mask budget) runs the remove-padding path
    monkeypatch.setattr(shared_prompt_module, "PACKED_MASK_BUDGET", 0)
    log_probs, _ = actor.compute_log_prob(data)
    assert shared_calls == [12]
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------- 2 ranks


def _two_rank_shared_update(rank, world_size):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params

    use_float64_rms_norm()
    calls = []
    original = dp_actor_module.shared_prompt_logits
    dp_actor_module.shared_prompt_logits = lambda *a, **k: calls.append(1) or original(*a, **k)

    # rank 0's rows repeat 2 prompts, rank 1's 6 prompts are distinct: the ranks must still agree on
    # the path (the same number of FSDP forward calls), which the actor settles with one all-reduce
    parts = [repeated_prompt_batch(num_prompts=2, n=3, seed=4), repeated_prompt_batch(num_prompts=6, n=1, seed=5)]
    data, local = DataProto.concat(parts), parts[rank]

    fsdp_model = apply_fsdp2(make_tiny_causal_lm())
    actor = DataParallelPPOActor(
        actor_config(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=6),
        fsdp_model,
        torch.optim.SGD(fsdp_model.parameters(), lr=1.0),
    )
    expected, _ = reference_response_log_probs(make_tiny_causal_lm(), local.batch, TEMPERATURE)
    local.meta_info["micro_batch_size"] = 6
    log_probs, _ = actor.compute_log_prob(local)
    mask = local.batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-12, rtol=0)
    assert len(calls) == 1

    actor.update_policy(local)
    assert len(calls) == 2
    single = make_tiny_causal_lm()
    config = actor_config(ppo_mini_batch_size=12, share_prompt_forward=False)
    DataParallelPPOActor(config, single, torch.optim.SGD(single.parameters(), lr=1.0)).update_policy(data)
    full = dict(iter_full_params(fsdp_model))
    for name, tensor in single.state_dict().items():
        torch.testing.assert_close(full[name], tensor, atol=1e-11, rtol=1e-9, msg=name)


def test_fsdp2_shared_update_on_two_ranks_equals_the_single_process_plain_update():
    run_distributed(_two_rank_shared_update, 2)


def _two_rank_remove_padding_agreement(rank, world_size):
    from verl.utils.fsdp_utils import apply_fsdp2

    calls = []
    original = dp_actor_module.shared_prompt_logits
    dp_actor_module.shared_prompt_logits = lambda *a, **k: calls.append(1) or original(*a, **k)
    data = repeated_prompt_batch(seed=8 + rank)
    data.meta_info["micro_batch_size"] = 12
    expected, _ = reference_response_log_probs(make_tiny_causal_lm(), data.batch, TEMPERATURE)
    mask = data.batch["response_mask"].bool()
    actor = DataParallelPPOActor(actor_config(use_remove_padding=True), apply_fsdp2(make_tiny_causal_lm()))
    actor.compute_log_prob(data)
    assert calls == [1], "both ranks can pack: both share prompts"
    if rank == 1:  # this rank cannot pack: neither rank may share (FSDP2 needs equal forward calls)
        shared_prompt_module.PACKED_MASK_BUDGET = 0
    log_probs, _ = actor.compute_log_prob(data)
    assert calls == [1]
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-12, rtol=0)


def test_fsdp2_ranks_agree_on_sharing_prompts_under_remove_padding():
    run_distributed(_two_rank_remove_padding_agreement, 2)


# ---------------------------------------------------------------------------------------- packed layout


def test_packed_layout_places_each_groups_responses_end_to_end():
    # rows 0 and 2 share a prompt (group 0), row 1 is group 1; real response lengths 3, 2, 1
    attention = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    inverse = torch.tensor([0, 1, 0])
    layout = shared_prompt_module.packed_response_layout(
        attention, inverse, 2, prompt_width=4, padded_positions=12, attn_implementation="sdpa"
    )
    # inputs: row 0 columns 0, 1 (predicting 1, 2); row 1 column 0 (predicting 1); row 2 none
    assert layout.row.tolist() == [0, 0, 1]
    assert layout.col.tolist() == [1, 2, 1]
    assert layout.group.tolist() == [0, 0, 1]
    assert layout.slot.tolist() == [0, 1, 0]
    assert (layout.num_groups, layout.width) == (2, 2)


def test_packed_layout_is_declined_when_it_does_not_pay_or_cannot_be_masked():
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    inverse = torch.tensor([0, 1])
    layout = shared_prompt_module.packed_response_layout
    kwargs = {"prompt_width": 4, "attn_implementation": "sdpa"}
    # 2 groups x 3 positions against 2 rows x 2 columns: packing pays only when the padded pass
    # also copies a long enough prompt cache (a quarter position per copied cache position)
    assert layout(attention, inverse, 2, padded_positions=4, prompt_width=0, attn_implementation="sdpa") is None
    assert layout(attention, inverse, 2, padded_positions=4, prompt_width=3, attn_implementation="sdpa") is None
    assert layout(attention, inverse, 2, padded_positions=4, prompt_width=4, attn_implementation="sdpa") is not None
    # a response mask with a hole (not right padding) keeps the padded pass
    holed = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0]])
    assert layout(holed, torch.tensor([0, 0]), 1, padded_positions=100, **kwargs) is None
    # flash attention takes no 4D mask
    assert (
        layout(
            attention,
            torch.tensor([0, 0]),
            1,
            prompt_width=4,
            padded_positions=100,
            attn_implementation="flash_attention_2",
        )
        is None
    )
    assert layout(attention, torch.tensor([0, 0]), 1, padded_positions=100, **kwargs) is not None


def test_packed_layout_with_eager_attention_equals_per_sequence_references(shared_calls, response_layout):
    # float32: HF's eager attention takes the softmax in float32, where a float64 model's padding rows
    # (all keys masked with float64's minimum) become NaN whatever the layout
    data = repeated_prompt_batch(seed=6)
    model = make_tiny_causal_lm(dtype=torch.float32)
    model.config._attn_implementation = "eager"
    expected_lp, expected_ent = reference_response_log_probs(make_tiny_causal_lm(), data.batch, TEMPERATURE)
    data.meta_info["micro_batch_size"] = 12
    log_probs, entropy = DataParallelPPOActor(actor_config(), model).compute_log_prob(data, calculate_entropy=True)
    assert shared_calls == [12]
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask].double(), expected_lp[mask], atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy[mask].double(), expected_ent[mask], atol=2e-5, rtol=0)


# ---------------------------------------------------------------------------------------- speed path


def test_the_installed_transformers_model_class_takes_the_shared_prompt_path():
    # the model class of whatever transformers is installed (both names of its cache argument)
    actor = DataParallelPPOActor(actor_config(), make_tiny_causal_lm())
    assert actor.shared_prompt_path == SpeedPath("shared_prompt_forward", True, True)


def test_speed_path_says_why_the_shared_prompt_path_is_off():
    from verl.utils.model import enable_gradient_checkpointing

    def off_reason(**overrides):
        model = overrides.pop("model", None) or make_tiny_causal_lm()
        path = DataParallelPPOActor(actor_config(**overrides), model).shared_prompt_path
        assert path.requested and not path.active, path
        return path.reason

    assert DataParallelPPOActor(actor_config(share_prompt_forward=False), make_tiny_causal_lm()).shared_prompt_path == (
        SpeedPath("shared_prompt_forward", False, False)
    )
    flash = make_tiny_causal_lm()
    flash.config._attn_implementation = "flash_attention_2"
    assert "needs sdpa or eager attention" in off_reason(model=flash, use_remove_padding=True)
    checkpointed = make_tiny_causal_lm()
    enable_gradient_checkpointing(checkpointed)
    assert "gradient checkpointing" in off_reason(model=checkpointed)

    class NoCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = make_tiny_causal_lm().config

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            raise AssertionError("not called")

    assert "takes no KV cache argument" in off_reason(model=NoCache())
