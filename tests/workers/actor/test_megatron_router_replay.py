"""MoE router replay (`actor.router_replay.mode=R2`) on the megatron actor.

The old-log-prob pass records each token's experts (checked against the HF model's own top-k of its
router logits); the update's forward routes to exactly those experts after the router weights
moved (read from the routers' outputs by forward hooks; without replay a quarter or more of the
tokens move); without a reason to differ (one mini-batch, one step) a replayed update is the
disabled update bit for bit; ep=2, tp=2 and cp=2 with replay give the ep=1 update; and on
DeepSeek-V3 over 2 pipeline stages (slow) R2 records the one-stage routing and R2 and R3 make the
one-stage update.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import build_loaded_chunks, tiny_moe_hf_model
from verl.protocol import DataProto

TEMPERATURE = 0.7
LR = 0.5


def _config(mode: str, **overrides) -> dict:
    config = {
        "ppo_mini_batch_size": 4,
        "ppo_micro_batch_size_per_gpu": 2,
        "ppo_epochs": 1,
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "policy_loss": {"loss_mode": "vanilla"},
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
        "router_replay": {"mode": mode},
    }
    config.update(overrides)
    return config


def _batch(rows: int = 8) -> DataProto:
    td = make_ppo_batch(batch_size=rows, prompt_length=6, response_length=5, seed=1)
    g = torch.Generator().manual_seed(2)
    td["advantages"] = torch.randn(td["response_mask"].shape, generator=g) * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": TEMPERATURE, "micro_batch_size": 2})


def _moe(top_k: int = 2):
    model = tiny_moe_hf_model()
    model.config.num_experts_per_tok = top_k
    for module in model.modules():  # the HF reference routes as the megatron model does
        if hasattr(module, "top_k"):
            module.top_k = top_k
    return model


def _actor(
    hf_model, mode: str, ep: int = 1, tp: int = 1, cp: int = 1, device: str = "cpu", tf_overrides=None, **overrides
):
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    chunks = build_loaded_chunks(hf_model, ep=ep, tp=tp, cp=cp, sequence_parallel=tp > 1, tf_overrides=tf_overrides)
    chunks = [chunk.to(device) for chunk in chunks]
    params = [p for chunk in chunks for p in chunk.parameters()]
    return MegatronPPOActor(_config(mode, **overrides), chunks, hf_model.config, torch.optim.SGD(params, lr=LR))


def _record(actor, data: DataProto) -> DataProto:
    """The trainer's old-log-prob step: compute_log_prob's outputs joined to the batch."""
    log_probs, stats = actor.compute_log_prob_and_stats(data, ("entropy",))
    data = copy.deepcopy(data)
    data.batch["old_log_probs"] = log_probs.cpu()
    for key, value in stats.items():
        data.batch[key] = value.cpu()
    return data


def _shift_routers(chunks, seed: int = 7, device: str = "cpu") -> None:
    """Move every router's weights far enough that many tokens change experts."""
    from megatron.core.transformer.moe.router import TopKRouter

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.weight.add_(3.0 * torch.randn(module.weight.shape, generator=g).to(device))


def _recorded_experts_are_the_models_routing(rank, world_size):
    hf_model = _moe(top_k=2)
    data = _batch()
    actor = _actor(hf_model, "R2")
    routed = actor.compute_log_prob_and_stats(data, ())[1]["routed_experts"]
    assert routed.dtype == torch.uint8 and routed.shape == (8, 11, 2, 2), (routed.dtype, routed.shape)

    batch = data.batch
    with torch.no_grad():
        out = hf_model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            output_router_logits=True,
        )
    real = batch["attention_mask"].bool()
    for layer, logits in enumerate(out.router_logits):  # [B*S, E] per layer
        want = logits.view(8, 11, -1).topk(2, dim=-1).indices.sort(dim=-1).values
        got = routed[:, :, layer].long().sort(dim=-1).values
        assert torch.equal(got[real], want[real]), f"layer {layer}: {(got[real] != want[real]).any(-1).sum()} tokens"
    assert int(routed[~real].max()) == 0, "padding columns hold zeros"


def test_the_old_log_prob_pass_records_the_experts_the_hf_model_routes_to():
    run_distributed(_recorded_experts_are_the_models_routing, 1)


