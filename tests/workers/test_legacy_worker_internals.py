"""Upstream's legacy FSDP worker internals, as verl-recipe's workers use them (SPPO's).

A recipe's `ActorRolloutRefWorker` subclass overrides `init_model` with upstream's body
(`_build_model_optimizer` for the actor and the reference, `_build_rollout`, its own
`DataParallelPPOActor` subclass whose `update_policy` loops over `_forward_micro_batch` and
`_optimizer_step`, `self.ref_policy`, an `FSDPCheckpointManager` of its own). The worker below is written
that way; its RPCs must then run on what it built: the update's gradient norm equals a float64
reference of the same loss, the reference policy stays the initial weights, the recipe's checkpoint
manager saves and restores."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from tests.distributed_helpers import make_ppo_batch
from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.trainer.config import load_ppo_config
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.fsdp_workers import ActorRolloutRefWorker

TEMPERATURE = 1.0
MICRO = 2


class ReinforceActor(DataParallelPPOActor):
    """A recipe-style actor: REINFORCE on `seq_rewards`, written against upstream's internals."""

    def update_policy(self, data: DataProto):
        self.actor_module.train()
        batch = data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids", "seq_rewards"])
        metrics = {"actor/recipe_loss": [], "actor/grad_norm": []}
        for mini_batch in batch.batch.split(self.config.ppo_mini_batch_size):
            self.gradient_accumulation = self.config.ppo_mini_batch_size // self.config.ppo_micro_batch_size_per_gpu
            self.actor_optimizer.zero_grad()
            for micro in mini_batch.split(self.config.ppo_micro_batch_size_per_gpu):
                mask = micro["attention_mask"][:, -micro["responses"].shape[1] :]
                _, log_prob = self._forward_micro_batch(micro_batch=micro, temperature=TEMPERATURE)
                loss = -(micro["seq_rewards"] * (log_prob * mask).sum(-1)).mean() / self.gradient_accumulation
                loss.backward()
                metrics["actor/recipe_loss"].append(loss.item())
            metrics["actor/grad_norm"].append(self._optimizer_step().item())
        self.actor_optimizer.zero_grad()
        return metrics


class LegacyWorker(ActorRolloutRefWorker):
    """init_model as upstream's legacy FSDP worker and its recipes write it."""

    def init_model(self):
        override = OmegaConf.to_container(OmegaConf.create(self.config.model.get("override_config", {})))
        remove_padding = self.config.model.get("use_remove_padding", False)
        if self._is_actor or self._is_rollout:
            self.actor_module_fsdp, self.actor_optimizer, self.actor_lr_scheduler, self.actor_model_config = (
                self._build_model_optimizer(
                    model_path=self.config.model.path,
                    fsdp_config=self.config.actor.fsdp_config,
                    optim_config=self.config.actor.optim if self._is_actor else None,
                    override_model_config=override,
                    use_remove_padding=remove_padding,
                    role="actor",
                )
            )
            self.actor_module = self.actor_module_fsdp._fsdp_wrapped_module
        if self._is_actor:
            with open_dict(self.config.actor):
                self.config.actor.use_remove_padding = remove_padding
            self.actor = ReinforceActor(
                config=self.config.actor, actor_module=self.actor_module_fsdp, actor_optimizer=self.actor_optimizer
            )
        if self._is_rollout:
            self._build_rollout(trust_remote_code=False)
        if self._is_ref:
            self.ref_module_fsdp = self._build_model_optimizer(
                model_path=self.config.model.path,
                fsdp_config=self.config.ref.fsdp_config,
                optim_config=None,
                override_model_config=override,
                use_remove_padding=remove_padding,
                role="ref",
            )[0]
            with open_dict(self.config.ref):
                self.config.ref.use_remove_padding = remove_padding
            self.ref_policy = DataParallelPPOActor(config=self.config.ref, actor_module=self.ref_module_fsdp)
        if self._is_actor:
            self.checkpoint_manager = FSDPCheckpointManager(
                model=self.actor_module_fsdp,
                optimizer=self.actor.actor_optimizer,
                lr_scheduler=self.actor_lr_scheduler,
                processing_class=self.processor if self.processor is not None else self.tokenizer,
                checkpoint_config=self.config.actor.checkpoint,
            )


