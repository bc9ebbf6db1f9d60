"""The training API's data layout and losses (`verl.workers.utils.padding`, `verl.workers.utils.losses`) and
`agg_loss`'s global normalisation, against hand-worked values and float64 whole-batch references."""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import TensorDict

from verl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss, response_outputs, sft_loss, value_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding


def _two_rows() -> TensorDict:
    # row 0: prompt [5, 6] (one left pad), response [7, 8] (one right pad); row 1: prompt [9, 1, 2], response [3, 4, 5]
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 1, 2, 3, 4, 5]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    position_ids = torch.tensor([[0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5]])
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": attention_mask[:, -3:],
        },
        batch_size=[2],
    )


def test_left_right_2_no_padding_keeps_each_rows_real_tokens():
    data = left_right_2_no_padding(_two_rows())
    assert data["input_ids"].is_nested
    assert data["input_ids"].offsets().tolist() == [0, 4, 10]
    assert [row.tolist() for row in data["input_ids"].unbind()] == [[5, 6, 7, 8], [9, 1, 2, 3, 4, 5]]
    assert [row.tolist() for row in data["position_ids"].unbind()] == [[0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert torch.equal(data["loss_mask"], data["response_mask"])
    assert tu.get(data, "max_seq_len") == 6 and tu.get(data, "max_response_len") == 3
    assert tu.get(data, "indices").tolist() == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]


def test_no_padding_2_padding_takes_the_positions_that_predict_the_response():
    data = left_right_2_no_padding(_two_rows())
    # a per-token output equal to the token itself: position t holds what predicts token t + 1
    out = no_padding_2_padding(data["input_ids"].to(torch.float64), data)
    # row 0's response tokens 7, 8 are predicted at the tokens 6, 7; its padding column gives 8's
    # successor slot (the real token 8), row 1's 3, 4, 5 at 2, 3, 4
    assert out.tolist() == [[6.0, 7.0, 8.0], [2.0, 3.0, 4.0]]


def test_m_rope_position_ids_stay_per_row_with_their_channels():
    data = _two_rows()
    data["position_ids"] = torch.stack([data["position_ids"] + 10 * c for c in range(4)], dim=1)  # [B, 4, L]
    rows = left_right_2_no_padding(data)["position_ids"].unbind()
    assert rows[0].shape == (4, 4) and rows[0][2].tolist() == [20, 21, 22, 23]


def test_m_rope_position_ids_of_equal_length_rows_stay_ragged_in_their_last_dimension():
    """torch would make rows of one length (or a single row) ragged in their channel dimension."""
    data = _two_rows()
    data["attention_mask"] = torch.ones_like(data["attention_mask"])
    data["position_ids"] = torch.stack([data["position_ids"] + 10 * c for c in range(4)], dim=1)
    for batch in (data, data[:1].clone()):
        positions = left_right_2_no_padding(batch.clone())["position_ids"]
        assert positions.shape[1] == 4 and positions.values().shape == (4, 6 * len(batch))
        assert [row.tolist() for row in positions.unbind()] == batch["position_ids"].tolist()


def test_padding_helpers_name_what_is_missing():
    data = _two_rows()
    del data["response_mask"]
    with pytest.raises(ValueError, match="response_mask"):
        left_right_2_no_padding(data)
    with pytest.raises(ValueError, match="indices"):
        no_padding_2_padding(torch.zeros(2, 3), _two_rows())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_with_global_counts_sums_to_the_whole_batch_value(mode):
    """Micro-batches on 2 ranks: each micro-batch's loss with the whole batch's counts, summed per rank and
    averaged over the ranks (data-parallel gradient averaging), equals the loss of the whole batch at once."""
    g = torch.Generator().manual_seed(3)
    loss_mat = torch.randn(7, 5, dtype=torch.float64, generator=g)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 3])
    mask = (torch.arange(5)[None] < lengths[:, None]).to(torch.float64)
    whole = agg_loss(loss_mat, mask, mode, loss_scale_factor=4.0)
    ranks = [[[0, 1], [2, 3]], [[4], [5, 6]]]  # uneven micro-batches and ranks
    counts = {"dp_size": 2, "batch_num_tokens": int(mask.sum()), "global_batch_size": 7, "loss_scale_factor": 4.0}
    per_rank = [sum(agg_loss(loss_mat[m], mask[m], mode, **counts) for m in micro) for micro in ranks]
    assert float(sum(per_rank) / 2) == pytest.approx(float(whole), rel=1e-12)


def test_agg_loss_global_token_mean_by_hand_and_empty_batches():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    # (1 + 2) / 6 global tokens * 2 ranks
    assert float(agg_loss(loss_mat, mask, "token-mean", dp_size=2, batch_num_tokens=6)) == pytest.approx(1.0)
    empty = torch.zeros_like(mask)
    for mode in LOSS_AGG_MODES:
        assert float(agg_loss(loss_mat, empty, mode, dp_size=2, batch_num_tokens=0, global_batch_size=0)) == 0.0


