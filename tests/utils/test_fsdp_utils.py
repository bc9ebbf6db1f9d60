"""FSDP2 helpers: sharding layout, mixed precision choice, full-parameter streaming, grad clipping."""

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, make_tiny_causal_lm, one_thread, run_distributed
from verl.utils import fsdp_utils

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def test_wrap_modules_are_the_decoder_layers_plus_untied_embeddings():
    tied = make_tiny_causal_lm(tie_word_embeddings=True)
    assert fsdp_utils.get_fsdp_wrap_modules(tied) == list(tied.model.layers)
    untied = make_tiny_causal_lm(tie_word_embeddings=False)
    assert fsdp_utils.get_fsdp_wrap_modules(untied) == [untied.model.embed_tokens, *untied.model.layers]
    with pytest.raises(ValueError, match="transformer_layer_cls_to_wrap"):
        fsdp_utils.get_fsdp_wrap_modules(tied, {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


def test_mixed_precision_is_bf16_with_fp32_reduce_on_cuda_and_no_cast_on_cpu(monkeypatch):
    cpu = fsdp_utils.get_mixed_precision_policy()
    assert (cpu.param_dtype, cpu.reduce_dtype) == (None, None)
    monkeypatch.setattr(fsdp_utils, "is_cuda_available", lambda: True)
    gpu = fsdp_utils.get_mixed_precision_policy()
    assert (gpu.param_dtype, gpu.reduce_dtype) == (torch.bfloat16, torch.float32)
    custom = fsdp_utils.get_mixed_precision_policy({"param_dtype": "fp32", "reduce_dtype": "fp32"})
    assert custom.param_dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        fsdp_utils.to_torch_dtype("fp8")


def _two_rank_fsdp_utils(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from verl.utils.seqlen_balancing import rearrange_micro_batches

    for tie in (True, False):
        reference = make_tiny_causal_lm(tie_word_embeddings=tie)
        model = fsdp_utils.apply_fsdp2(make_tiny_causal_lm(tie_word_embeddings=tie))
        assert all(isinstance(p, DTensor) for p in model.parameters())
        local = sum(p.to_local().numel() for p in model.parameters())
        assert local < sum(p.numel() for p in reference.parameters()), "parameters must be sharded"

        # streaming full parameters gives exactly the HF state dict, in its order
        streamed = list(fsdp_utils.iter_full_params(model))
        expected = reference.state_dict()
        assert [name for name, _ in streamed] == list(expected)
        for name, tensor in streamed:
            assert not isinstance(tensor, DTensor) and torch.equal(tensor, expected[name]), name
        assert all(t.dtype == torch.float32 for _, t in fsdp_utils.iter_full_params(model, dtype=torch.float32))
        full = fsdp_utils.get_full_state_dict(model)
        if rank == 0:
            assert full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in expected)
        else:
            assert full == {}

    # gradient norm and clipping over shards equal the unsharded model's
    batch = make_ppo_batch(batch_size=4, seed=rank)
    all_ids = [torch.zeros_like(batch["input_ids"]) for _ in range(world_size)]
    dist.all_gather(all_ids, batch["input_ids"])
    model(input_ids=batch["input_ids"], use_cache=False).logits.square().mean().backward()
    reference_loss = sum(reference(input_ids=ids, use_cache=False).logits.square().mean() for ids in all_ids)
    (reference_loss / world_size).backward()
    norm = fsdp_utils.fsdp2_clip_grad_norm_(model.parameters(), max_norm=0.5)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    assert not isinstance(norm, DTensor)
    torch.testing.assert_close(norm, expected_norm, atol=1e-12, rtol=1e-10)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, atol=1e-12, rtol=1e-10, msg=name)

    # FSDP2's own CPU offload (offload_policy) gives the same gradients
    offloaded = fsdp_utils.apply_fsdp2(make_tiny_causal_lm(tie_word_embeddings=False), {"offload_policy": True})
    offloaded(input_ids=batch["input_ids"], use_cache=False).logits.square().mean().backward()
    offloaded_norm = fsdp_utils.fsdp2_clip_grad_norm_(offloaded.parameters(), max_norm=0.5)
    torch.testing.assert_close(offloaded_norm, expected_norm, atol=1e-12, rtol=1e-10)

    # hybrid-engine offload and load-back keep parameters and optimizer state intact
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    moments = [s["exp_avg"].to_local().clone() for s in optimizer.state.values()]
    fsdp_utils.offload_fsdp_model_to_cpu(model)
    fsdp_utils.offload_fsdp_optimizer(optimizer)
    assert all(p.device.type == "cpu" for p in model.parameters())
    fsdp_utils.load_fsdp_model_to_device(model)
    fsdp_utils.load_fsdp_optimizer(optimizer)
    assert all(torch.equal(p.detach().to_local(), params[n]) for n, p in model.named_parameters())
    assert all(torch.equal(s["exp_avg"].to_local(), m) for s, m in zip(optimizer.state.values(), moments))
    optimizer.step()

    # token-budget micro-batches: the rank with short sequences follows the rank with long ones
    lengths = [[12, 12, 12, 12], [2, 2, 2, 2]][rank]
    mask = (torch.arange(12)[None] < torch.tensor(lengths)[:, None]).long()
    from tensordict import TensorDict

    micro_batches, _ = rearrange_micro_batches(TensorDict({"attention_mask": mask}, batch_size=[4]), 24)
    assert len(micro_batches) == 2


def test_fsdp2_utilities_on_two_ranks():
    run_distributed(_two_rank_fsdp_utils, 2)


def test_clip_grad_norm_reports_a_nonfinite_norm_instead_of_raising():
    model = make_tiny_causal_lm()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    next(model.parameters()).grad[0, 0] = float("inf")
    norm = fsdp_utils.fsdp2_clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert not torch.isfinite(norm)


class _GatherLog:
    """Records the dtype and bytes of every all-gather run while active (a dispatch mode: it sees
    the functional collectives that `DTensor.full_tensor` issues on the local shards)."""

    def __init__(self):
        self.gathers: list[tuple[torch.dtype, int]] = []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self.gathers

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "all_gather" in func.name():
                    log.append((args[0].dtype, args[0].numel() * args[0].element_size()))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _two_rank_cast_before_gather(rank, world_size):
    reference = make_tiny_causal_lm(dtype=torch.float32)
    model = fsdp_utils.apply_fsdp2(make_tiny_causal_lm(dtype=torch.float32))
    with _GatherLog() as fp32:
        full_fp32 = dict(fsdp_utils.iter_full_params(model))
    with _GatherLog() as bf16:
        full_bf16 = dict(fsdp_utils.iter_full_params(model, dtype=torch.bfloat16))
    # every tensor is gathered, once; the shards travel in bf16: half of fp32's bytes
    assert len(fp32.gathers) == len(bf16.gathers) == len(full_fp32)
    assert {dtype for dtype, _ in fp32.gathers} == {torch.float32}
    assert {dtype for dtype, _ in bf16.gathers} == {torch.bfloat16}
    assert 2 * sum(n for _, n in bf16.gathers) == sum(n for _, n in fp32.gathers)
    # casting shards then gathering gives the bits of gathering then casting
    for name, expected in reference.state_dict().items():
        assert full_bf16[name].dtype == torch.bfloat16
        assert torch.equal(full_bf16[name], expected.to(torch.bfloat16)), name
        assert torch.equal(full_fp32[name], expected), name


def test_weight_sync_gathers_shards_already_cast_to_the_rollout_dtype():
    run_distributed(_two_rank_cast_before_gather, 2)


def test_upstreams_fsdp1_wrap_policy_picks_decoder_layers_sizes_or_trainable_leaves():
    model = make_tiny_causal_lm()
    layer_cls = type(model.model.layers[0])

    def wraps(policy, module):  # torch's FSDP1 policy protocol: asked per module, recurse=False means "wrap it?"
        return policy(module=module, recurse=False, nonwrapped_numel=sum(p.numel() for p in module.parameters()))

    by_class = fsdp_utils.get_fsdp_wrap_policy(model)  # `_no_split_modules` of Qwen2: the decoder layer
    wrapped = [m for m in model.modules() if wraps(by_class, m)]
    assert wrapped == list(model.model.layers) and all(type(m) is layer_cls for m in wrapped)

    layer_numel = sum(p.numel() for p in model.model.layers[0].parameters())
    by_size = fsdp_utils.get_fsdp_wrap_policy(model, {"min_num_params": layer_numel})
    assert wraps(by_size, model.model.layers[0]) and not wraps(by_size, model.model.layers[0].mlp.up_proj)

    for p in model.parameters():
        p.requires_grad_(False)
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(True)
    lora = fsdp_utils.get_fsdp_wrap_policy(model, {"transformer_layer_cls_to_wrap": [layer_cls.__name__]}, is_lora=True)
    assert wraps(lora, model.model.layers[1].mlp.up_proj) and not wraps(lora, model.model.layers[0].mlp.up_proj)
    assert wraps(lora, model.model.layers[0])  # the layer policy still applies

    assert fsdp_utils.get_fsdp_wrap_policy(model, {"disable": True}) is None
    with pytest.raises(ValueError, match="NoSuchLayer"):
        fsdp_utils.get_fsdp_wrap_policy(model, {"transformer_layer_cls_to_wrap": ["NoSuchLayer"]})
    assert fsdp_utils.MixedPrecisionPolicy is torch.distributed.fsdp.MixedPrecisionPolicy
