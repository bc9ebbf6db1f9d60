"""Upstream's smaller `verl.utils.torch_functional` helpers against hand-worked or float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

import verl.utils.optim as optim
import verl.utils.torch_functional as F
from tests.distributed_helpers import run_distributed
from verl.utils.remove_padding import unpad_input


def _float64_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def test_gather_from_labels_picks_the_labelled_entry_of_each_row():
    data = torch.tensor([[[10, 20, 30], [40, 50, 60]]])
    assert F.gather_from_labels(data, torch.tensor([[2, 0]])).tolist() == [[30, 40]]


@pytest.mark.parametrize("fn", [F.logprobs_from_logits_naive, F.logprobs_from_logits_v2])
def test_log_prob_variants_equal_a_float64_log_softmax_gather(fn):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    expected = _float64_logprobs(logits, labels)
    torch.testing.assert_close(fn(logits, labels).double(), expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(fn(logits.double(), labels), expected, rtol=0, atol=1e-12)


def test_log_probs_v2_in_bfloat16_stays_close_to_the_float64_reference():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 32, generator=gen) * 3).bfloat16()
    labels = torch.randint(0, 32, (2, 4), generator=gen)
    out = F.logprobs_from_logits_v2(logits, labels)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _float64_logprobs(logits.double(), labels), rtol=0.02, atol=0.05)


def test_clip_by_value_uses_elementwise_bounds():
    x = torch.tensor([-3.0, 0.5, 7.0])
    out = F.clip_by_value(x, torch.tensor([-1.0, 1.0, 0.0]), torch.tensor([1.0, 2.0, 5.0]))
    assert out.tolist() == [-1.0, 1.0, 5.0]


def test_response_mask_keeps_each_response_through_its_first_eos():
    response = torch.tensor(
        [
            [20, 10, 34, 1, 0, 0, 0],
            [78, 0, 76, 2, 1, 0, 0],
            [23, 98, 1, 0, 0, 0, 0],
            [33, 3, 98, 45, 1, 0, 0],
            [5, 6, 7, 8, 9, 10, 11],  # no EOS: the whole row
        ]
    )
    assert F.get_response_mask(response, eos_token=1).tolist() == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1] * 7,
    ]
    two_eos = F.get_response_mask(response, eos_token=[1, 2], dtype=torch.bool)
    assert two_eos.dtype == torch.bool
    assert two_eos[1].tolist() == [True, True, True, True, False, False, False]


def test_compute_grad_norm_returns_the_squared_norm_and_skips_parameters_without_grad():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
    model[0].weight.grad = torch.tensor([[1.0, 2.0], [0.0, -2.0]])
    assert model[1].weight.grad is None
    assert F.compute_grad_norm(model) == pytest.approx(9.0)


def test_split_dict_tensor_into_batches_needs_a_divisor():
    td = TensorDict({"x": torch.arange(6).reshape(6, 1)}, batch_size=[6])
    parts = F.split_dict_tensor_into_batches(td, 2)
    assert [p["x"].flatten().tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="cannot split 6 rows into batches of 4"):
        F.split_dict_tensor_into_batches(td, 4)


def _allgather(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    tensors = {"b": torch.full((1, 2), float(rank)), "a": torch.tensor([[rank, 10 + rank]])}
    out = F.allgather_dict_tensors(tensors, size=world_size, group=dist.group.WORLD)
    assert out["b"].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert out["a"].tolist() == [[0, 10], [1, 11]]
    along_1 = F.allgather_dict_tensors(tensors, size=world_size, group=None, dim=1)
    assert along_1["a"].tolist() == [[0, 10, 1, 11]]
    td = TensorDict({"x": torch.tensor([rank, rank])}, batch_size=[2])
    gathered = F.allgather_dict_tensors(td, size=world_size, group=None)
    assert isinstance(gathered, TensorDict) and gathered.batch_size[0] == 4
    assert gathered["x"].tolist() == [0, 0, 1, 1]
    shared = {"w": torch.full((2,), float(rank + 5)), "v": torch.tensor([rank])}
    F.broadcast_dict_tensor(shared, src=1, group=None)
    assert shared["w"].tolist() == [6.0, 6.0] and shared["v"].tolist() == [1]
    own = {"loss": 0.5 * rank, f"only_{rank}": rank}
    assert F.allgather_dict_into_dict(own) == {"loss": [0.0, 0.5], "only_0": [0], "only_1": [1]}


def test_dict_collectives_over_two_gloo_ranks():
    run_distributed(_allgather, 2)


def test_pad_2d_list_to_length_right_pads_to_the_longest_row_or_max_length():
    assert F.pad_2d_list_to_length([[1, 2, 3], [4]], pad_token_id=0).tolist() == [[1, 2, 3], [4, 0, 0]]
    assert F.pad_2d_list_to_length([[1], [4, 5]], pad_token_id=-1, max_length=4).tolist() == [
        [1, -1, -1, -1],
        [4, 5, -1, -1],
    ]
    # a max_length shorter than the longest row does not truncate
    assert F.pad_2d_list_to_length([[1, 2, 3]], pad_token_id=0, max_length=2).tolist() == [[1, 2, 3]]


def test_pad_sequence_to_length_pads_either_side_and_leaves_long_rows_alone():
    x = torch.tensor([[1, 2], [3, 4]])
    assert F.pad_sequence_to_length(x, 4, pad_token_id=9).tolist() == [[1, 2, 9, 9], [3, 4, 9, 9]]
    assert F.pad_sequence_to_length(x, 3, pad_token_id=9, left_pad=True).tolist() == [[9, 1, 2], [9, 3, 4]]
    assert F.pad_sequence_to_length(x, 2, pad_token_id=9) is x


def test_postprocess_data_pads_or_truncates_as_asked():
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    mask = torch.ones_like(ids)
    padded_ids, padded_mask = F.postprocess_data(ids, mask, max_length=7, pad_token_id=0)
    assert padded_ids.tolist() == [[0, 0, 1, 2, 3, 4, 5]] and padded_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1]]
    right_ids, _ = F.postprocess_data(ids, mask, max_length=6, pad_token_id=0, left_pad=False)
    assert right_ids.tolist() == [[1, 2, 3, 4, 5, 0]]
    cuts = {t: F.postprocess_data(ids, mask, 3, 0, truncation=t)[0].tolist() for t in ("left", "right", "middle")}
    assert cuts == {"left": [[3, 4, 5]], "right": [[1, 2, 3]], "middle": [[1, 4, 5]]}
    with pytest.raises(NotImplementedError, match="5 tokens, more than max_length=3"):
        F.postprocess_data(ids, mask, 3, 0)
    with pytest.raises(ValueError, match="truncation='both' is not one of"):
        F.postprocess_data(ids, mask, 3, 0, truncation="both")


def test_tokenize_and_postprocess_data_with_the_tiny_tokenizer():
    from verl.models.factory import build_tokenizer

    tok = build_tokenizer("tiny")
    expected = tok("1+2=3", add_special_tokens=False)["input_ids"]
    ids, mask = F.tokenize_and_postprocess_data("1+2=3", tok, len(expected) + 2, pad_token_id=tok.pad_token_id)
    assert ids.tolist() == [[tok.pad_token_id] * 2 + expected] and mask.tolist() == [[0, 0] + [1] * len(expected)]


def test_remove_pad_token_keeps_the_real_tokens_of_each_row():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert F.remove_pad_token(ids, mask) == [[5, 6], [7, 8, 9, 1]]


def _shifted_reference(input_ids, logits, response_length):
    """Response log-probs by hand: the logits at t score token t + 1."""
    full = _float64_logprobs(logits[:, :-1], input_ids[:, 1:])
    return full[:, -response_length:]


def test_response_log_probs_padded_and_packed_equal_the_float64_reference():
    gen = torch.Generator().manual_seed(2)
    batch, seqlen, vocab, response_length = 3, 7, 13, 3
    input_ids = torch.randint(1, vocab, (batch, seqlen), generator=gen)
    # left-padded prompts, full responses
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]])
    logits = torch.randn(batch, seqlen, vocab, generator=gen, dtype=torch.float64)
    expected = _shifted_reference(input_ids, logits, response_length)
    torch.testing.assert_close(F.log_probs_from_logits_response(input_ids, logits, response_length), expected)

    packed_ids, indices = unpad_input(input_ids, attention_mask)
    logits_rmpad = logits.reshape(-1, vocab)[indices]
    out = F.log_probs_from_logits_response_rmpad(input_ids, attention_mask, logits_rmpad, response_length)
    torch.testing.assert_close(out, expected)
    out_all = F.log_probs_from_logits_all_rmpad(packed_ids, logits_rmpad, indices, batch, seqlen, response_length)
    torch.testing.assert_close(out_all, expected)


def test_post_process_logits_scales_in_place_and_filters_top_k_and_top_p():
    logits = torch.tensor([[4.0, 2.0, 0.0, -2.0]])
    out = F.post_process_logits(None, logits, temperature=2.0, top_k=None, top_p=None)
    assert out is logits and logits.tolist() == [[2.0, 1.0, 0.0, -1.0]]
    top2 = F.post_process_logits(None, torch.tensor([[4.0, 2.0, 0.0, -2.0]]), 1.0, top_k=2, top_p=1.0)
    assert torch.isinf(top2).tolist() == [[False, False, True, True]]
    # softmax of [4, 2, 0, -2]: p = [0.8650, 0.1171, 0.0158, 0.0021]; top_p=0.9 keeps the first two
    nucleus = F.post_process_logits(None, torch.tensor([[0.0, 4.0, -2.0, 2.0]]), 1.0, top_k=-1, top_p=0.9)
    assert torch.isinf(nucleus).tolist() == [[True, False, True, False]]


def test_calculate_sum_pi_squared_equals_the_squared_softmax_sum():
    logits = torch.randn(4, 9, dtype=torch.float64)
    expected = (torch.softmax(logits, -1) ** 2).sum(-1)
    torch.testing.assert_close(F.calculate_sum_pi_squared_from_logits(logits), expected)


def test_prepare_decoder_attention_mask_blocks_future_and_padding_keys():
    embeds = torch.zeros(1, 3, 4)
    mask = F.prepare_decoder_attention_mask(torch.tensor([[0, 1, 1]]), (1, 3), embeds)
    blocked = mask[0, 0] < 0
    # key 0 is padding; key s > t is the future
    assert blocked.tolist() == [[True, True, True], [True, False, True], [True, False, False]]
    assert mask[0, 0, 2, 1].item() == 0.0 and mask[0, 0, 0, 1].item() == torch.finfo(torch.float32).min
    assert F.prepare_decoder_attention_mask(None, (1, 1), embeds[:, :1]) is None


def test_get_unpad_data_gives_indices_cumulative_lengths_and_the_longest_row():
    indices, cu_seqlens, longest = F.get_unpad_data(torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]]))
    assert indices.tolist() == [0, 1, 4, 5, 6, 7, 8]
    assert cu_seqlens.tolist() == [0, 2, 4, 7] and cu_seqlens.dtype == torch.int32
    assert longest == 3 and isinstance(longest, int)


def test_check_device_is_available_refuses_without_an_accelerator(monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    with pytest.raises(RuntimeError, match="needs an initialised accelerator"), F.check_device_is_available():
        pass


def _lrs(scheduler_fn, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = scheduler_fn(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_schedules_are_optim_functions_re_exported():
    assert F.get_cosine_schedule_with_warmup is optim.get_cosine_schedule_with_warmup
    assert F.get_constant_schedule_with_warmup is optim.get_constant_schedule_with_warmup
    assert F.get_wsd_schedule_with_warmup is optim.get_wsd_schedule_with_warmup


def test_cosine_warmup_starts_at_init_lr_ratio():
    lrs = _lrs(lambda o: F.get_cosine_schedule_with_warmup(o, 2, 6, min_lr_ratio=0.2, init_lr_ratio=0.5), 7)
    # warm-up 0.5, 0.75; then 0.2 + 0.8 * 0.5 * (1 + cos(pi * k / 4)) for k = 0..4
    expected = [0.5, 0.75] + [0.2 + 0.4 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert lrs == pytest.approx(expected)
    with pytest.raises(ValueError, match="init_lr_ratio"):
        F.get_cosine_schedule_with_warmup(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), 1, 2, 0.0, 0.5, -1, 2.0
        )


def test_wsd_schedule_warms_up_holds_then_decays_by_a_cosine_to_min_lr():
    # 2 warm-up steps, 8 left: int(0.5 * 8) = 4 held, 4 decaying, min_lr_ratio 0.1 from step 10 on
    lrs = _lrs(lambda o: F.get_wsd_schedule_with_warmup(o, 2, 10, min_lr_ratio=0.1, stable_ratio=0.5), 12)
    decay = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, *decay, 0.1, 0.1])
    with pytest.raises(ValueError, match="stable_ratio must be in"):
        _lrs(lambda o: F.get_wsd_schedule_with_warmup(o, 2, 10, stable_ratio=1.5), 1)


def test_use_original_torch_compile_runs_its_body_with_torch_compile_untouched():
    compile_before = torch.compile
    with F.use_original_torch_compile():
        assert torch.compile is compile_before
        ran = True
    assert ran
