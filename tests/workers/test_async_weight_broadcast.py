"""Trainer -> rollout weight transfer between two separate pools, as asynchronous training does it:
an `actor_rollout` worker group (FSDP2 + its own hybrid engine) and a `rollout` worker group, each
in its own Ray resource pool and its own torch.distributed world, joined by the gloo broadcast
group of `verl.workers.weight_sync`.

The reference is the actor pool's own engine, which syncs from the FSDP parameters in-process
before every generation: after an update and a broadcast, the separate rollout pool must generate
exactly what the actor pool generates (greedy), and stamp its samples with the version it got.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.config import load_ppo_config
from verl.utils.model import compute_position_id_with_mask
from verl.workers.fsdp_workers import ActorRolloutRefWorker

QUESTIONS = ["What is 12+34?", "What is 56+78?", "What is 9+91?", "What is 45+45?", "What is 70+21?", "What is 3+4?"]
RESPONSE_LENGTH = 8


def _config(*extra: str):
    return load_ppo_config(
        [
            *extra,
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "actor_rollout_ref.actor.optim.lr=0.02",  # one update must change greedy answers
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "algorithm.adv_estimator=reinforce_plus_plus",  # one sample per prompt; the test sets advantages
            f"data.train_batch_size={len(QUESTIONS)}",
            f"data.max_response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.n=1",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={len(QUESTIONS)}",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo",
    )


def _prompts(tokenizer, do_sample: bool, **meta) -> DataProto:
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rows]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        meta_info={
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "do_sample": do_sample,
            "n": 1,
            **meta,
        },
    )


_STARTED: list = []
"""(worker group, pool) of each group a test starts, ended after the test (`_end_groups`)."""


@pytest.fixture(autouse=True)
def _end_groups():
    yield
    while _STARTED:  # the shared cluster's CPUs go back for later tests' pools
        wg, pool = _STARTED.pop()
        wg.shutdown()
        pool.remove_placement_groups()


def _group(cfg, role: str) -> RayWorkerGroup:
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role=role))
    _STARTED.append((wg, pool))
    wg.init_model()
    return wg


def _groups(cfg) -> tuple[RayWorkerGroup, RayWorkerGroup]:
    """An actor pool and a rollout pool joined by the weight-sync group (1 MiB buckets)."""
    import ray

    actor_wg, rollout_wg = _group(cfg, "actor_rollout"), _group(cfg, "rollout")
    (host, port), *_ = [a for a in actor_wg.host_weight_sync(60.0) if a is not None]
    world = 1 + rollout_wg.world_size
    ray.get(
        [
            *actor_wg.init_weight_sync(host, port, world, 60.0, 1),
            *rollout_wg.init_weight_sync(host, port, world, 60.0, 1),
        ]
    )
    return actor_wg, rollout_wg


def _update(actor_wg, tokenizer) -> None:
    """One real policy-gradient step: sampled answers, each pushed up or down."""
    sampled = actor_wg.generate_sequences(_prompts(tokenizer, do_sample=True))
    response_mask = sampled.batch["attention_mask"][:, -RESPONSE_LENGTH:]
    signs = torch.tensor([1.0, -1.0] * (len(QUESTIONS) // 2))[:, None]
    sampled.batch["response_mask"] = response_mask
    sampled.batch["advantages"] = signs * response_mask
    sampled.meta_info["temperature"] = 1.0
    actor_wg.update_actor(sampled)


def _sync(actor_wg, rollout_wg, version: int, timeout_s: float = 60.0) -> None:
    """What AsyncRolloutSource does: actor rank 0 sends, every rollout rank receives."""
    import ray

    send, receive = actor_wg.send_weights(version), rollout_wg.receive_weights(version)
    ray.get(list(send) + list(receive), timeout=timeout_s)


def test_after_an_update_and_a_broadcast_the_rollout_pool_generates_what_the_actor_pool_generates(ray_session):

    cfg = _config()
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    actor_wg, rollout_wg = _groups(cfg)

    greedy = _prompts(tokenizer, do_sample=False)
    before = rollout_wg.generate_sequences(greedy)
    torch.testing.assert_close(before.batch["responses"], actor_wg.generate_sequences(greedy).batch["responses"])
    assert before.non_tensor_batch["weight_version"].tolist() == [0] * len(QUESTIONS)

    _update(actor_wg, tokenizer)

    expected = actor_wg.generate_sequences(greedy).batch["responses"]
    assert not torch.equal(rollout_wg.generate_sequences(greedy).batch["responses"], expected), (
        "the update did not change greedy answers; the test would prove nothing"
    )

    # a 1 MiB bucket limit: the ~1M-parameter model travels in several buckets
    _sync(actor_wg, rollout_wg, version=1)
    after = rollout_wg.generate_sequences(greedy)
    assert torch.equal(after.batch["responses"], expected)
    assert after.non_tensor_batch["weight_version"].tolist() == [1] * len(QUESTIONS)


def _hf_log_probs(out: DataProto) -> torch.Tensor:
    """[B, R] float64 log-probs of the response tokens under the bundled (version 0) checkpoint."""
    from transformers import AutoModelForCausalLM

    from tests.workers.rollout.rollout_helpers import response_log_probs

    return response_log_probs(AutoModelForCausalLM.from_pretrained(bundled_model_path()).eval(), out)


def test_weights_sent_during_a_partial_rollout_are_taken_mid_generation_with_each_tokens_own_log_probs(ray_session):
    """The trainer sends version 1 while the rollout worker still holds 0 and has version 0's receive
    queued behind its generation; with partial_rollout the worker sees the announcement at its first
    check (after 2 tokens), takes the weights, and finishes the answers with them."""
    import ray

    pause_after = 2
    cfg = _config("actor_rollout_ref.rollout.calculate_log_probs=true")
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    actor_wg, rollout_wg = _groups(cfg)
    _update(actor_wg, tokenizer)

    send = actor_wg.send_weights(1)
    ray.get(send[0])  # rank 0 has announced version 1; its broadcast waits for the rollout worker
    out = rollout_wg.generate_sequences(
        _prompts(tokenizer, do_sample=True, partial_rollout=True, partial_rollout_check_steps=pause_after)
    )
    ray.get(list(rollout_wg.receive_weights(1)), timeout=60)  # already taken: a no-op

    mask = out.batch["response_mask"].bool()
    interrupted = mask[:, pause_after].numpy()
    assert interrupted.any(), "every answer ended within 2 tokens; the test would prove nothing"
    assert out.non_tensor_batch["weight_version"].tolist() == [0] * len(QUESTIONS)
    assert out.non_tensor_batch["weight_version_max"].tolist() == interrupted.astype(int).tolist()

    got = out.batch["rollout_log_probs"].double()
    v0 = _hf_log_probs(out)
    out.meta_info["temperature"] = 1.0
    v1 = actor_wg.compute_log_prob(out).batch["old_log_probs"].double() * out.batch["response_mask"]
    before, after = slice(0, pause_after), slice(pause_after, RESPONSE_LENGTH)
    torch.testing.assert_close(got[:, before], v0[:, before], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[:, after], v1[:, after], atol=1e-4, rtol=0)
    assert (v0[:, after] - v1[:, after]).abs().max() > 0.05, "the update barely moved the log-probs"

    # the worker now holds version 1: later requests generate what the actor generates
    greedy = _prompts(tokenizer, do_sample=False)
    after_sync = rollout_wg.generate_sequences(greedy)
    assert torch.equal(after_sync.batch["responses"], actor_wg.generate_sequences(greedy).batch["responses"])
    assert after_sync.non_tensor_batch["weight_version_max"].tolist() == [1] * len(QUESTIONS)
