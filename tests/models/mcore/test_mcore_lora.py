"""LoRA on the megatron backend (`verl.models.mcore.lora`) against a float64 reference of the same
math written on the HF model: fused QKV / gate-up adapters share one A, whose B rows are split into
q, k, v (gate, up) by megatron's fused layout. One PPO update at tp=1, tp=2 and tp=2 with sequence
parallelism gives the reference's metrics and adapters, leaves the base weights bit for bit, and the
exported weights are the float64 merge W + alpha/rank * B @ A; tp=2's adapters equal tp=1's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import assert_metrics_close, build_loaded_chunks, tiny_hf_model

# the plain Megatron actor test's config and batch: LoRA changes only which weights train
from tests.workers.actor.test_megatron_actor import LR, _actor_config, _training_data
from verl.workers.actor.dp_actor import DataParallelPPOActor

RANK, ALPHA = 4, 8
LORA = {
    "rank": RANK,
    "alpha": ALPHA,
    # B nonzero from the start, so A's gradient (summed over tensor ranks) is exercised at once
    "lora_A_init_method": "xavier",
    "lora_B_init_method": "kaiming",
}


def _gather(local: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state as mpu

    size = mpu.get_tensor_model_parallel_world_size()
    if size == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def full_adapters(chunks) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) of every adapted layer, whole, B's rows in megatron's global layout ([gate; up] for fc1)."""
    from megatron.core import parallel_state as mpu

    out = {}
    for layer in chunks[0].decoder.layers:
        for name, module in layer.named_modules():
            adapter = getattr(module, "adapter", None)
            if adapter is None:
                continue
            a, b = adapter.linear_in, adapter.linear_out
            if adapter.kind == "column":
                if adapter.gated:
                    tp = mpu.get_tensor_model_parallel_world_size()
                    shards = _gather(b, 0).chunk(tp)
                    b_full = torch.cat([s.chunk(2)[0] for s in shards] + [s.chunk(2)[1] for s in shards])
                else:
                    b_full = _gather(b, 0)
                out[f"{layer.layer_number - 1}.{name}"] = (a.detach().clone(), b_full)
            else:
                out[f"{layer.layer_number - 1}.{name}"] = (_gather(a, 1), b.detach().clone())
    return out


def attach_reference_lora(hf_model, adapters: dict, scale: float) -> torch.nn.ParameterDict:
    """The same LoRA math on the HF model, in float64, with the adapters as parameters of the model
    (so the actor's gradient clipping sees them); the HF weights are frozen."""
    from verl.models.mcore.weights import _split_qkv

    hf_model.requires_grad_(False)
    params = torch.nn.ParameterDict(
        {
            key.replace(".", "_") + "_" + ab: torch.nn.Parameter(t.double())
            for key, pair in adapters.items()
            for ab, t in zip("AB", pair)
        }
    )
    hf_model.lora_reference = params  # registered: part of hf_model.parameters()

    def hook(a_key, b_key, rows):
        def add(module, inputs, output):
            b = params[b_key][rows] if rows is not None else params[b_key]
            return output + scale * F.linear(F.linear(inputs[0], params[a_key]), b)

        return add

    config = hf_model.config
    for index, layer in enumerate(hf_model.model.layers):
        qkv = f"{index}_self_attention_linear_qkv"
        rows = torch.arange(params[qkv + "_B"].shape[0])
        for proj, picked in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(rows[:, None], config)):
            getattr(layer.self_attn, proj).register_forward_hook(hook(qkv + "_A", qkv + "_B", picked[:, 0]))
        layer.self_attn.o_proj.register_forward_hook(
            hook(f"{index}_self_attention_linear_proj_A", f"{index}_self_attention_linear_proj_B", None)
        )
        fc1 = f"{index}_mlp_linear_fc1"
        gate, up = torch.arange(params[fc1 + "_B"].shape[0]).chunk(2)
        layer.mlp.gate_proj.register_forward_hook(hook(fc1 + "_A", fc1 + "_B", gate))
        layer.mlp.up_proj.register_forward_hook(hook(fc1 + "_A", fc1 + "_B", up))
        layer.mlp.down_proj.register_forward_hook(hook(f"{index}_mlp_linear_fc2_A", f"{index}_mlp_linear_fc2_B", None))
    return params


