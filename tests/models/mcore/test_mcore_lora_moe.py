"""LoRA on the MoE expert layers of a Qwen3-MoE model on the megatron backend (`verl.models.mcore.lora`),
against a float64 reference written on the HF model: each expert's fused gate/up and down projections
get their own A and B, applied by hand inside HF's expert loop (`LoRAExpertsReference`), the attention
layers as in the dense LoRA test. Checked at ep=1, ep=2 (tokens through megatron's all-to-all over
gloo) and tp=2 (the experts split over 2 expert-tensor ranks, sequence parallelism on): logits and
log-probs, which parameters get gradients and what they are, one PPO update (metrics, adapters,
frozen base weights), ep=2's adapters against ep=1's, and the exported merge W + alpha/rank * B @ A."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import assert_metrics_close, build_loaded_chunks, tiny_moe_hf_model
from tests.models.mcore.test_mcore_lora import assert_saved_adapters_close
from tests.workers.actor.test_megatron_actor import LR, _actor_config, _training_data
from verl.workers.actor.dp_actor import DataParallelPPOActor

RANK, ALPHA = 4, 8
SCALE = ALPHA / RANK
NUM_EXPERTS = 4
LORA = {"rank": RANK, "alpha": ALPHA, "lora_A_init_method": "xavier", "lora_B_init_method": "kaiming"}


def _all_gather_dim(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _whole_b_of_gated(b: torch.Tensor, group) -> torch.Tensor:
    """A gated fc1's B, whole: each rank holds [its gate rows; its up rows]."""
    shards = _all_gather_dim(b, 0, group).chunk(dist.get_world_size(group))
    return torch.cat([s.chunk(2)[0] for s in shards] + [s.chunk(2)[1] for s in shards])


