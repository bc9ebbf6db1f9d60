"""MoE router replay R3 (`actor.router_replay.mode=R3`) on the megatron actor: the routing comes
with the batch from the rollout engine, and both the old-log-prob pass and the update replay it.

The "rollout's" routing here is what the engine's recorder (`verl.models.moe.RoutingRecorder`)
reads from the HF model's routers on the same sequences: when it is the actor's own routing, R3
changes nothing (old log-probs and the update equal the unpinned ones bit for bit); when one
token's experts are changed, exactly the log-probs downstream of that token change (a causal model:
the token's own prediction and later ones in its row; every other row and every earlier column
stays), and the update routes every token to the rollout's experts after the routers moved. ep=2,
tp=2 (sequence parallel) and cp=2 replay the same in both passes and train the same weights as
ep=1, and token-budget micro-batches (which reorder the rows) replay each row's own routing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.workers.actor.test_megatron_router_replay import (
    _actor,
    _as_one_hot,
    _batch,
    _experts_the_update_used,
    _moe,
    _shift_routers,
)
from verl.models.moe import RoutingRecorder
from verl.protocol import DataProto

COLUMN = 8  # the altered token: a full-length row's third response column (prompts are 6 wide)


def _rollout_routing(hf_model, data: DataProto) -> torch.Tensor:
    """[B, S, layers, k] uint8: the HF model's routing of the batch's sequences, zeros at padding."""
    batch = data.batch
    B, S = batch["input_ids"].shape
    recorder = RoutingRecorder(hf_model)
    with torch.no_grad(), recorder:
        hf_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        )
        routing = recorder.take().view(B, S, -1, recorder.top_k)
    return (routing * batch["attention_mask"][..., None, None]).to(recorder.dtype)


def _full_row(data: DataProto) -> int:
    return int(torch.nonzero(data.batch["response_mask"].sum(-1) == 5)[0])


def _altered(routing: torch.Tensor, row: int, column: int, num_experts: int = 4) -> torch.Tensor:
    """The routing with one token's experts moved to the ones it did not choose (top-2 of 4)."""
    altered = routing.clone()
    for layer in range(routing.shape[2]):
        chosen = set(routing[row, column, layer].tolist())
        altered[row, column, layer] = torch.tensor([e for e in range(num_experts) if e not in chosen])
    return altered


def _old_log_probs(actor, data: DataProto) -> torch.Tensor:
    log_probs, stats = actor.compute_log_prob_and_stats(data, ("entropy",))
    assert "routed_experts" not in stats, "R3 returns no routing of its own (the rollout's stays in the batch)"
    return log_probs


def _r3_pins_the_rollout_routing(rank, world_size):
    from verl.models.mcore import mcore_to_hf_named_tensors

    hf_model = _moe(top_k=2)
    data = _batch()
    routing = _rollout_routing(hf_model, data)
    row = _full_row(data)
    response = data.batch["response_mask"].bool()

    # the rollout's routing is the actor's own: R3 is the unpinned actor, pass and update, bit for bit
    results = {}
    for mode in ("disabled", "R3"):
        actor = _actor(hf_model, mode, ppo_mini_batch_size=8)
        batch = copy.deepcopy(data)
        if mode == "R3":
            batch.batch["routed_experts"] = routing
        batch.batch["old_log_probs"] = _old_log_probs(actor, batch)
        actor.update_policy(batch)
        weights = dict(mcore_to_hf_named_tensors(actor.model_chunks, hf_model.config))
        results[mode] = (batch.batch["old_log_probs"], weights)
    assert torch.equal(results["R3"][0], results["disabled"][0])
    for name, tensor in results["disabled"][1].items():
        assert torch.equal(tensor, results["R3"][1][name]), name

    # one token routed elsewhere by the rollout: the log-probs downstream of it change, no others
    altered = _altered(routing, row, COLUMN)
    actor = _actor(hf_model, "R3", ppo_mini_batch_size=8)
    batch = copy.deepcopy(data)
    batch.batch["routed_experts"] = altered
    got = _old_log_probs(actor, batch)
    want = results["disabled"][0]
    # response column j is predicted from input column 6 + j - 1: it sees the altered token from j = COLUMN - 5
    downstream = torch.zeros_like(response)
    downstream[row, COLUMN - 5 :] = True
    gap = (got - want).abs()
    assert gap[downstream & response].min() > 1e-4, f"downstream of the altered token: {gap[row]}"
    assert gap[~downstream & response].max() < 1e-6, f"elsewhere: {gap[~downstream & response].max()}"

    # the update routes to the rollout's experts after the routers moved (without replay many move)
    batch.batch["old_log_probs"] = got
    _shift_routers(actor.model_chunks)
    used = torch.cat(_experts_the_update_used(actor, batch))
    mask = data.batch["attention_mask"]
    mismatch = (used != _as_one_hot(altered, 4, mask)).any(-1).any(-1)[mask.bool()].float().mean()
    assert mismatch == 0, f"with R3 {mismatch:.2f} of the tokens used other experts than the rollout's"


