"""Multi-token prediction (`actor_rollout_ref.model.mtp`) on the megatron actor.

The model: a tiny Qwen2 checkpoint (perturbed weights, untied head) plus one MTP layer in MiMo's HF
layout (`model.mtp_layers.0.*`, in a safetensors file of its own that transformers' Qwen2 model
ignores). The reference is written here in float64 from the HF modules: the HF model's final
(normed) hidden state at column t and the embedding of token t + 1, each normed, projected by
`input_proj` over [hidden; embedding], one HF Qwen2 decoder layer (causal, RoPE positions 0, 1, ...),
the final norm and the LM head, whose cross-entropy against token t + 2 is averaged over the response
tokens. The megatron actor's logged `mtp_losses/mtp_1_loss` must equal it; the scaling factor must
scale the MTP part of every gradient exactly; `detach_encoder` must leave the decoder's and the
embedding's gradients exactly the ones without MTP; data-parallel ranks must weigh it as micro-batches do;
at pp=2 (MTP layer and an embedding copy on the last stage) and cp=2 (the MTP inputs rolled across
ranks) the update must equal the one-rank update, and a pp=2 dist checkpoint must restore every stage.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import hf_state_dict, setup_megatron, tiny_hf_model
from verl.protocol import DataProto

TEMPERATURE = 0.7
ROWS = 4


def add_mtp_layer(path, config, seed: int = 0) -> None:
    """Give the HF checkpoint at `path` (config `config`) one MiMo-layout MTP layer with random weights:
    `num_nextn_predict_layers: 1` in its config.json and the tensors in `mtp.safetensors`."""
    import json

    from safetensors.torch import save_file
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    g = torch.Generator().manual_seed(seed + 5)
    hidden = config.hidden_size
    tensors = {}
    for name, tensor in Qwen2DecoderLayer(config, layer_idx=0).state_dict().items():
        base = torch.ones_like(tensor) if name.endswith("layernorm.weight") else torch.zeros_like(tensor)
        tensors[f"model.mtp_layers.0.{name}"] = base + 0.05 * torch.randn(tensor.shape, generator=g)
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        tensors[f"model.mtp_layers.0.{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    tensors["model.mtp_layers.0.input_proj.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=g)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**saved, "num_nextn_predict_layers": 1}, indent=2))


def _write_mtp_model(path, seed: int = 0, tied: bool = False):
    """A tiny Qwen2 checkpoint with one MiMo-layout MTP layer at `path`; returns the HF model."""
    model = tiny_hf_model("qwen2", tie_word_embeddings=tied, seed=seed)
    model.save_pretrained(path)
    add_mtp_layer(path, model.config, seed)
    model.config.num_nextn_predict_layers = 1
    return model


def _batch() -> DataProto:
    # rows of different prompt and response lengths (one prompt of a single token, whose first
    # response token no MTP column predicts), so padding and the target mask both matter
    td = make_ppo_batch(ROWS, prompt_length=5, response_length=4, seed=3, prompt_lengths=[5, 1, 3, 2],
                        response_lengths=[4, 2, 3, 4])  # fmt: skip
    g = torch.Generator().manual_seed(4)
    td["advantages"] = torch.randn(td["response_mask"].shape, generator=g) * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": TEMPERATURE})


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_mtp_loss(path, data: DataProto) -> float:
    """The mean MTP cross-entropy over every response token the MTP layer predicts, in float64."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    mtp = {k[len("model.mtp_layers.0.") :]: v.double() for k, v in load_file(str(path / "mtp.safetensors")).items()}
    layer = Qwen2DecoderLayer(hf.config, layer_idx=0).double().eval()
    layer.load_state_dict({k: v for k, v in mtp.items() if k.split(".")[0] in ("self_attn", "mlp")
                           or k in ("input_layernorm.weight", "post_attention_layernorm.weight")})  # fmt: skip
    eps = hf.config.rms_norm_eps
    batch = data.batch
    response_length = batch["responses"].shape[1]
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(ROWS):
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()]
            num_prompt = len(ids) - int(batch["response_mask"][row].sum())
            hidden = hf.model(ids[None]).last_hidden_state[0]  # after the final norm
            embeds = hf.model.embed_tokens(ids)
            x = torch.cat([_rms(hidden[:-1], mtp["hidden_layernorm.weight"], eps),
                           _rms(embeds[1:], mtp["token_layernorm.weight"], eps)], dim=-1) @ mtp["input_proj.weight"].T  # fmt: skip
            length = x.shape[0]
            positions = torch.arange(length)[None]
            causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            out = layer(x[None], attention_mask=causal, position_ids=positions,
                        position_embeddings=hf.model.rotary_emb(x[None], positions))  # fmt: skip
            out = out[0] if isinstance(out, tuple) else out
            logits = hf.lm_head(_rms(out[0], mtp["final_layernorm.weight"], eps))
            log_probs = torch.log_softmax(logits, dim=-1)
            for j in range(response_length):
                target = num_prompt + j  # index of response token j in `ids`
                if batch["response_mask"][row, j] and target - 2 >= 0:
                    total -= float(log_probs[target - 2, ids[target]])
                    count += 1
    return total / count