def whole_adapters(chunks) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) of every adapter of the model, whole, by its global name (layer index, then the module
    path with a routed expert's global index); the same dict on every rank."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.lora import LoRAAdapter, _global_expert_name

    mine = {}
    for layer in chunks[0].decoder.layers:
        for name, module in layer.named_modules():
            adapter = getattr(module, "adapter", None)
            if not isinstance(adapter, LoRAAdapter):
                continue
            group = mpu.get_expert_tensor_parallel_group() if adapter.expert else mpu.get_tensor_model_parallel_group()
            a, b = adapter.linear_in, adapter.linear_out
            if adapter.kind == "column":
                a = a.detach().clone()
                b = _whole_b_of_gated(b, group) if adapter.gated else _all_gather_dim(b, 0, group)
            else:
                a, b = _all_gather_dim(a, 1, group), b.detach().clone()
            mine[f"{layer.layer_number - 1}.{_global_expert_name(layer, name)}"] = (a, b)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for part in everyone:
        out.update(part)
    return out


class LoRAExpertsReference(nn.Module):
    """HF's Qwen3-MoE experts (their eager loop) with each expert's gate/up and down projections
    adapted by hand: x W^T + scale * (x A^T) B^T, the adapters' parameters registered here."""

    def __init__(self, experts: nn.Module, adapters: dict, layer: int, scale: float):
        super().__init__()
        self.base, self.scale = experts, scale
        self.lora = nn.ParameterDict()
        for e in range(experts.num_experts):
            for fc in ("linear_fc1", "linear_fc2"):
                a, b = adapters[f"{layer}.mlp.experts.local_experts.{e}.{fc}"]
                self.lora[f"{e}_{fc}_A"] = nn.Parameter(a.double().clone())
                self.lora[f"{e}_{fc}_B"] = nn.Parameter(b.double().clone())

    def _adapted(self, x, weight, e, fc):
        delta = F.linear(F.linear(x, self.lora[f"{e}_{fc}_A"]), self.lora[f"{e}_{fc}_B"])
        return F.linear(x, weight) + self.scale * delta

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.base.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            x = hidden_states[token]
            gate, up = self._adapted(x, self.base.gate_up_proj[e], e, "linear_fc1").chunk(2, dim=-1)
            y = self._adapted(self.base.act_fn(gate) * up, self.base.down_proj[e], e, "linear_fc2")
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


def reference_model(hf_model, adapters: dict) -> nn.Module:
    """A float64 copy of `hf_model` with the adapters applied by hand (attention and experts); only
    the adapters are trainable."""
    from verl.models.mcore.weights import _split_qkv

    model = copy.deepcopy(hf_model).double()
    model.requires_grad_(False)
    attention = nn.ParameterDict()
    model.lora_attention = attention

    def hook(a_key, b_key, rows):
        def add(module, inputs, output):
            b = attention[b_key] if rows is None else attention[b_key][rows]
            return output + SCALE * F.linear(F.linear(inputs[0], attention[a_key]), b)

        return add

    for index, layer in enumerate(model.model.layers):
        for fc in ("linear_qkv", "linear_proj"):
            a, b = adapters[f"{index}.self_attention.{fc}"]
            attention[f"{index}_{fc}_A"] = nn.Parameter(a.double().clone())
            attention[f"{index}_{fc}_B"] = nn.Parameter(b.double().clone())
        rows = torch.arange(attention[f"{index}_linear_qkv_B"].shape[0])
        for proj, picked in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(rows[:, None], model.config)):
            getattr(layer.self_attn, proj).register_forward_hook(
                hook(f"{index}_linear_qkv_A", f"{index}_linear_qkv_B", picked[:, 0])
            )
        layer.self_attn.o_proj.register_forward_hook(hook(f"{index}_linear_proj_A", f"{index}_linear_proj_B", None))
        # a dense MLP (GLM-4.5's first layers) or a MoE layer's shared experts: fused gate/up, then down
        dense = [(layer.mlp, "mlp")] if not hasattr(layer.mlp, "experts") else []
        if hasattr(layer.mlp, "shared_experts"):
            dense.append((layer.mlp.shared_experts, "mlp.shared_experts"))
        for mlp, path in dense:
            key = f"{index}_{path.replace('.', '_')}"
            for fc in ("linear_fc1", "linear_fc2"):
                a, b = adapters[f"{index}.{path}.{fc}"]
                attention[f"{key}_{fc}_A"] = nn.Parameter(a.double().clone())
                attention[f"{key}_{fc}_B"] = nn.Parameter(b.double().clone())
            gate, up = torch.arange(attention[f"{key}_linear_fc1_B"].shape[0]).chunk(2)
            mlp.gate_proj.register_forward_hook(hook(f"{key}_linear_fc1_A", f"{key}_linear_fc1_B", gate))
            mlp.up_proj.register_forward_hook(hook(f"{key}_linear_fc1_A", f"{key}_linear_fc1_B", up))
            mlp.down_proj.register_forward_hook(hook(f"{key}_linear_fc2_A", f"{key}_linear_fc2_B", None))
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = LoRAExpertsReference(layer.mlp.experts, adapters, index, SCALE)
    return model