def test_response_outputs_slices_each_rows_response_predictions():
    data = left_right_2_no_padding(_two_rows())
    values = torch.arange(10, dtype=torch.float64)  # packed positions 0..9
    nested = torch.nested.nested_tensor_from_jagged(values, offsets=data["input_ids"].offsets())
    # row 0 (positions 0-3) has 2 response tokens, predicted at positions 1, 2; row 1 (4-9) has 3, at 6, 7, 8
    assert response_outputs(nested, data).tolist() == [[1.0, 2.0, 0.0], [6.0, 7.0, 8.0]]


def test_sft_loss_shifts_a_jagged_loss_mask_onto_the_predicting_positions():
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([4, 5, 6, 7, 8]), offsets=torch.tensor([0, 3, 5]))
    loss_mask = torch.nested.nested_tensor_from_jagged(torch.tensor([0, 1, 1, 0, 1]), offsets=torch.tensor([0, 3, 5]))
    data = TensorDict({"input_ids": ids, "loss_mask": loss_mask}, batch_size=[2])
    tu.assign_non_tensor(data, dp_size=2, batch_num_tokens=6)
    log_probs = torch.nested.nested_tensor_from_jagged(
        torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0], dtype=torch.float64), offsets=torch.tensor([0, 3, 5])
    )
    loss, metrics = sft_loss(None, {"log_probs": log_probs}, data)
    # tokens 5, 6 (row 0) are predicted at positions 0, 1; token 8 (row 1) at position 3
    assert float(loss) == pytest.approx((1.0 + 2.0 + 4.0) / 6 * 2) and metrics == {}


def _rl_batch(seed: int = 0) -> TensorDict:
    from tests.distributed_helpers import make_ppo_batch

    batch = make_ppo_batch(batch_size=4, prompt_length=4, response_length=5, seed=seed)
    return batch


def test_ppo_loss_on_packed_outputs_equals_the_clipped_objective_on_padded_tensors():
    batch = _rl_batch()
    g = torch.Generator().manual_seed(1)
    response_mask = batch["response_mask"].to(torch.float64)
    log_prob = -torch.rand(4, 5, dtype=torch.float64, generator=g)
    old = log_prob + 0.3 * torch.randn(4, 5, dtype=torch.float64, generator=g)
    advantages = torch.rand(4, 5, dtype=torch.float64, generator=g)  # positive: dual-clip never applies
    ref = log_prob - 0.1
    batch["old_log_probs"], batch["advantages"], batch["ref_log_prob"] = old, advantages, ref
    data = left_right_2_no_padding(batch)
    # the packed per-token log-probs: each response log-prob at the position that predicts its token
    packed = torch.zeros(int(data["input_ids"].offsets()[-1]), dtype=torch.float64)
    ends = data["input_ids"].offsets()[1:]
    n = batch["response_mask"].sum(-1)
    for i in range(4):
        for k in range(int(n[i])):
            packed[ends[i] - n[i] - 1 + k] = log_prob[i, k]
    model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(packed, offsets=data["input_ids"].offsets())}
    tokens = int(response_mask.sum())
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=tokens, global_batch_size=4)
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        use_kl_loss=True,
        kl_loss_coef=0.5,
        kl_loss_type="kl",
    )
    loss, metrics = functools.partial(ppo_loss, config=config)(model_output=model_output, data=data)
    ratio = torch.exp(log_prob - old)
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    expected = ((pg + 0.5 * (log_prob - ref)) * response_mask).sum() / tokens
    assert float(loss) == pytest.approx(float(expected), rel=1e-10)
    assert metrics["kl_coef"] == 0.5
    assert metrics["actor/pg_loss"].values[0] == pytest.approx(float((pg * response_mask).sum() / tokens), rel=1e-10)
    assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "kl_loss"}


def test_value_loss_is_the_clipped_value_loss_of_the_response_predictions():
    batch = _rl_batch(seed=2)
    g = torch.Generator().manual_seed(4)
    mask = batch["response_mask"].to(torch.float64)
    vpreds = torch.randn(4, 5, dtype=torch.float64, generator=g) * mask
    values = torch.randn(4, 5, dtype=torch.float64, generator=g)
    returns = torch.randn(4, 5, dtype=torch.float64, generator=g)
    batch["values"], batch["returns"] = values, returns
    data = left_right_2_no_padding(batch)
    packed = torch.zeros(int(data["input_ids"].offsets()[-1]), dtype=torch.float64)
    ends, n = data["input_ids"].offsets()[1:], batch["response_mask"].sum(-1)
    for i in range(4):
        for k in range(int(n[i])):
            packed[ends[i] - n[i] - 1 + k] = vpreds[i, k]
    output = {"values": torch.nested.nested_tensor_from_jagged(packed, offsets=data["input_ids"].offsets())}
    config = type("CriticCfg", (), {"cliprange_value": 0.2, "loss_agg_mode": "token-mean"})()
    loss, metrics = value_loss(config, output, data)
    clipped = torch.maximum(torch.minimum(vpreds, values + 0.2), values - 0.2)
    per_token = torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2)
    assert float(loss) == pytest.approx(float(0.5 * (per_token * mask).sum() / mask.sum()), rel=1e-10)
    assert metrics["critic/vpred_mean"] == pytest.approx(float((vpreds * mask).sum() / mask.sum()), rel=1e-10)