def _batch() -> DataProto:
    td = make_ppo_batch(batch_size=4, prompt_length=6, response_length=5, seed=3)
    td["seq_rewards"] = torch.tensor([1.0, -0.5, 0.25, -1.0])
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": TEMPERATURE})


def _reference_grad_norm(batch: DataProto) -> float:
    """The gradient norm of ReinforceActor's loss on the bundled model in float64, per sequence (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), torch_dtype=torch.float64)
    model.train()
    td = batch.batch
    response_length = td["responses"].shape[1]
    prompt_length = td["input_ids"].shape[1] - response_length
    total = 0.0
    for start in range(0, len(td), MICRO):
        loss = 0.0
        for i in range(start, start + MICRO):
            keep = td["attention_mask"][i].bool()
            ids = td["input_ids"][i][keep]
            n_prompt, n_response = int(keep[:prompt_length].sum()), int(keep[prompt_length:].sum())
            log_probs = torch.log_softmax(model(input_ids=ids[None]).logits[0] / TEMPERATURE, dim=-1)
            targets = ids[n_prompt : n_prompt + n_response]
            seq = log_probs[n_prompt - 1 : n_prompt - 1 + n_response].gather(-1, targets[:, None]).sum()
            loss = loss - td["seq_rewards"][i].double() * seq
        total = total + loss / MICRO / (len(td) // MICRO)
    total.backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))


@pytest.fixture
def worker(one_process):
    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "trainer.n_gpus_per_node=1",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",
            "actor_rollout_ref.actor.use_kl_loss=true",  # a reference policy in the worker
        ],
        config_name="arith_demo",
    )
    worker = LegacyWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    worker.init_model()
    return worker


def test_a_recipe_init_model_builds_what_the_rpcs_run_on(worker, tmp_path):
    assert (worker._is_actor, worker._is_rollout, worker._is_ref) == (True, True, True)
    assert worker.actor_module is worker.actor_module_fsdp  # FSDP2: the module is the HF model itself
    assert worker.ref_policy is worker.ref and worker.ref_model is not worker.actor_model
    assert worker.actor.ulysses_sequence_parallel_size == 1
    assert worker.config.actor.ppo_mini_batch_size == 4  # this rank's samples, as upstream's worker sets it
    assert worker.actor_model_config.vocab_size == worker.actor_module.config.vocab_size

    batch = _batch()
    before = worker.compute_log_prob(batch).batch["old_log_probs"]
    ref = worker.compute_ref_log_prob(batch).batch["ref_log_prob"]
    # both are the initial weights (batched in the ref's and the rollout's micro-batch sizes: fp32 rounding)
    torch.testing.assert_close(ref, before, atol=1e-5, rtol=1e-6)

    metrics = worker.update_actor(batch).meta_info["metrics"]
    assert metrics["actor/grad_norm"] == [pytest.approx(_reference_grad_norm(batch), rel=1e-4)]
    assert len(metrics["actor/recipe_loss"]) == 2 and metrics["actor/lr"] > 0
    after = worker.compute_log_prob(batch).batch["old_log_probs"]
    assert not torch.equal(after, before)  # the optimizer stepped
    torch.testing.assert_close(worker.compute_ref_log_prob(batch).batch["ref_log_prob"], ref, atol=0, rtol=0)

    # the recipe's checkpoint manager is the one that saves and restores
    worker.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    assert worker.actor_model.checkpoint_manager is worker.checkpoint_manager
    worker.update_actor(batch)
    assert not torch.equal(worker.compute_log_prob(batch).batch["old_log_probs"], after)
    worker.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(worker.compute_log_prob(batch).batch["old_log_probs"], after, atol=0, rtol=0)


def test_the_recipe_built_rollout_generates_with_the_trained_weights(worker):
    from verl.utils.model import compute_position_id_with_mask

    ids = worker.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12+30?"}], add_generation_prompt=True, tokenize=True
    )
    prompt = torch.tensor([ids])
    mask = torch.ones_like(prompt)
    prompts = DataProto.from_dict(
        tensors={"input_ids": prompt, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        meta_info={"do_sample": False, "eos_token_id": worker.tokenizer.eos_token_id, "pad_token_id": 0},
    )
    out = worker.generate_sequences(prompts)
    assert out.batch["responses"].shape[0] == 1
    assert "timing_s/update_weights" in out.meta_info["metrics"]  # the legacy-built actor's weights were synced