def merged_reference(hf_model, adapters: dict) -> dict[str, torch.Tensor]:
    """The HF state dict with every adapted weight replaced by W + scale * B @ A (float64, rounded once)."""
    from verl.models.mcore.lora import shard_invariant_product
    from verl.models.mcore.weights import _split_qkv

    def delta(key):
        a, b = adapters[key]
        return SCALE * shard_invariant_product(b.double(), a.double())

    state = {k: v.double().clone() for k, v in hf_model.state_dict().items()}
    for index in range(hf_model.config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        for proj, part in zip(
            ("q_proj", "k_proj", "v_proj"), _split_qkv(delta(f"{index}.self_attention.linear_qkv"), hf_model.config)
        ):
            state[f"{prefix}self_attn.{proj}.weight"] += part
        state[f"{prefix}self_attn.o_proj.weight"] += delta(f"{index}.self_attention.linear_proj")
        for e in range(NUM_EXPERTS):
            expert = f"{index}.mlp.experts.local_experts.{e}."
            state[f"{prefix}mlp.experts.gate_up_proj"][e] += delta(expert + "linear_fc1")
            state[f"{prefix}mlp.experts.down_proj"][e] += delta(expert + "linear_fc2")
    return {k: v.float() for k, v in state.items()}


def _logits_and_gradients(rank, world_size, ep):
    """tp=1: every rank runs the whole batch, so each one's logits are the reference's."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.lora import apply_lora

    hf_model = tiny_moe_hf_model(num_layers=2)
    chunks = build_loaded_chunks(hf_model, ep=ep)
    assert mpu.get_expert_model_parallel_world_size() == ep
    trained = apply_lora(chunks, LORA, seed=7)
    names = [n for n, p in chunks[0].named_parameters() if p.requires_grad]
    experts_here = NUM_EXPERTS // ep
    # per layer: qkv + proj, and fc1 + fc2 of each local expert; A and B each
    assert len(trained) == len(names) == 2 * 2 * (2 + 2 * experts_here), names
    assert all(".adapter." in n for n in names)
    adapters = whole_adapters(chunks)
    assert sum(".experts." in k for k in adapters) == 2 * 2 * NUM_EXPERTS

    reference = reference_model(hf_model, adapters)
    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, 12)
    got = chunks[0](ids, positions, None)[..., :vocab]
    want = reference(input_ids=ids).logits
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    base = hf_model(input_ids=ids).logits
    assert float((want - base).detach().abs().max()) > 1e-2, "the adapters should change the logits"

    # the same loss on both: only adapters get gradients, and they are the reference's (summed over
    # the ranks holding an expert: each expert-parallel rank's tokens reach it through the all-to-all)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (got * weights).sum().backward()
    (want * weights.double()).sum().backward()
    for name, param in chunks[0].named_parameters():
        if ".adapter." not in name:
            assert param.grad is None, f"frozen {name} got a gradient"
    from verl.models.mcore.lora import LoRAAdapter, _global_expert_name

    reference_params = dict(reference.named_parameters())
    checked = 0
    for layer in chunks[0].decoder.layers:
        index = layer.layer_number - 1
        for name, module in layer.named_modules():
            adapter = getattr(module, "adapter", None)
            if not isinstance(adapter, LoRAAdapter) or not adapter.expert:
                continue
            expert = _global_expert_name(layer, name).split(".")[3]
            fc = name.rsplit(".", 1)[-1]
            for ab, param in zip("AB", (adapter.linear_in, adapter.linear_out)):
                grad = param.grad.double()
                want_grad = reference_params[f"model.layers.{index}.mlp.experts.lora.{expert}_{fc}_{ab}"].grad
                # every rank ran the whole batch, and the all-to-all brought each rank's tokens (and their
                # gradients) to the one rank holding the expert: at ep=2 it holds twice the reference's
                want_grad = world_size * want_grad  # float32 sums: to 1e-5 of the largest element
                tolerance = 1e-5 * float(want_grad.abs().max())
                torch.testing.assert_close(grad, want_grad, atol=tolerance, rtol=0, msg=f"{name}.{ab}")
                assert float(grad.abs().max()) > 0, f"{name}.{ab}: zero gradient"
                checked += 1
    assert checked == 2 * experts_here * 2 * 2


@pytest.mark.parametrize("ep,world", [(1, 1), (2, 2)])
def test_expert_adapters_give_the_float64_reference_logits_and_only_adapters_get_gradients(ep, world):
    run_distributed(_logits_and_gradients, world, ep)


def _update(rank, world_size, ep, tp, out_path, pp=1, cp=1, etp=None):
    from megatron.core import parallel_state as mpu

    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.models.mcore.lora import apply_lora
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = tiny_moe_hf_model(num_layers=2)
    data = _training_data(hf_model)
    mask = data.batch["response_mask"].bool()
    chunks = build_loaded_chunks(hf_model, ep=ep, tp=tp, pp=pp, cp=cp, etp=etp, sequence_parallel=tp > 1)
    base_before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    trained = apply_lora(chunks, LORA, seed=7)
    adapters = whole_adapters(chunks)

    ref_model = reference_model(hf_model, adapters)
    ref_actor_config = _actor_config(ppo_mini_batch_size=4, use_remove_padding=True, share_prompt_forward=False)
    reference = DataParallelPPOActor(
        ref_actor_config, ref_model, torch.optim.SGD([p for p in ref_model.parameters() if p.requires_grad], lr=LR)
    )
    dp = mpu.get_data_parallel_world_size()
    actor = MegatronPPOActor(
        _actor_config(ppo_mini_batch_size=4 // dp), chunks, hf_model.config, torch.optim.SGD(trained, lr=LR)
    )

    lp_data = copy.deepcopy(data)
    lp_data.meta_info.update(micro_batch_size=4)
    want_lp, _ = reference.compute_log_prob(copy.deepcopy(lp_data))
    got_lp, _ = actor.compute_log_prob(copy.deepcopy(lp_data))
    torch.testing.assert_close(got_lp[mask].double(), want_lp[mask], atol=1e-5, rtol=0)

    want_metrics = reference.update_policy(copy.deepcopy(data))
    # the reference's mini-batches are rows 0-3 and 4-7 and its micro-batches pairs: each data-parallel
    # rank holds one pair of each mini-batch (as tests/workers/actor/test_megatron_actor_moe.py)
    mine = torch.tensor([0, 1, 4, 5] if mpu.get_data_parallel_rank() == 0 else [2, 3, 6, 7])
    got_metrics = actor.update_policy(data.select_idxs(mine) if dp == 2 else copy.deepcopy(data))
    assert_metrics_close(got_metrics, want_metrics, ["actor/grad_norm"])

    after = whole_adapters(chunks)
    reference_params = dict(ref_model.named_parameters())
    for key, (a, b) in after.items():
        index, path = key.split(".", 1)
        if ".experts." in path:
            expert, fc = path.split(".")[3], path.rsplit(".", 1)[-1]
            ref_key = f"model.layers.{index}.mlp.experts.lora.{expert}_{fc}_"
        else:
            ref_key = f"lora_attention.{index}_{path.rsplit('.', 1)[-1]}_"
        for ab, t in zip("AB", (a, b)):
            torch.testing.assert_close(
                t.double(), reference_params[ref_key + ab].detach(), atol=1e-5, rtol=0, msg=key + ab
            )
    moved = max(float((after[k][i] - adapters[k][i]).abs().max()) for k in after if ".experts." in k for i in (0, 1))
    assert moved > 1e-3, f"the update should move the expert adapters (moved {moved})"
    for name, param in chunks[0].named_parameters():
        if ".adapter." not in name:
            assert torch.equal(param, base_before[name]), f"base weight {name} changed"

    # the exported weights: each expert's gate/up and down the float64 merge with its own adapter
    exported = dict(mcore_to_hf_named_tensors(chunks, hf_model.config))
    want_merge = merged_reference(hf_model, after)
    assert sorted(exported) == sorted(want_merge)
    for name, tensor in exported.items():
        assert torch.equal(tensor, want_merge[name]), f"{name}: max diff {(tensor - want_merge[name]).abs().max()}"
    if rank == 0:
        torch.save(after, out_path)


def test_ppo_update_with_expert_adapters_at_ep2_equals_ep1_and_the_float64_reference(tmp_path):
    run_distributed(_update, 1, 1, 1, str(tmp_path / "ep1.pt"))
    run_distributed(_update, 2, 2, 1, str(tmp_path / "ep2.pt"))
    assert_saved_adapters_close(tmp_path / "ep2.pt", tmp_path / "ep1.pt", atol=1e-5)


@pytest.mark.slow
def test_ppo_update_with_expert_adapters_split_over_two_expert_tensor_ranks_equals_the_reference(tmp_path):
    """tp=2 (so etp=2, sequence parallelism on): each expert's fc1 B and fc2 A are split over the
    expert-tensor ranks, fc1's A and fc2's B gradients summed over them."""
    run_distributed(_update, 2, 1, 2, str(tmp_path / "tp2.pt"))


def test_ppo_update_with_expert_adapters_split_over_more_ranks_than_the_dense_layers_equals_the_reference(tmp_path):
    """tp=1, etp=2 on 2 ranks (issue #27): the attention adapters whole on both data-parallel ranks,
    each expert's adapters split as its MLP is, over an expert-tensor group that spans the
    data-parallel ranks (fc1's A and fc2's B gradients summed over ranks that trained other rows)."""
    run_distributed(_update, 2, 1, 1, str(tmp_path / "out.pt"), 1, 1, 2)


def _targets_and_refusals(rank, world_size):
    """Patterns name experts by their global index (the same expert at ep=1 and ep=2); excluding the
    experts leaves the attention; dropout on experts split over expert-tensor ranks is refused."""
    from verl.models.mcore.lora import apply_lora
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    hf_model = tiny_moe_hf_model(num_layers=2)
    chunks = build_loaded_chunks(hf_model, ep=2)
    apply_lora(chunks, {"rank": 2, "target_modules": ["*.layers.1.mlp.experts.local_experts.3.*"]})
    adapted = sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad)
    # global expert 3 is rank 1's local expert 1
    want = [
        f"decoder.layers.1.mlp.experts.local_experts.1.{fc}.adapter.{ab}"
        for fc in ("linear_fc1", "linear_fc2")
        for ab in ("linear_in", "linear_out")
    ]
    assert adapted == (want if dist.get_rank() == 1 else []), adapted
    destroy_model_parallel()

    chunks = build_loaded_chunks(hf_model, ep=2)
    apply_lora(chunks, {"rank": 2, "exclude_modules": ["*.experts.*"]})
    adapted = [n for n, p in chunks[0].named_parameters() if p.requires_grad]
    assert len(adapted) == 2 * 2 * 2 and all(".self_attention." in n for n in adapted), adapted
    destroy_model_parallel()

    chunks = build_loaded_chunks(hf_model, tp=2, sequence_parallel=True)  # etp=2
    with pytest.raises(NotImplementedError, match=r"lora.dropout=0.1 on the expert layer .* 2 expert-tensor ranks"):
        apply_lora(chunks, {"rank": 2, "dropout": 0.1})
    destroy_model_parallel()


def test_expert_target_patterns_use_global_expert_indices_and_etp_dropout_is_refused():
    run_distributed(_targets_and_refusals, 2)


@pytest.mark.slow
@pytest.mark.parametrize("pp,cp", [(2, 1), (1, 2)])
def test_ppo_update_with_expert_adapters_under_pipeline_or_context_parallelism_equals_the_reference(tmp_path, pp, cp):
    """The layouts of upstream's Qwen3-30B-A3B LoRA script, one at a time on 2 ranks: each pipeline stage
    adapts its own layer's experts; context ranks each route their part of every sequence."""
    run_distributed(_update, 2, 1, 1, str(tmp_path / "out.pt"), pp, cp)


@pytest.mark.slow
@pytest.mark.parametrize("etp", [1, 2])
def test_ppo_update_with_expert_adapters_at_ep2_tp2_on_four_ranks_equals_the_reference(tmp_path, etp):
    """ep=2 x tp=2 with whole experts (etp=1, as upstream's Qwen3-30B-A3B LoRA script): the attention
    adapters split over the tensor ranks, each expert's adapters whole on its expert-parallel rank; and
    with each expert split over both tensor ranks too (etp=2: megatron's dispatcher gathers uneven token
    counts over the expert-tensor ranks, gloo's form in verl/utils/megatron/gloo_collectives.py)."""
    run_distributed(_update, 4, 2, 2, str(tmp_path / "out.pt"), 1, 1, etp)


def _glm4moe_logits(rank, world_size):
    """GLM-4.5's layout (tiny-glm4moe: a dense first layer, then MoE layers with a shared expert): the
    dense MLP and the shared expert get the dense adapters, each routed expert its own."""
    from tests.megatron_helpers import tiny_glm4moe_hf_model
    from verl.models.mcore.lora import apply_lora

    hf_model = tiny_glm4moe_hf_model()
    chunks = build_loaded_chunks(hf_model)
    apply_lora(chunks, LORA, seed=7)
    adapters = whole_adapters(chunks)
    assert any(".shared_experts." in k for k in adapters) and any(".local_experts." in k for k in adapters)
    reference = reference_model(hf_model, adapters)
    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    got = chunks[0](ids, torch.arange(12).expand(2, 12), None)[..., :vocab]
    want = reference(input_ids=ids).logits
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=0)
    assert float((want - hf_model(input_ids=ids).logits).detach().abs().max()) > 1e-2


def test_glm4moe_adapters_on_dense_shared_and_routed_experts_give_the_reference_logits():
    run_distributed(_glm4moe_logits, 1)
