"""The rollout wrapper the worker is given (verl/workers/rollout/wrapper.py): used exactly when the
rollout config runs agent loops, refused loudly when it is needed and missing, and delivered to a
worker in another process (a Ray actor that never imports the trainer) with the worker's arguments."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from verl.experimental.agent_loop import AgentLoopRollout
from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.single_controller.base.errors import WorkerMethodError
from verl.trainer.config import load_ppo_config
from verl.utils.model import compute_position_id_with_mask
from verl.workers.rollout.wrapper import wrap_rollout

PLAIN = {"multi_turn": {"enable": False}, "agent": {"agent_loop_config_path": None}}
MULTI_TURN = {"multi_turn": {"enable": True}}


class Wrapped:
    """A wrapper that records what it was built from (the selection logic is under test, not the loops)."""

    def __init__(self, rollout, config, tokenizer, *, project_name=None, experiment_name=None, trainer_config=None):
        self.args = (rollout, config, tokenizer, project_name, experiment_name, trainer_config)


def test_a_config_without_agent_loops_keeps_the_engine_even_when_a_wrapper_is_given():
    engine, tokenizer = object(), object()
    assert wrap_rollout(engine, PLAIN, tokenizer, Wrapped) is engine
    assert wrap_rollout(engine, PLAIN, tokenizer, None) is engine


@pytest.mark.parametrize("config", [MULTI_TURN, {"agent": {"agent_loop_config_path": "agents.yaml"}}])
def test_a_config_with_agent_loops_builds_the_wrapper_over_the_engine_with_the_run_names(config):
    engine, tokenizer = object(), object()
    trainer = {"actor_rollout_ref": {"rollout": config}}
    wrapped = wrap_rollout(
        engine, config, tokenizer, Wrapped, project_name="p", experiment_name="e", trainer_config=trainer
    )
    assert isinstance(wrapped, Wrapped)
    assert wrapped.args == (engine, config, tokenizer, "p", "e", trainer)


def test_agent_loops_without_a_wrapper_are_refused_naming_what_to_pass():
    with pytest.raises(ValueError, match=r"multi_turn.enable=true.*rollout_wrapper=AgentLoopRollout"):
        wrap_rollout(object(), MULTI_TURN, object(), None)


def _multi_turn_config():
    return load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "actor_rollout_ref.rollout.multi_turn.enable=true",  # default loop: single_turn_agent
            "data.max_response_length=4",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo",
    )


def _prompts(tokenizer) -> DataProto:
    rows = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in ("What is 1+2?", "What is 30+4?")]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        meta_info={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "do_sample": False},
    )


def _rollout_group(cfg, **init_args):
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    worker = RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role="rollout", **init_args)
    wg = RayWorkerGroup(pool, worker)
    shutdown = wg.shutdown

    def shutdown_and_free() -> None:  # the shared cluster's CPU goes back for later tests' pools
        shutdown()
        pool.remove_placement_groups()

    wg.shutdown = shutdown_and_free
    return wg


def test_a_ray_worker_gets_the_wrapper_with_its_arguments_and_runs_agent_loops(ray_session):
    cfg = _multi_turn_config()
    wg = _rollout_group(cfg, rollout_wrapper=AgentLoopRollout)
    try:
        wg.init_model()
        out = wg.generate_sequences(_prompts(AutoTokenizer.from_pretrained(bundled_model_path())))
    finally:
        wg.shutdown()
    # only the agent-loop rollout counts messages per episode: a prompt and one answer each
    assert list(out.non_tensor_batch["__num_turns__"]) == [2, 2]


def test_a_ray_worker_without_the_wrapper_fails_at_init_model_saying_what_to_pass(ray_session):
    wg = _rollout_group(_multi_turn_config())
    try:
        with pytest.raises(WorkerMethodError, match="rollout_wrapper=AgentLoopRollout"):
            wg.init_model()
    finally:
        wg.shutdown()
