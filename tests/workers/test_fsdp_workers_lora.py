"""LoRA on the actor: `ActorRolloutRefWorker` with `model.lora_rank > 0`, or starting from a trained
adapter (`model.lora_adapter_path`), on 2 gloo ranks (FSDP2 and the built-in rollout engine, the
bundled tiny model), called directly without Ray.

References are computed another way, in the rank's own process: the base model loaded afresh,
and a single-process peft model holding the gathered adapters, merged by peft itself
(`merge_and_unload`), run one sequence at a time without padding or KV cache.
"""

from __future__ import annotations

import os

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.distributed_helpers import make_ppo_batch, one_thread, reference_response_log_probs, run_distributed
from verl.model_merger.__main__ import main as model_merger
from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.trainer.config import load_ppo_config
from verl.utils.fsdp_utils import iter_full_params
from verl.utils.lora import apply_lora
from verl.utils.model import load_causal_lm
from verl.workers.fsdp_workers import ActorRolloutRefWorker

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

RESPONSE_LENGTH = 6


def _config(lora=("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16")):
    return load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            *lora,
            "actor_rollout_ref.actor.optim.lr=0.05",  # one step must move the adapters visibly
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            "algorithm.adv_estimator=reinforce_plus_plus",  # no groups: one sample per prompt
            "data.train_batch_size=8",
            f"data.max_response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.rollout.calculate_log_probs=True",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "trainer.n_gpus_per_node=2",
        ],
        config_name="arith_demo",
    )


@torch.no_grad()
def _greedy_prompts(data):
    """The prompts of a generated batch as a greedy generation request, and their attention mask."""
    prompt_length = data.batch["prompts"].shape[1]
    prompt_mask = data.batch["attention_mask"][:, :prompt_length]
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": data.batch["prompts"],
            "attention_mask": prompt_mask,
            "position_ids": data.batch["position_ids"][:, :prompt_length],
        },
        meta_info={"do_sample": False, "eos_token_id": None, "pad_token_id": 0},
    )
    return prompts, prompt_mask


def _greedy(model, prompts: torch.Tensor, prompt_mask: torch.Tensor, steps: int):
    """Greedy tokens and their log-probs, each row alone, no padding and no KV cache."""
    tokens, log_probs = [], []
    for row, mask in zip(prompts, prompt_mask.bool(), strict=True):
        ids = row[mask]
        for _ in range(steps):
            logp = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0, -1].double(), -1)
            nxt = logp.argmax()
            tokens.append(nxt)
            log_probs.append(logp[nxt])
            ids = torch.cat([ids, nxt[None]])
    return torch.stack(tokens).view(len(prompts), steps), torch.stack(log_probs).view(len(prompts), steps)