def _update_matches_reference(rank, world_size, tp, sp, out_path):
    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.models.mcore.lora import adapters_disabled, apply_lora
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=True, num_layers=2)
    data = _training_data(hf_model)
    mask = data.batch["response_mask"].bool()
    chunks = build_loaded_chunks(hf_model, tp=tp, sequence_parallel=sp)
    base_before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    trained = apply_lora(chunks, LORA, seed=7)
    assert all(p.requires_grad for p in trained)
    assert [n for n, p in chunks[0].named_parameters() if p.requires_grad] == [
        n for n in dict(chunks[0].named_parameters()) if ".adapter." in n
    ], "only the adapters train"
    adapters = full_adapters(chunks)
    assert len(adapters) == 2 * 4

    reference_model = copy.deepcopy(hf_model).double()
    ref_params = attach_reference_lora(reference_model, adapters, ALPHA / RANK)
    reference = DataParallelPPOActor(
        _actor_config(),
        reference_model,
        torch.optim.SGD([p for p in reference_model.parameters() if p.requires_grad], lr=LR),
    )
    actor = MegatronPPOActor(_actor_config(), chunks, hf_model.config, torch.optim.SGD(trained, lr=LR))

    # log-probs with the adapters, and without them the plain model's (the reference policy)
    lp_data = copy.deepcopy(data)
    lp_data.meta_info.update(micro_batch_size=3)
    want, _ = reference.compute_log_prob(copy.deepcopy(lp_data))
    got, _ = actor.compute_log_prob(copy.deepcopy(lp_data))
    torch.testing.assert_close(got[mask].double(), want[mask], atol=1e-5, rtol=0)
    base_lp, _ = DataParallelPPOActor(_actor_config(), copy.deepcopy(hf_model).double()).compute_log_prob(
        copy.deepcopy(lp_data)
    )
    with adapters_disabled(chunks):
        got_base, _ = actor.compute_log_prob(copy.deepcopy(lp_data))
    torch.testing.assert_close(got_base[mask].double(), base_lp[mask], atol=1e-5, rtol=0)
    assert (got - got_base)[mask].abs().max() > 1e-3, "the adapters should change the policy"

    want_metrics = reference.update_policy(copy.deepcopy(data))
    got_metrics = actor.update_policy(copy.deepcopy(data))
    assert_metrics_close(got_metrics, want_metrics)

    after = full_adapters(chunks)
    for key, (a, b) in after.items():
        key_ = key.replace(".", "_")
        torch.testing.assert_close(a.double(), ref_params[key_ + "_A"].detach(), atol=1e-5, rtol=0, msg=f"{key} A")
        torch.testing.assert_close(b.double(), ref_params[key_ + "_B"].detach(), atol=1e-5, rtol=0, msg=f"{key} B")
    moved = max(float((after[k][i] - adapters[k][i]).abs().max()) for k in after for i in (0, 1))
    assert moved > 1e-3, f"the update should move the adapters (moved {moved})"
    for name, param in chunks[0].named_parameters():
        if ".adapter." not in name:
            assert torch.equal(param, base_before[name]), f"base weight {name} changed"

    # exported weights: the float64 merge of the base weights and the trained adapters, rounded once
    exported = dict(mcore_to_hf_named_tensors(chunks, hf_model.config))
    reference_merge = _reference_merge(hf_model, after, ALPHA / RANK)
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference_merge[name]), (
            f"{name}: max diff {(tensor - reference_merge[name]).abs().max()}"
        )
    if rank == 0:
        torch.save({k: (a, b) for k, (a, b) in after.items()}, out_path)