def _experts_the_update_used(actor, data: DataProto) -> list[torch.Tensor]:
    """Run one update (lr 0) and return, per micro-batch, the experts megatron's routers chose for
    each token: [b, S, layers, E] bool over the batch's padded columns (False at padding), read
    from the routers' outputs (`routing_map`) by forward hooks."""
    from megatron.core.transformer.moe.router import TopKRouter

    from verl.models.mcore.forward import left_align

    maps: list[torch.Tensor] = []
    routers = [m for c in actor.model_chunks for m in c.modules() if isinstance(m, TopKRouter)]
    hooks = [r.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().cpu())) for r in routers]
    for group in actor.actor_optimizer.param_groups:
        group["lr"] = 0.0
    try:
        actor.update_policy(data)
    finally:
        for hook in hooks:
            hook.remove()
    batch, per_micro = data.batch, []
    for m, rows in enumerate(torch.arange(len(batch)).split(2)):
        aligned = left_align(batch["input_ids"][rows], batch["attention_mask"][rows], batch["position_ids"][rows], 5)
        length = aligned.input_ids.shape[1]
        layers = [maps[m * len(routers) + i].view(length, len(rows), -1).transpose(0, 1) for i in range(len(routers))]
        used = torch.zeros(len(rows), batch["input_ids"].shape[1], len(routers), layers[0].shape[-1], dtype=torch.bool)
        b = torch.arange(len(rows))[:, None].expand_as(aligned.real)
        used[b[aligned.real], aligned.source_columns[aligned.real]] = torch.stack(layers, dim=2)[aligned.real]
        per_micro.append(used)
    assert len(maps) == len(routers) * len(per_micro), "one routing per layer and micro-batch"
    return per_micro


def _as_one_hot(routed: torch.Tensor, num_experts: int, mask: torch.Tensor) -> torch.Tensor:
    hot = torch.nn.functional.one_hot(routed.long(), num_experts).any(dim=-2)  # [b, S, layers, E]
    return hot & mask[..., None, None].bool()


def _replay_pins_the_experts(rank, world_size, device="cpu"):
    hf_model = _moe(top_k=2)
    data = _batch()
    mask = data.batch["attention_mask"]
    used = {}
    for mode in ("R2", "disabled"):
        actor = _actor(hf_model, mode, device=device, ppo_mini_batch_size=8)
        recorded = _record(actor, data)
        if mode == "disabled":  # the control: the same update, fed the R2 pass's recording
            recorded.batch["routed_experts"] = used["recorded"]
        else:
            used["recorded"] = recorded.batch["routed_experts"]
            recorded_hot = _as_one_hot(used["recorded"], 4, mask)
        _shift_routers(actor.model_chunks, device=device)
        used[mode] = torch.cat(_experts_the_update_used(actor, recorded))
    flipped = (used["disabled"] != recorded_hot).any(-1).any(-1)[mask.bool()].float().mean()
    assert flipped > 0.2, f"the shifted routers should send many tokens elsewhere; {flipped:.2f} moved"
    mismatch = (used["R2"] != recorded_hot).any(-1).any(-1)[mask.bool()].float().mean()
    assert mismatch == 0, f"with replay {mismatch:.2f} of the tokens used other experts than recorded"


def test_the_update_replays_the_recorded_experts_after_the_router_moved():
    run_distributed(_replay_pins_the_experts, 1)


@pytest.mark.gpu
@pytest.mark.usefixtures("one_gpu_group")
def test_the_update_replays_the_recorded_experts_on_a_gpu():
    """The same on one CUDA device (nccl, fp32, TF32 off): megatron's router runs on the GPU, the
    recording comes back to the host in the batch and goes out again for the update. Fails with the
    fraction of tokens routed elsewhere than recorded (0 wanted) or moved by the shift (> 0.2 wanted)."""
    _replay_pins_the_experts(0, 1, device="cuda")


def _replay_without_a_step_equals_disabled(rank, world_size):
    from verl.models.mcore import mcore_to_hf_named_tensors

    hf_model = _moe(top_k=2)
    data = _batch()
    weights = {}
    for mode in ("disabled", "R2"):
        actor = _actor(hf_model, mode, ppo_mini_batch_size=8)
        recorded = _record(actor, data)
        if mode == "disabled":
            assert "routed_experts" not in recorded.batch
            assert all(getattr(m, "router_replay", None) is None for c in actor.model_chunks for m in c.modules())
        actor.update_policy(recorded)
        weights[mode] = dict(mcore_to_hf_named_tensors(actor.model_chunks, hf_model.config))
    changed = 0
    for name, tensor in weights["disabled"].items():
        assert torch.equal(tensor, weights["R2"][name]), name
        changed += not torch.equal(tensor, hf_model.state_dict()[name])
    assert changed > 10, "the update should move the weights"


