"""LoRA on the Megatron critic (`critic.model.lora.*`): adapters on the configured layers, the value
head (`score`) trained whole, every other weight frozen.

- With B = 0 (the default initialisation) the critic's values are the plain critic's, bit for bit.
- Two value updates equal a float64 reference of the same math on the HF token-classification model
  (the LoRA hooks of tests/models/mcore/test_mcore_lora.py, `score` trainable): values, losses and
  gradient norms to 1e-5; afterwards only the adapters and the head have moved, and tp=2's values,
  gradient norms and adapters equal tp=1's.
- Through the engine (`MegatronEngineWithValueHead` with `model.lora.rank > 0`, as the critic
  worker builds it): the optimizer holds only the adapters and the head; a checkpoint saved after
  one update resumes into an engine with other fresh adapters and the next update is bit for bit
  the uninterrupted run's; the model merger writes the merged value model (`W + alpha/r * B @ A`,
  `score.*`), equal to the engine's own export.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import assert_metrics_close, build_loaded_chunks
from tests.models.mcore.test_mcore_lora import attach_reference_lora, full_adapters
from tests.workers.critic.test_megatron_critic import CONFIG, LR, _hf_value_model
from verl.model_merger.__main__ import main as merger_main
from verl.protocol import DataProto
from verl.workers.critic.dp_critic import DataParallelPPOCritic

RANK, ALPHA = 4, 8
LORA = {"rank": RANK, "alpha": ALPHA}  # upstream's initialisation: A xavier, B zero
KEY = "critic.model.lora"


def _critic_data(seed: int) -> DataProto:
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    td["values"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    td["returns"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"micro_batch_size": 3})


def _is_trained(name: str) -> bool:
    return ".adapter." in name or name.startswith("output_layer.")


def _update_matches_reference(rank, world_size, tp, out_path):
    from verl.models.mcore.lora import apply_lora
    from verl.workers.critic.megatron_critic import MegatronPPOCritic

    hf_model = _hf_value_model(2)
    batches = [_critic_data(4), _critic_data(9)]
    mask = batches[0].batch["response_mask"].bool()
    chunks = build_loaded_chunks(hf_model, tp=tp, value_head=True)
    plain_values = MegatronPPOCritic(CONFIG, chunks).compute_values(copy.deepcopy(batches[0]))
    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}

    trained = apply_lora(chunks, LORA, seed=7, value_head=True, key=KEY)
    names = [n for n, p in chunks[0].named_parameters() if p.requires_grad]
    assert names == [n for n in dict(chunks[0].named_parameters()) if _is_trained(n)]
    assert "output_layer.weight" in names and "output_layer.bias" in names and len(names) == 2 * 2 * 4 + 2
    assert len(trained) == len(names)
    critic = MegatronPPOCritic(CONFIG, chunks, torch.optim.SGD(trained, lr=LR))
    assert torch.equal(critic.compute_values(copy.deepcopy(batches[0])), plain_values), "B = 0: the plain critic"

    adapters = full_adapters(chunks)
    reference_model = copy.deepcopy(hf_model).double()
    ref_params = attach_reference_lora(reference_model, adapters, ALPHA / RANK)
    reference_model.score.requires_grad_(True)  # the head trains whole
    reference = DataParallelPPOCritic(
        CONFIG, reference_model, torch.optim.SGD([p for p in reference_model.parameters() if p.requires_grad], lr=LR)
    )
    want = reference.compute_values(copy.deepcopy(batches[0]))
    torch.testing.assert_close(plain_values[mask].double(), want[mask], atol=1e-5, rtol=0)

    grad_norms = []
    for data in batches:  # the first update moves only B (A's gradient is zero while B is), the second both
        want_metrics = reference.update_critic(copy.deepcopy(data))
        got_metrics = critic.update_critic(copy.deepcopy(data))
        assert_metrics_close(got_metrics, want_metrics)
        grad_norms += got_metrics["critic/grad_norm"]
    values = critic.compute_values(copy.deepcopy(batches[0]))
    want = reference.compute_values(copy.deepcopy(batches[0]))
    torch.testing.assert_close(values[mask].double(), want[mask], atol=1e-5, rtol=0)

    after = full_adapters(chunks)
    for key, (a, b) in after.items():
        key_ = key.replace(".", "_")
        torch.testing.assert_close(a.double(), ref_params[key_ + "_A"].detach(), atol=1e-5, rtol=0, msg=f"{key} A")
        torch.testing.assert_close(b.double(), ref_params[key_ + "_B"].detach(), atol=1e-5, rtol=0, msg=f"{key} B")
        for i, which in enumerate("AB"):
            moved = float((after[key][i] - adapters[key][i]).abs().max())
            assert moved > 1e-4, f"{key} {which} should move (moved {moved:.2e})"
    head = dict(chunks[0].output_layer.named_parameters())
    for name, param in head.items():
        torch.testing.assert_close(param.double(), getattr(reference_model.score, name).detach(), atol=1e-5, rtol=0)
        assert float((param - before[f"output_layer.{name}"]).abs().max()) > 1e-4, f"the head's {name} should move"
    for name, param in chunks[0].named_parameters():
        if not _is_trained(name):
            assert torch.equal(param, before[name]), f"frozen {name} changed"
    if rank == 0:
        torch.save({"values": values, "grad_norms": grad_norms, "adapters": after}, out_path)


def test_critic_lora_starts_as_the_plain_critic_and_trains_like_the_float64_reference_at_tp1_and_tp2(tmp_path):
    run_distributed(_update_matches_reference, 1, 1, str(tmp_path / "tp1.pt"))
    run_distributed(_update_matches_reference, 2, 2, str(tmp_path / "tp2.pt"))
    tp1, tp2 = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    torch.testing.assert_close(tp2["values"], tp1["values"], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(tp2["grad_norms"]), torch.tensor(tp1["grad_norms"]), atol=0, rtol=1e-6)
    assert sorted(tp2["adapters"]) == sorted(tp1["adapters"])
    for key, pair in tp1["adapters"].items():
        for got, want in zip(tp2["adapters"][key], pair):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=key)


MEGATRON = {"tensor_model_parallel_size": 2, "seed": 7, "dtype": "float32"}
OPTIM = {"lr": 1e-2, "total_training_steps": 10, "weight_decay": 0.01}
CONTENTS = {
    "save_contents": ["model", "optimizer", "extra", "hf_model"],
    "load_contents": ["model", "optimizer", "extra"],
}
ENGINE_LORA = {**LORA, "lora_A_init_method": "kaiming", "target_modules": ["linear_qkv", "linear_fc2"]}


def _engine_resume(rank, world_size, hf_dir, ckpt_dir):
    from verl.utils.megatron.parallel_state import destroy_model_parallel
    from verl.workers.critic.megatron_critic import MegatronPPOCritic
    from verl.workers.engine import MegatronEngineWithValueHead

    MegatronEngineWithValueHead.init_parallel(MEGATRON)
    saved = f"{ckpt_dir}/global_step_1/critic"

    def build(seed):
        model_cfg = OmegaConf.create({"path": hf_dir, "lora": ENGINE_LORA})
        engine = MegatronEngineWithValueHead(model_cfg, {**MEGATRON, "seed": seed}, OPTIM, checkpoint_config=CONTENTS)
        return engine, MegatronPPOCritic(CONFIG, engine.chunks, engine.optimizer)

    def state(engine):
        return {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters() if _is_trained(n)}

    engine, critic = build(seed=1)
    trained = [n for n, p in engine.chunks[0].named_parameters() if p.requires_grad]
    assert trained == [n for n, _ in engine.chunks[0].named_parameters() if _is_trained(n)] and len(trained) == 10
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in engine.chunks[0].parameters() if p.requires_grad}
    critic.update_critic(copy.deepcopy(_critic_data(1)))
    engine.lr_scheduler.step()
    engine.checkpoint_manager.save_checkpoint(saved, global_step=1)
    exported_at_save = dict(engine.iter_hf_params())
    critic.update_critic(copy.deepcopy(_critic_data(2)))
    uninterrupted = state(engine)

    engine, critic = build(seed=2)
    fresh = state(engine)
    engine.checkpoint_manager.load_checkpoint(saved)
    loaded = state(engine)
    gap = max(float((fresh[n] - loaded[n]).abs().max()) for n in fresh if "linear_in" in n)
    assert gap > 1e-2, "the fresh adapters (another seed) should differ from the saved ones"
    critic.update_critic(copy.deepcopy(_critic_data(2)))
    for name, want in uninterrupted.items():
        assert torch.equal(state(engine)[name], want), f"{name}: {float((state(engine)[name] - want).abs().max())}"
    destroy_model_parallel()
    if rank == 0:
        torch.save(exported_at_save, f"{ckpt_dir}/exported.pt")


@pytest.mark.slow  # 18 s at load 6.6-8.7 on 2 cores (two engine builds on 2 ranks, a save, a load, the merger)
def test_critic_lora_engine_trains_adapters_and_head_resumes_exactly_and_merges(tmp_path):
    hf_model = _hf_value_model(2)
    hf_model.save_pretrained(tmp_path / "hf")
    run_distributed(_engine_resume, 2, str(tmp_path / "hf"), str(tmp_path))
    critic_dir = tmp_path / "global_step_1" / "critic"
    assert json.loads((critic_dir / "lora_config.json").read_text())["rank"] == RANK
    exported = torch.load(tmp_path / "exported.pt")
    base = hf_model.state_dict()
    assert sorted(exported) == sorted(base)
    moved = {n for n in base if not torch.equal(exported[n], base[n])}
    assert {"score.weight", "score.bias", "model.layers.0.self_attn.q_proj.weight"} <= moved
    assert not any(n.endswith(("o_proj.weight", "gate_proj.weight", "norm.weight")) for n in moved), moved
    saved_hf = load_file(critic_dir / "huggingface" / "model.safetensors")
    assert sorted(saved_hf) == sorted(exported) and all(torch.equal(saved_hf[n], t) for n, t in exported.items())

    target = tmp_path / "merged"
    merger_main(["merge", "--backend", "megatron", "--local_dir", str(critic_dir), "--target_dir", str(target)])
    merged = load_file(target / "model.safetensors")
    assert sorted(merged) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(merged[name], tensor), name
    assert json.loads((target / "config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]