def _reference_merge(hf_model, adapters, scale) -> dict[str, torch.Tensor]:
    """HF weights + scale * B @ A per projection, in float64, rounded to float32 once."""
    from verl.models.mcore.weights import _split_qkv

    state = {k: v.double() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    for index in range(hf_model.config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        a, b = adapters[f"{index}.self_attention.linear_qkv"]
        delta = scale * (b.double() @ a.double())
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(delta, hf_model.config)):
            state[f"{prefix}self_attn.{proj}.weight"] += part
        a, b = adapters[f"{index}.self_attention.linear_proj"]
        state[f"{prefix}self_attn.o_proj.weight"] += scale * (b.double() @ a.double())
        a, b = adapters[f"{index}.mlp.linear_fc1"]
        gate, up = (scale * (b.double() @ a.double())).chunk(2)
        state[f"{prefix}mlp.gate_proj.weight"] += gate
        state[f"{prefix}mlp.up_proj.weight"] += up
        a, b = adapters[f"{index}.mlp.linear_fc2"]
        state[f"{prefix}mlp.down_proj.weight"] += scale * (b.double() @ a.double())
    return {k: v.float() for k, v in state.items()}


def assert_saved_adapters_close(got_path, want_path, atol: float) -> None:
    """Two runs' saved adapters (`{name: (A, B)}`, as `_update_matches_reference` writes them) name
    the same adapters and agree within `atol`."""
    got, want = torch.load(got_path), torch.load(want_path)
    assert sorted(got) == sorted(want)
    for key in want:
        for i in (0, 1):
            torch.testing.assert_close(got[key][i], want[key][i], atol=atol, rtol=0, msg=key)


def test_lora_update_at_tp1_and_tp2_equals_the_float64_reference_and_each_other(tmp_path):
    run_distributed(_update_matches_reference, 1, 1, False, str(tmp_path / "tp1.pt"))
    run_distributed(_update_matches_reference, 2, 2, False, str(tmp_path / "tp2.pt"))
    assert_saved_adapters_close(tmp_path / "tp2.pt", tmp_path / "tp1.pt", atol=1e-6)


@pytest.mark.slow
def test_lora_update_at_tp2_with_sequence_parallelism_equals_the_float64_reference(tmp_path):
    run_distributed(_update_matches_reference, 2, 2, True, str(tmp_path / "sp.pt"))


def _targets_dropout_and_experts(rank, world_size):
    from verl.models.mcore.lora import apply_lora
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=True, num_layers=2)
    # a '*' pattern over the full name, and an exclusion: only layer 1's attention output projection
    chunks = build_loaded_chunks(hf_model)
    apply_lora(
        chunks,
        {
            "rank": 2,
            "alpha": 2,
            "target_modules": ["*.layers.1.*"],
            "exclude_modules": ["linear_qkv", "linear_fc1", "linear_fc2"],
        },
    )
    adapted = sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad)
    assert adapted == [
        "decoder.layers.1.self_attention.linear_proj.adapter.linear_in",
        "decoder.layers.1.self_attention.linear_proj.adapter.linear_out",
    ], adapted
    destroy_model_parallel()
    with pytest.raises(ValueError, match=r"matches no layer of this model"):
        apply_lora(build_loaded_chunks(hf_model), {"rank": 2, "target_modules": ["*.layers.9.*"]})
    destroy_model_parallel()

    # dropout on the adapter's input (pre) or output (post) in training mode, none in eval mode
    for position in ("pre", "post"):
        chunks = build_loaded_chunks(hf_model)
        cfg = {"rank": 2, "alpha": 6, "dropout": 0.5, "dropout_position": position, "lora_B_init_method": "kaiming"}
        apply_lora(chunks, cfg, seed=3)
        layer = chunks[0].decoder.layers[0].mlp.linear_fc2
        a, b = layer.adapter.linear_in.detach(), layer.adapter.linear_out.detach()
        x = torch.randn(3, 2, a.shape[1], generator=torch.Generator().manual_seed(0))
        base = F.linear(x, layer.weight)
        layer.train()
        torch.manual_seed(11)
        got = layer(x)[0]
        torch.manual_seed(11)
        if position == "pre":
            want = base + 3.0 * F.linear(F.linear(F.dropout(x, 0.5, training=True), a), b)
        else:
            want = base + 3.0 * F.dropout(F.linear(F.linear(x, a), b), 0.5, training=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        layer.eval()
        torch.testing.assert_close(layer(x)[0], base + 3.0 * F.linear(F.linear(x, a), b), atol=1e-5, rtol=0)
        destroy_model_parallel()


def test_target_patterns_exclusions_and_dropout_positions():
    run_distributed(_targets_dropout_and_experts, 1)


@pytest.mark.gpu
@pytest.mark.usefixtures("one_gpu_group")
def test_lora_on_one_gpu_matches_the_reference_and_trains_only_the_adapters():
    """On one GPU (NCCL, fp32, TF32 off): the adapted model's logits equal the HF model's with the
    reference LoRA hooks within 1e-4, a backward pass gives every adapter a finite non-zero gradient
    and the frozen weights none, and the exported merge equals the CPU float64 merge within 1e-6."""
    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.models.mcore.lora import apply_lora

    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=True, num_layers=2)
    chunks = build_loaded_chunks(hf_model)
    apply_lora(chunks, LORA, seed=7)
    adapters = full_adapters(chunks)
    chunks = [chunk.cuda() for chunk in chunks]
    reference = copy.deepcopy(hf_model)
    attach_reference_lora(reference, adapters, ALPHA / RANK)
    reference = reference.float().cuda()

    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(8).expand(2, 8).cuda()
    got = chunks[0](ids, positions, None)[..., :vocab].float()
    with torch.no_grad():
        want = reference(input_ids=ids).logits.float()
    diff = float((got - want).abs().max())
    assert diff <= 1e-4, f"max |logit diff| on the GPU: {diff:.3g}"

    got.logsumexp(-1).mean().backward()
    for name, param in chunks[0].named_parameters():
        if ".adapter." in name:
            assert param.grad is not None and bool(torch.isfinite(param.grad).all()), f"{name}: {param.grad}"
            assert float(param.grad.abs().max()) > 0, f"{name}: zero gradient"
        else:
            assert param.grad is None, f"frozen {name} got a gradient"

    exported = {n: t.cpu() for n, t in mcore_to_hf_named_tensors(chunks, hf_model.config)}
    want_merge = _reference_merge(hf_model, adapters, ALPHA / RANK)
    worst = max(float((exported[n] - want_merge[n]).abs().max()) for n in want_merge)
    assert worst <= 1e-6, f"max |merged weight diff| GPU vs CPU float64: {worst:.3g}"


def test_the_merge_product_is_the_same_bits_on_any_shard():
    """A tensor-parallel rank merges its shard (rows of B or columns of A); the model merger merges the
    whole weight. Each element must come out the same bits either way (a GEMM's rounding follows the
    matrix's shape), and equal B @ A to float64 rounding."""
    from verl.models.mcore.lora import shard_invariant_product

    gen = torch.Generator().manual_seed(0)
    b = torch.randn(96, 8, generator=gen, dtype=torch.float64)
    a = torch.randn(8, 160, generator=gen, dtype=torch.float64)
    whole = shard_invariant_product(b, a)
    torch.testing.assert_close(whole, b @ a, atol=1e-13, rtol=0)
    columns = torch.cat([shard_invariant_product(b, part) for part in a.chunk(2, dim=1)], dim=1)
    rows = torch.cat([shard_invariant_product(part, a) for part in b.chunk(4, dim=0)], dim=0)
    assert torch.equal(columns, whole) and torch.equal(rows, whole)
    assert torch.equal(shard_invariant_product(b, a[:, 3:157]), whole[:, 3:157])
    small = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64)  # by hand
    assert shard_invariant_product(small, small).tolist() == [[7.0, 0.0], [0.0, 7.0]]