def test_replay_of_a_single_mini_batch_is_the_disabled_update_bit_for_bit():
    run_distributed(_replay_without_a_step_equals_disabled, 1)


def _two_step_update(rank, world_size, ep, tp, cp, out_dir):
    """Two mini-batches per rank: the second replays routing recorded before the first's step."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore import mcore_to_hf_named_tensors

    hf_model = _moe(top_k=2)
    data = _batch()
    actor = _actor(hf_model, "R2", ep=ep, tp=tp, cp=cp, ppo_mini_batch_size=4 // (world_size // (tp * cp)))
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    assert dp == world_size // (tp * cp) and mpu.get_expert_model_parallel_world_size() == ep
    mine = data if dp == 1 else data.select_idxs(torch.tensor([0, 1, 4, 5] if dp_rank == 0 else [2, 3, 6, 7]))
    recorded = _record(actor, mine)
    _shift_routers(actor.model_chunks)  # replay matters in both mini-batches
    metrics = actor.update_policy(recorded)
    weights = dict(mcore_to_hf_named_tensors(actor.model_chunks, hf_model.config))
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, f"{out_dir}/ep{ep}_tp{tp}_cp{cp}.pt")


# tp=2 with sequence parallelism: each tensor rank routes half of the columns; cp=2: each context
# rank routes its two chunks of every sequence (the recording is gathered back over both)
@pytest.mark.parametrize("ep,tp,cp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_replayed_updates_at_ep2_tp2_and_cp2_equal_ep1(tmp_path, ep, tp, cp):
    run_distributed(_two_step_update, 2, 1, 1, 1, str(tmp_path))
    run_distributed(_two_step_update, 2, ep, tp, cp, str(tmp_path))
    want = torch.load(tmp_path / "ep1_tp1_cp1.pt")
    got = torch.load(tmp_path / f"ep{ep}_tp{tp}_cp{cp}.pt")
    assert_same_update(got, want)


def assert_same_update(got: dict, want: dict) -> None:
    """Two saved updates agree: their per-mini-batch grad norms (the per-micro-batch metrics differ in
    number: at tp=2 one rank holds every row) and every weight afterwards."""
    torch.testing.assert_close(
        torch.tensor(got["metrics"]["actor/grad_norm"]),
        torch.tensor(want["metrics"]["actor/grad_norm"]),
        rtol=1e-5,
        atol=0,
    )
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=1e-5, rtol=0, msg=name)


def _dynamic_batches_replay_the_same_routing(rank, world_size):
    """Token-budget micro-batches reorder the rows (balanced partitions) in both passes: the routing
    must follow its rows there and back, so the replayed update equals the fixed-size one."""
    from verl.models.mcore import mcore_to_hf_named_tensors

    hf_model = _moe(top_k=2)
    weights = {}
    for dynamic in (False, True):
        data = _batch()
        if dynamic:
            data.meta_info.update({"use_dynamic_bsz": True, "max_token_len": 20})
        actor = _actor(hf_model, "R2", use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=20)
        recorded = _record(actor, data)
        _shift_routers(actor.model_chunks)
        actor.update_policy(recorded)
        weights[dynamic] = dict(mcore_to_hf_named_tensors(actor.model_chunks, hf_model.config))
    for name, tensor in weights[False].items():
        torch.testing.assert_close(weights[True][name], tensor, atol=1e-5, rtol=0, msg=name)


def test_dynamic_batch_sizes_replay_the_routing_of_each_row():
    run_distributed(_dynamic_batches_replay_the_same_routing, 1)


RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _recomputed_backward_replays_too(rank, world_size):
    """Full activation recomputation (upstream's R2 script sets it) runs each layer's forward again in
    the backward pass: it must route through the replayed experts again, or the gradient would be
    that of another network."""
    from verl.models.mcore import mcore_to_hf_named_tensors

    hf_model = _moe(top_k=2)
    weights = {}
    for name, overrides in (("plain", None), ("recompute", RECOMPUTE)):
        actor = _actor(hf_model, "R2", tf_overrides=overrides)
        recorded = _record(actor, _batch())
        _shift_routers(actor.model_chunks)
        actor.update_policy(recorded)
        weights[name] = dict(mcore_to_hf_named_tensors(actor.model_chunks, hf_model.config))
    for name, tensor in weights["plain"].items():
        torch.testing.assert_close(weights["recompute"][name], tensor, atol=1e-6, rtol=0, msg=name)


def test_activation_recomputation_replays_the_recorded_experts_in_the_backward():
    run_distributed(_recomputed_backward_replays_too, 1)


def _deepseek_update(rank, world_size, pp, mode, out_dir):
    """DeepSeek-V3 (`tiny-dsv3`: a dense first layer, then 2 MoE layers with sigmoid group-limited
    routing and a correction bias) recorded, its routers moved, then updated in two mini-batches.
    At pp=2 the first stage holds only the dense layer (`num_layers_in_first_pipeline_stage=1`): it
    records nothing and the second stage both MoE layers, under 1F1B."""
    from megatron.core import parallel_state as mpu

    from tests.megatron_helpers import tiny_dsv3_hf_model
    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = tiny_dsv3_hf_model()
    overrides = {"num_layers_in_first_pipeline_stage": 1} if pp > 1 else None
    chunks = build_loaded_chunks(hf_model, pp=pp, tf_overrides=overrides)
    assert mpu.get_pipeline_model_parallel_world_size() == pp
    params = [p for chunk in chunks for p in chunk.parameters()]
    actor = MegatronPPOActor(_config(mode), chunks, hf_model.config, torch.optim.SGD(params, lr=LR))
    data = _batch()
    if mode == "R3":  # the rollout's routing: here the pp=1 R2 pass's recording
        data.batch["routed_experts"] = torch.load(f"{out_dir}/R2_pp1.pt")["routed"]
    recorded = _record(actor, data)
    if mode == "disabled":
        assert "routed_experts" not in recorded.batch
    else:
        assert recorded.batch["routed_experts"].shape == (8, 11, 2, 4)
    _shift_routers(actor.model_chunks)  # replay matters in both mini-batches
    metrics = actor.update_policy(recorded)
    weights = dict(mcore_to_hf_named_tensors(actor.model_chunks, hf_model.config))
    if rank == 0:
        routed = recorded.batch["routed_experts"] if mode != "disabled" else None
        torch.save(
            {"metrics": metrics, "weights": weights, "routed": routed, "old": recorded.batch["old_log_probs"]},
            f"{out_dir}/{mode}_pp{pp}.pt",
        )


@pytest.mark.slow  # three runs: 3 s warm to 20 s cold (start-up) on 2 CPU cores
def test_deepseek_v3_replay_over_two_pipeline_stages_equals_one_stage(tmp_path):
    """R2 on DeepSeek-V3 at pp=2 (a stage without MoE layers, 1F1B) records exactly the pp=1 routing
    and makes the pp=1 replayed update; without replay the update differs (the routers moved)."""
    run_distributed(_deepseek_update, 1, 1, "R2", str(tmp_path))
    run_distributed(_deepseek_update, 1, 1, "disabled", str(tmp_path))
    run_distributed(_deepseek_update, 2, 2, "R2", str(tmp_path))
    want, got = torch.load(tmp_path / "R2_pp1.pt"), torch.load(tmp_path / "R2_pp2.pt")
    assert torch.equal(got["routed"], want["routed"])
    assert_same_update(got, want)
    unpinned = torch.load(tmp_path / "disabled_pp1.pt")["weights"]
    gap = max(float((unpinned[n] - w).abs().max()) for n, w in want["weights"].items())
    assert gap > 1e-3, f"replay should change the update after the routers moved (gap {gap:.1e})"


@pytest.mark.slow  # three runs: 3 s warm to 20 s cold (start-up) on 2 CPU cores
def test_deepseek_v3_r3_over_two_pipeline_stages_equals_one_stage(tmp_path):
    """R3 (both passes replay the batch's routing) at pp=2 gives the pp=1 old log-probs and update."""
    run_distributed(_deepseek_update, 1, 1, "R2", str(tmp_path))  # the routing R3 replays
    run_distributed(_deepseek_update, 1, 1, "R3", str(tmp_path))
    run_distributed(_deepseek_update, 2, 2, "R3", str(tmp_path))
    want, got = torch.load(tmp_path / "R3_pp1.pt"), torch.load(tmp_path / "R3_pp2.pt")
    torch.testing.assert_close(got["old"], want["old"], atol=1e-5, rtol=0)
    assert_same_update(got, want)