def _lora_worker(rank, world_size, out_dir):
    cfg = _config()
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    worker.init_model()
    module = worker.actor_model.module

    # only the adapters train, and the optimizer holds exactly them; no second model for the reference
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for group in worker.actor_model.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in module.parameters() if p.requires_grad}
    assert worker.ref_model is worker.actor_model

    td = make_ppo_batch(batch_size=8, seed=0, response_length=RESPONSE_LENGTH)
    data = DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": 1.0}).chunk(world_size)[rank]
    before = {n: t.clone() for n, t in iter_full_params(module)}
    data.batch["old_log_probs"] = worker.compute_log_prob(data).batch["old_log_probs"]
    sign = torch.tensor([1.0, -1.0] * (len(data) // 2))
    data.batch["advantages"] = sign[:, None] * data.batch["response_mask"]
    worker.update_actor(data)
    after = {n: t.clone() for n, t in iter_full_params(module)}

    # base weights bitwise unchanged; the adapters moved
    assert before.keys() == after.keys()
    for name in before:
        if ".lora_" not in name:
            assert torch.equal(before[name], after[name]), f"{name} changed although only the adapters train"
    lora_b = [n for n in after if ".lora_B." in n]
    assert lora_b and all(not torch.equal(before[n], after[n]) for n in lora_b)

    # reference log-probs = the base model's; the actor's (adapters back on) = the peft model's
    mask = data.batch["response_mask"]  # the references hold 0 at response padding
    ref_log_prob = worker.compute_ref_log_prob(data).batch["ref_log_prob"] * mask
    base = load_causal_lm(bundled_model_path()).eval()
    expected_ref, _ = reference_response_log_probs(base, data.batch)
    torch.testing.assert_close(ref_log_prob.double(), expected_ref, rtol=0, atol=2e-5)
    actor_log_prob = worker.compute_log_prob(data).batch["old_log_probs"] * mask
    peft_reference = apply_lora(load_causal_lm(bundled_model_path()), cfg.actor_rollout_ref.model)
    peft_reference.load_state_dict(after)
    peft_reference.eval()
    expected_actor, _ = reference_response_log_probs(peft_reference, data.batch)
    torch.testing.assert_close(actor_log_prob.double(), expected_actor, rtol=0, atol=2e-5)
    assert (actor_log_prob - ref_log_prob).abs().max() > 1e-2, "the update did not move the policy off the base"
    merged_reference = peft_reference.merge_and_unload()

    # the engine, fed the merged weights, decodes greedily what the peft model decodes
    prompts, prompt_mask = _greedy_prompts(data)
    out = worker.generate_sequences(prompts)
    expected_tokens, expected_log_probs = _greedy(merged_reference, data.batch["prompts"], prompt_mask, RESPONSE_LENGTH)
    torch.testing.assert_close(out.batch["responses"], expected_tokens, rtol=0, atol=0)
    torch.testing.assert_close(out.batch["rollout_log_probs"].double(), expected_log_probs, rtol=0, atol=1e-4)
    base_tokens, _ = _greedy(base, data.batch["prompts"], prompt_mask, RESPONSE_LENGTH)
    assert not torch.equal(base_tokens, expected_tokens), "base and LoRA models decode alike; the sync is untested"

    # checkpoint: the adapter in PEFT's format, merged HF weights, and a resume restores the adapters
    worker.save_checkpoint(out_dir, global_step=1)
    if rank == 0:
        torch.save(merged_reference.state_dict(), os.path.join(out_dir, "expected_merged.pt"))
        from_adapter = PeftModel.from_pretrained(
            load_causal_lm(bundled_model_path()), os.path.join(out_dir, "lora_adapter")
        )
        for name, tensor in from_adapter.state_dict().items():
            assert torch.equal(tensor, after[name]), name
    worker.update_actor(data)
    worker.load_checkpoint(out_dir)
    for name, tensor in iter_full_params(module):
        assert torch.equal(tensor, after[name]), f"{name} was not restored by load_checkpoint"


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("lora") / "actor"
    run_distributed(_lora_worker, 2, str(out_dir))
    return out_dir


def test_lora_actor_trains_adapters_only_syncs_merged_weights_and_uses_the_base_as_reference(lora_checkpoint):
    assert (lora_checkpoint / "lora_adapter" / "adapter_config.json").is_file()


def test_hf_model_checkpoint_and_model_merger_write_the_merged_weights(lora_checkpoint, tmp_path):
    expected = torch.load(lora_checkpoint / "expected_merged.pt")
    saved = load_file(lora_checkpoint / "huggingface" / "model.safetensors")
    model_merger(["merge", "--backend", "fsdp", "--local_dir", str(lora_checkpoint), "--target_dir", str(tmp_path)])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
        if name in saved:  # tied weights are written once
            torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert (tmp_path / "lora_adapter" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------ starting from a trained adapter


def _adapter_worker(rank, world_size, adapter_dir, out_dir):
    cfg = _config(lora=(f"actor_rollout_ref.model.lora_adapter_path={adapter_dir}",))  # lora_rank stays 0
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    worker.init_model()  # rank 1 starts on the meta device: it gets the adapter through rank 0's broadcast
    module = worker.actor_model.module
    td = make_ppo_batch(batch_size=8, seed=1, response_length=RESPONSE_LENGTH)
    data = DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": 1.0}).chunk(world_size)[rank]
    mask = data.batch["response_mask"]

    # the first forward is peft's own model loaded from the adapter; the reference is the base without it
    peft_reference = PeftModel.from_pretrained(load_causal_lm(bundled_model_path()), adapter_dir).eval()
    expected_actor, _ = reference_response_log_probs(peft_reference, data.batch)
    actor_log_prob = worker.compute_log_prob(data).batch["old_log_probs"] * mask
    torch.testing.assert_close(actor_log_prob.double(), expected_actor, rtol=0, atol=2e-5)
    base = load_causal_lm(bundled_model_path()).eval()
    expected_ref, _ = reference_response_log_probs(base, data.batch)
    ref_log_prob = worker.compute_ref_log_prob(data).batch["ref_log_prob"] * mask
    torch.testing.assert_close(ref_log_prob.double(), expected_ref, rtol=0, atol=2e-5)
    gap = (expected_actor - expected_ref).abs().max()
    assert gap > 1e-2, f"the adapter moves the log-probs by only {gap}: the test cannot tell it was loaded"

    # the rollout engine decodes with the adapter merged in
    prompts, prompt_mask = _greedy_prompts(data)
    out = worker.generate_sequences(prompts)
    merged = peft_reference.merge_and_unload()
    expected_tokens, expected_log_probs = _greedy(merged, data.batch["prompts"], prompt_mask, RESPONSE_LENGTH)
    torch.testing.assert_close(out.batch["responses"], expected_tokens, rtol=0, atol=0)
    torch.testing.assert_close(out.batch["rollout_log_probs"].double(), expected_log_probs, rtol=0, atol=1e-4)

    # train a step and save; a resumed run builds the layout from the adapter, then its checkpoint wins
    data.batch["old_log_probs"] = actor_log_prob
    sign = torch.tensor([1.0, -1.0] * (len(data) // 2))
    data.batch["advantages"] = sign[:, None] * mask
    before = {n: t.clone() for n, t in iter_full_params(module)}
    worker.update_actor(data)
    trained = {n: t.clone() for n, t in iter_full_params(module)}
    assert any(not torch.equal(before[n], trained[n]) for n in trained if ".lora_B." in n)
    worker.save_checkpoint(out_dir, global_step=1)
    resumed = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    resumed.init_model()
    resumed.load_checkpoint(out_dir)
    for name, tensor in iter_full_params(resumed.actor_model.module):
        assert torch.equal(tensor, trained[name]), f"{name} after resume is not the checkpoint's"


@pytest.fixture(scope="module")
def trained_adapter_dir(tmp_path_factory) -> str:
    """A peft adapter of the bundled model (r=4, alpha=8, attention and up_proj) with random A and B."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]
    config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=targets)
    model = get_peft_model(load_causal_lm(bundled_model_path()), config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    path = tmp_path_factory.mktemp("adapter") / "lora_adapter"
    model.save_pretrained(str(path))
    return str(path)


def test_actor_started_from_an_adapter_computes_peft_s_log_probs_syncs_it_merged_and_resumes_its_checkpoint(
    trained_adapter_dir, tmp_path
):
    run_distributed(_adapter_worker, 2, trained_adapter_dir, str(tmp_path / "actor"))