class _GradientRecorder(torch.optim.SGD):
    """SGD with lr 0 that keeps the gradients of each step (the actor zeroes them after the update)."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.gradients: list[torch.Tensor] = []

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        self.gradients = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        return super().step(closure)


def _actor(
    path,
    hf_model,
    enable_train=True,
    factor=0.1,
    detach=False,
    tp=1,
    sequence_parallel=False,
    mini=ROWS,
    micro=ROWS,
    pp=1,
    cp=1,
):
    """The megatron actor on the MTP model at `path`, loaded as the engine loads it, with no clipping
    and an optimizer that records the gradients without stepping."""
    from verl.models.mcore import build_model_chunks, hf_to_mcore_config, load_hf_state_dict
    from verl.models.mcore.mtp import configure_mtp
    from verl.models.mcore.mtp_weights import load_mtp_state_dict
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_config = hf_model.config
    setup_megatron(tp, pp, cp=cp)
    layout = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "sequence_parallel": sequence_parallel,
    }
    tf_config = hf_to_mcore_config(hf_config, layout, torch.float32)
    tf_config.mtp_num_layers = 1  # as the engine asks for them with model.mtp.enable
    chunks = build_model_chunks(hf_config, tf_config)
    state = hf_state_dict(hf_model)
    load_hf_state_dict(chunks, state, hf_config)
    load_mtp_state_dict(chunks, str(path), state, hf_config)
    configure_mtp(chunks, enable_train, factor, detach)
    config = {
        "ppo_mini_batch_size": mini,
        "ppo_micro_batch_size_per_gpu": micro,
        "ppo_epochs": 1,
        "clip_ratio": 0.2,
        "optim": {"clip_grad": 1e9},
        "loss_agg_mode": "token-mean",
        "policy_loss": {"loss_mode": "vanilla"},
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
    }
    params = [p for chunk in chunks for p in chunk.parameters()]
    return MegatronPPOActor(config, chunks, hf_config, _GradientRecorder(params))


def _update(actor, data: DataProto) -> tuple[dict, dict]:
    """(metrics, {parameter name: its gradient}) of one update on `data`."""
    (chunk,) = actor.model_chunks
    metrics = actor.update_policy(data)
    names = {id(p): name for name, p in chunk.named_parameters()}
    params = [p for group in actor.actor_optimizer.param_groups for p in group["params"]]
    return metrics, {names[id(p)]: g for p, g in zip(params, actor.actor_optimizer.gradients)}


def _mtp_loss_is_the_float64_reference(rank, world_size, path, sequence_parallel=False):
    if rank == 0:
        _write_mtp_model(path)
    torch.distributed.barrier()
    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=False)
    hf_model.config.num_nextn_predict_layers = 1
    data = _batch()
    metrics, _ = _update(_actor(path, hf_model, tp=world_size, sequence_parallel=sequence_parallel), data)
    got = metrics["mtp_losses/mtp_1_loss"]
    assert len(got) == 1
    want = _reference_mtp_loss(path, data)
    assert abs(got[0] - want) < 1e-5 * max(1.0, abs(want)), (got, want)


# tp=2: eh_proj's rows, the MTP layer's attention and MLP and the (padded) vocabulary are split;
# with sequence parallelism each tensor rank also holds half of the columns outside them
@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_mtp_loss_equals_a_float64_reference(tmp_path, tp, sequence_parallel):
    run_distributed(_mtp_loss_is_the_float64_reference, tp, tmp_path, sequence_parallel)


def _scaling_and_detach(rank, world_size, path):
    hf_model = _write_mtp_model(path)
    data = _batch()
    off_metrics, off = _update(_actor(path, hf_model, enable_train=False), data)
    assert not any(k.startswith("mtp_losses/") for k in off_metrics)
    assert all(float(d.abs().max()) == 0.0 for n, d in off.items() if n.startswith("mtp."))
    small_metrics, small = _update(_actor(path, hf_model, factor=0.1), data)
    _, large = _update(_actor(path, hf_model, factor=0.4), data)
    # the policy loss is the same function of the same weights with and without the MTP term
    assert small_metrics["actor/pg_loss"] == off_metrics["actor/pg_loss"]
    for name in off:
        # every parameter's gradient is the policy's plus the factor times the MTP loss's gradient
        scale = float(large[name].abs().max())
        torch.testing.assert_close(large[name] - off[name], 4 * (small[name] - off[name]), atol=1e-5 * scale, rtol=0)
    moved = [n for n in off if float((small[n] - off[n]).abs().max()) > 1e-6]
    assert any(n.startswith("mtp.layers.0.transformer_layer.") for n in moved)
    assert any(n.startswith("decoder.layers.") for n in moved), "without detach the MTP loss trains the trunk"
    assert "embedding.word_embeddings.weight" in moved
    _, detached = _update(_actor(path, hf_model, factor=0.4, detach=True), data)
    for name in off:
        if name.startswith(("decoder.", "embedding.")):
            torch.testing.assert_close(detached[name], off[name], atol=0, rtol=0, msg=name)
    # the MTP layers and the shared LM head still learn from the MTP loss
    for name in ("output_layer.weight", "mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight"):
        assert float((detached[name] - off[name]).abs().max()) > 1e-6, name
    torch.testing.assert_close(detached["mtp.layers.0.eh_proj.weight"], large["mtp.layers.0.eh_proj.weight"])


def test_the_scaling_factor_scales_the_mtp_gradient_and_detach_encoder_keeps_the_trunk_update(tmp_path):
    run_distributed(_scaling_and_detach, 1, tmp_path)


def test_mtp_enable_needs_a_qwen2_model_with_mtp_layers():
    from types import SimpleNamespace

    from transformers import LlamaConfig, Qwen2Config

    from verl.workers.config import MtpConfig
    from verl.workers.engine.megatron.transformer_impl import _mtp_section

    on = SimpleNamespace(mtp=MtpConfig(enable=True, enable_train=True), path="/models/plain")
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        _mtp_section(on, Qwen2Config(), trained_policy=True)
    with pytest.raises(NotImplementedError, match="on a llama model: the megatron backend builds the MTP layers"):
        _mtp_section(on, LlamaConfig(num_nextn_predict_layers=1), trained_policy=True)
    # the reference (not trained) is built without the MTP layers
    assert _mtp_section(on, Qwen2Config(num_nextn_predict_layers=1), trained_policy=False) is None
    assert _mtp_section(on, Qwen2Config(num_nextn_predict_layers=1), trained_policy=True) is on.mtp


def _checkpoint_mtp_weights_are_ignored_unless_asked_for(rank, world_size, path):
    """A checkpoint with MTP weights builds and loads as the plain model when MTP is not asked for."""
    from verl.models.mcore import build_model_chunks, hf_to_mcore_config, load_hf_state_dict

    hf_model = _write_mtp_model(path)
    setup_megatron()
    (chunk,) = build_model_chunks(hf_model.config, hf_to_mcore_config(hf_model.config, {}, torch.float32))
    assert getattr(chunk, "mtp", None) is None
    load_hf_state_dict([chunk], hf_state_dict(hf_model), hf_model.config)


def test_a_checkpoints_mtp_weights_are_ignored_unless_mtp_is_enabled(tmp_path):
    run_distributed(_checkpoint_mtp_weights_are_ignored_unless_asked_for, 1, tmp_path)


def _engine_builds_the_policy_with_mtp_and_the_reference_without(rank, world_size, path):
    from verl.models.mcore.mtp import find_mtp_training
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    _write_mtp_model(path)
    model_config = {"path": str(path), "mtp": {"enable": True, "enable_train": True, "mtp_loss_scaling_factor": 0.3}}
    setup_megatron()
    policy = MegatronEngineWithLMHead(model_config, {}, optimizer_config={"lr": 1e-3})
    (chunk,) = policy.chunks
    state = find_mtp_training(policy.chunks)
    assert state is not None and state.scaling_factor == 0.3 and not state.detach_encoder
    # the MTP layer holds the checkpoint's tensors (MiMo's input_proj, its halves swapped)
    from safetensors.torch import load_file

    hf = load_file(str(path / "mtp.safetensors"))
    hidden_half, embedding_half = hf["model.mtp_layers.0.input_proj.weight"].chunk(2, dim=1)
    assert torch.equal(chunk.mtp.layers[0].eh_proj.weight.detach().cpu(), torch.cat([embedding_half, hidden_half], 1))
    assert torch.equal(chunk.mtp.layers[0].enorm.weight.detach().cpu(), hf["model.mtp_layers.0.token_layernorm.weight"])
    reference = MegatronEngineWithLMHead(model_config, {})
    assert getattr(reference.chunks[0], "mtp", None) is None


def test_the_engine_loads_the_policys_mtp_layers_and_builds_the_reference_without(tmp_path):
    run_distributed(_engine_builds_the_policy_with_mtp_and_the_reference_without, 1, tmp_path)


def _mtp_layers_round_trip_a_dist_checkpoint(rank, world_size, path):
    from megatron.core import dist_checkpointing

    from verl.models.mcore import build_model_chunks, hf_to_mcore_config
    from verl.utils.checkpoint.megatron_checkpoint_manager import load_dist_checkpoint_weights

    hf_model = _write_mtp_model(path / "hf")
    trained = _actor(path / "hf", hf_model).model_chunks
    (path / "ckpt").mkdir()
    dist_checkpointing.save(trained[0].sharded_state_dict(), str(path / "ckpt"))
    tf_config = hf_to_mcore_config(hf_model.config, {}, torch.float32)
    tf_config.mtp_num_layers = 1
    fresh = build_model_chunks(hf_model.config, tf_config)
    assert not torch.equal(fresh[0].mtp.layers[0].eh_proj.weight, trained[0].mtp.layers[0].eh_proj.weight)
    load_dist_checkpoint_weights(fresh, str(path / "ckpt"))
    want = dict(trained[0].named_parameters())
    names = [name for name, _ in fresh[0].named_parameters()]
    assert sum(name.startswith("mtp.") for name in names) > 5
    for name, param in fresh[0].named_parameters():
        assert torch.equal(param, want[name]), name


def test_the_mtp_layers_are_kept_in_megatron_checkpoints(tmp_path):
    run_distributed(_mtp_layers_round_trip_a_dist_checkpoint, 1, tmp_path)


def _data_parallel_update(rank, world_size, path):
    """One update on the batch: at dp=1 in two micro-batches, at dp=2 half of it per rank."""
    if rank == 0:
        _write_mtp_model(path)
    torch.distributed.barrier()
    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=False)
    hf_model.config.num_nextn_predict_layers = 1
    data = _batch()
    if world_size > 1:
        data = data.select_idxs(torch.tensor([0, 1] if rank == 0 else [2, 3]))
    actor = _actor(path, hf_model, mini=ROWS // world_size, micro=ROWS // 2)
    metrics, gradients = _update(actor, data)
    if rank == 0:
        torch.save({"metrics": metrics, "gradients": gradients}, path / "result.pt")


def test_data_parallel_ranks_weigh_the_mtp_loss_as_micro_batches_do(tmp_path):
    """Upstream's weighting: each micro-batch's MTP mean counts 1 / (micro-batches), and data-parallel
    ranks are averaged; so dp=2 with a micro-batch per rank equals dp=1 with the same two micro-batches."""
    (tmp_path / "dp1").mkdir()
    (tmp_path / "dp2").mkdir()
    run_distributed(_data_parallel_update, 1, tmp_path / "dp1")
    run_distributed(_data_parallel_update, 2, tmp_path / "dp2")
    one, two = (torch.load(tmp_path / d / "result.pt") for d in ("dp1", "dp2"))
    assert len(one["metrics"]["mtp_losses/mtp_1_loss"]) == 2
    assert abs(one["metrics"]["mtp_losses/mtp_1_loss"][0] - two["metrics"]["mtp_losses/mtp_1_loss"][0]) < 1e-6
    for name, gradient in one["gradients"].items():
        scale = float(gradient.abs().max())
        torch.testing.assert_close(two["gradients"][name], gradient, atol=1e-5 * scale, rtol=0, msg=name)


def _parallel_update(rank, world_size, path, detach, pp, cp, tied=False):
    """One update at pipeline size `pp` and context size `cp`: the metrics, and every gradient under
    its pp=1 name (decoder layers renumbered globally; each stage's copy of the embedding kept apart)."""
    from megatron.core import parallel_state as mpu

    if rank == 0:
        _write_mtp_model(path, tied=tied)
    torch.distributed.barrier()
    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=tied)
    hf_model.config.num_nextn_predict_layers = 1
    actor = _actor(path, hf_model, detach=detach, pp=pp, cp=cp, micro=ROWS // 2)
    metrics, gradients = _update(actor, _batch())
    stage = mpu.get_pipeline_model_parallel_rank()
    offset = stage * (2 // pp)
    named = {}
    for name, gradient in gradients.items():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers.") :].split(".", 1)
            name = f"decoder.layers.{int(index) + offset}.{rest}"
        named[name] = gradient
    (chunk,) = actor.model_chunks
    embedding = chunk.embedding.word_embeddings.weight if hasattr(chunk, "embedding") else None
    if mpu.get_context_parallel_rank() == 0:
        torch.save(
            {"metrics": metrics, "gradients": named, "embedding": None if embedding is None else embedding.detach()},
            path / f"stage{stage}.pt",
        )


def _run_layout(tmp_path, name, detach, pp=1, cp=1, tied=False):
    (tmp_path / name).mkdir()
    run_distributed(_parallel_update, pp * cp, tmp_path / name, detach, pp, cp, tied)
    return [torch.load(tmp_path / name / f"stage{s}.pt") for s in range(pp)]


def _assert_same_update(one, first, last):
    for key in ("mtp_losses/mtp_1_loss", "actor/pg_loss"):
        assert len(one["metrics"][key]) == len(last["metrics"][key]) > 0, key
        for want, got in zip(one["metrics"][key], last["metrics"][key], strict=True):
            assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (key, got, want)
    assert first["metrics"]["actor/grad_norm"] == pytest.approx(one["metrics"]["actor/grad_norm"], rel=1e-5)
    split = {**first["gradients"], **last["gradients"]}
    assert sorted(split) == sorted(one["gradients"])
    for name, gradient in one["gradients"].items():
        scale = max(float(gradient.abs().max()), 1e-12)
        torch.testing.assert_close(split[name], gradient, atol=1e-5 * scale, rtol=0, msg=name)
    assert float(one["gradients"]["mtp.layers.0.eh_proj.weight"].abs().max()) > 0


# pp=2: the decoder's two layers on two stages, the MTP layer and a copy of the embedding on the last
# (megatron's placement); the copies' gradients are summed over the embedding group. With tied
# embeddings the last stage's copy is also its LM head.
@pytest.mark.parametrize("detach,tied", [(False, False), (True, False), (False, True)])
def test_pipeline_parallel_mtp_update_equals_pp1(tmp_path, detach, tied):
    (one,) = _run_layout(tmp_path, "pp1", detach, tied=tied)
    first, last = _run_layout(tmp_path, "pp2", detach, pp=2, tied=tied)
    _assert_same_update(one, first, last)
    # both stages start from the same embedding, and get the same (summed) gradient for it
    torch.testing.assert_close(last["embedding"], first["embedding"], atol=0, rtol=0)
    for stage in (first, last):
        torch.testing.assert_close(
            stage["gradients"]["embedding.word_embeddings.weight"], one["gradients"]["embedding.word_embeddings.weight"]
        )


# cp=2: each rank runs half of every sequence's columns; megatron rolls the MTP inputs across the two
# ranks (the token after a rank's last column lives on the other), the loss gathers the log-probs
@pytest.mark.parametrize("detach", [False, True])
def test_context_parallel_mtp_update_equals_cp1(tmp_path, detach):
    (one,) = _run_layout(tmp_path, "cp1", detach)
    (two,) = _run_layout(tmp_path, "cp2", detach, cp=2)
    _assert_same_update(one, two, two)


# the mimo example's actor layout but tp: pp=2 x cp=2 on four ranks
@pytest.mark.slow
def test_pipeline_and_context_parallel_mtp_update_equals_one_rank(tmp_path):
    (one,) = _run_layout(tmp_path, "one", False)
    first, last = _run_layout(tmp_path, "pp2cp2", False, pp=2, cp=2)
    _assert_same_update(one, first, last)


def _pipeline_dist_checkpoint_round_trip(rank, world_size, path, tied):
    from megatron.core import dist_checkpointing

    from verl.models.mcore import build_model_chunks, hf_to_mcore_config
    from verl.utils.checkpoint.megatron_checkpoint_manager import _model_sharded_state, load_dist_checkpoint_weights

    if rank == 0:
        _write_mtp_model(path / "hf", tied=tied)
    torch.distributed.barrier()
    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=tied)
    hf_model.config.num_nextn_predict_layers = 1
    trained = _actor(path / "hf", hf_model, pp=world_size).model_chunks
    if rank == 0:
        (path / "ckpt").mkdir()
    torch.distributed.barrier()
    dist_checkpointing.save(_model_sharded_state(trained), str(path / "ckpt"))
    tf_config = hf_to_mcore_config(hf_model.config, {"pipeline_model_parallel_size": world_size}, torch.float32)
    tf_config.mtp_num_layers = 1
    fresh = build_model_chunks(hf_model.config, tf_config)
    load_dist_checkpoint_weights(fresh, str(path / "ckpt"))
    want = dict(trained[0].named_parameters())
    names = [name for name, _ in fresh[0].named_parameters()]
    if rank == world_size - 1:  # the last stage: the MTP layer and its copy of the embedding
        assert sum(name.startswith("mtp.") for name in names) > 5
        assert "embedding.word_embeddings.weight" in names
    else:
        assert not any(name.startswith("mtp.") for name in names)
    for name, param in fresh[0].named_parameters():
        assert torch.equal(param, want[name]), name


@pytest.mark.slow  # ~9 s: two ranks save and load a dist checkpoint
@pytest.mark.parametrize("tied", [False, True])
def test_the_mtp_layers_and_the_last_stage_s_embedding_round_trip_a_dist_checkpoint_at_pp2(tmp_path, tied):
    run_distributed(_pipeline_dist_checkpoint_round_trip, 2, tmp_path, tied)