def test_r3_replays_the_rollouts_routing_in_the_old_log_prob_pass_and_the_update():
    run_distributed(_r3_pins_the_rollout_routing, 1)


def _r3_needs_the_rollouts_routing(rank, world_size):
    actor = _actor(_moe(top_k=2), "R3")
    with pytest.raises(KeyError, match="mode=R3 replays the routing the rollout engine recorded"):
        actor.compute_log_prob_and_stats(_batch(), ())


def test_r3_without_routed_experts_in_the_batch_is_refused():
    run_distributed(_r3_needs_the_rollouts_routing, 1)


def _two_step_r3_update(rank, world_size, ep, tp, cp, out_dir):
    """Two mini-batches per rank after the routers moved: every forward replays the rollout's routing."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore import mcore_to_hf_named_tensors

    hf_model = _moe(top_k=2)
    data = _batch()
    data.batch["routed_experts"] = _altered(_rollout_routing(hf_model, data), _full_row(data), COLUMN)
    dp = world_size // (tp * cp)
    actor = _actor(hf_model, "R3", ep=ep, tp=tp, cp=cp, ppo_mini_batch_size=4 // dp)
    assert mpu.get_expert_model_parallel_world_size() == ep and mpu.get_data_parallel_world_size() == dp
    dp_rank = mpu.get_data_parallel_rank()
    mine = data if dp == 1 else data.select_idxs(torch.tensor([0, 1, 4, 5] if dp_rank == 0 else [2, 3, 6, 7]))
    _shift_routers(actor.model_chunks)
    mine.batch["old_log_probs"] = _old_log_probs(actor, mine)
    metrics = actor.update_policy(mine)
    weights = dict(mcore_to_hf_named_tensors(actor.model_chunks, hf_model.config))
    parts = [None] * world_size
    torch.distributed.all_gather_object(parts, mine.batch["old_log_probs"])
    masks = [None] * world_size
    torch.distributed.all_gather_object(masks, mine.batch["response_mask"])
    if rank == 0:
        old = torch.cat(parts) if dp > 1 else mine.batch["old_log_probs"]  # tp/cp ranks hold the same rows
        old = old * (torch.cat(masks) if dp > 1 else mine.batch["response_mask"])  # padding: whatever the model gave
        torch.save({"metrics": metrics, "weights": weights, "old": old}, f"{out_dir}/ep{ep}_tp{tp}_cp{cp}.pt")


# tp=2 and cp=2 in the slow tier: the replay's layout code is R2's, whose tp=2 and cp=2 tests run by default
@pytest.mark.parametrize(
    "ep,tp,cp",
    [(2, 1, 1), pytest.param(1, 2, 1, marks=pytest.mark.slow), pytest.param(1, 1, 2, marks=pytest.mark.slow)],
)
def test_r3_at_ep2_tp2_and_cp2_equals_ep1(tmp_path, ep, tp, cp):
    run_distributed(_two_step_r3_update, 2, 1, 1, 1, str(tmp_path))
    run_distributed(_two_step_r3_update, 2, ep, tp, cp, str(tmp_path))
    want, got = torch.load(tmp_path / "ep1_tp1_cp1.pt"), torch.load(tmp_path / f"ep{ep}_tp{tp}_cp{cp}.pt")
    if tp * cp == 1:
        torch.testing.assert_close(got["old"], want["old"], atol=1e-5, rtol=0)
    else:  # one data-parallel rank holds every row, in the order [0, 1, 4, 5, 2, 3, 6, 7] of the dp=2 runs
        torch.testing.assert_close(got["old"][[0, 1, 4, 5, 2, 3, 6, 7]], want["old"], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.tensor(got["metrics"]["actor/grad_norm"]),
        torch.tensor(want["metrics"]["actor/grad_norm"]),
        rtol=1e-5,
        atol=0,
    )
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=1e-5, rtol=0, msg=name)


def _dynamic_batches_replay_each_rows_routing(rank, world_size):
    hf_model = _moe(top_k=2)
    old = {}
    for dynamic in (False, True):
        data = _batch()
        data.batch["routed_experts"] = _altered(_rollout_routing(hf_model, data), _full_row(data), COLUMN)
        if dynamic:
            data.meta_info.update({"use_dynamic_bsz": True, "max_token_len": 20})
        actor = _actor(hf_model, "R3", use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=20)
        _shift_routers(actor.model_chunks)
        old[dynamic] = _old_log_probs(actor, data) * data.batch["response_mask"]  # padding: not compared
    torch.testing.assert_close(old[True], old[False], atol=1e-6, rtol=0)


def test_dynamic_batch_sizes_replay_the_rollout_routing_of_each_row():
    run_distributed(_dynamic_batches_replay_each_rows_routing, 1)
