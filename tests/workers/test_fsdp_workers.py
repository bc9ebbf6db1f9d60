"""The FSDP workers called directly without Ray: `actor_rollout_ref.nccl_timeout` is the deadline
of the group the worker forms (and of the megatron groups carved from it); on CUDA the group is
bound to the device; perf/mfu/actor never overstates."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.trainer.config import load_ppo_config


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


@pytest.fixture
def one_process(one_process, monkeypatch):
    """The shared one-rank setup (tests/distributed_helpers.py), with an environment timeout that the
    config's `nccl_timeout` must win over."""
    monkeypatch.setenv("VERL_DIST_TIMEOUT_S", "45")
    yield


def test_actor_worker_group_uses_nccl_timeout(one_process):
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "actor_rollout_ref.nccl_timeout=77",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo",
    )
    ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    assert dist.get_backend() == "gloo"
    assert _timeout_s(dist.distributed_c10d._get_default_group()) == 77


def test_megatron_groups_get_the_workers_timeout(one_process):
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    from megatron.core import parallel_state as mpu

    from verl.single_controller.base.worker import init_process_group
    from verl.workers.engine.megatron.transformer_impl import setup_parallel

    init_process_group(timeout_s=88)
    try:
        setup_parallel({"tensor_model_parallel_size": 1})
        for group in (mpu.get_data_parallel_group(), mpu.get_tensor_model_parallel_group()):
            assert _timeout_s(group) == 88  # megatron's own default is 30 minutes
    finally:
        mpu.destroy_model_parallel()


@pytest.fixture
def one_gpu_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cuda")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.gpu
def test_actor_worker_group_on_cuda_is_bound_to_its_device_with_nccl_timeout(one_gpu_process):
    from verl.utils.device import get_device
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "actor_rollout_ref.nccl_timeout=77",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo",
    )
    ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    group = dist.distributed_c10d._get_default_group()
    assert str(dist.get_backend()) == "cpu:gloo,cuda:nccl", dist.get_backend()
    assert group.bound_device_id == get_device(), f"device_id not passed: {group.bound_device_id}"
    nccl = group._get_backend(get_device())
    if hasattr(nccl, "options"):  # the same init call sets both backends' timeout (gloo's checked below)
        assert nccl.options._timeout.total_seconds() == 77, nccl.options._timeout
    assert _timeout_s(group) == 77


def _shared_prompt_batch(vocab: int, prompt_length: int, long: int, short: int, n: int = 8) -> DataProto:
    """Two prompts, each with n responses (GRPO): the first group's responses have `long` tokens,
    the second's `short` (right-padded to `long`); advantages +-1, old log-probs near the model's."""
    from tests.distributed_helpers import ppo_tensors

    g = torch.Generator().manual_seed(0)
    rows = 2 * n
    prompts = torch.randint(3, vocab, (2, prompt_length), generator=g).repeat_interleave(n, dim=0)
    responses = torch.randint(3, vocab, (rows, long), generator=g)
    response_mask = torch.ones(rows, long, dtype=torch.long)
    response_mask[n:, short:] = 0
    responses = responses * response_mask
    attention_mask = torch.cat([torch.ones(rows, prompt_length, dtype=torch.long), response_mask], dim=1)
    sign = torch.tensor([1.0, -1.0]).repeat(n)
    tensors = {
        **ppo_tensors(prompts, responses, attention_mask, response_mask),
        "old_log_probs": torch.full((rows, long), -5.0),
        "advantages": sign[:, None] * response_mask,
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0})


@pytest.mark.gpu
def test_actor_mfu_with_shared_prompts_is_at_most_operator_flops_over_synchronised_time(
    one_gpu_process, monkeypatch, tmp_path
):
    """perf/mfu/actor of a GRPO update at n=8 on the shared-prompt path never exceeds what torch's
    operator count (FlopCounterMode, padding and all) over the synchronised update time gives.

    The counted FLOPs are a lower bound of the operator count by construction (checked exactly on
    CPU in tests/workers/actor/test_dp_actor.py); here the time is the point: the worker's clock
    reads between two device synchronisations. The groups' response lengths differ (64 and 8), so
    the packed response pass pads the short group to the long one: torch counts ~1.6x the FLOPs the
    update needs, which leaves room for run-to-run timing noise (the reference time is the median
    of three synchronised runs)."""
    import dataclasses
    import statistics
    import time

    from torch.utils.flop_counter import FlopCounterMode

    from verl.models.factory import build_model, get_preset, save_model
    from verl.utils.device import synchronize
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    monkeypatch.setenv("VERL_PEAK_FLOPS", "1e12")
    # the `base` preset (24M parameters, random weights, no download) without grouped-query
    # attention: torch's FLOP counter rejects the CUDA SDPA kernels' GQA shapes (torch 2.11)
    base = get_preset("base")
    preset = dataclasses.replace(base, num_key_value_heads=base.num_attention_heads)
    model_dir = save_model(*build_model(preset), str(tmp_path / "model"))
    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={model_dir}",
            "trainer.n_gpus_per_node=1",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        ],
        config_name="arith_demo",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    actor = worker.actor
    assert actor.share_prompt_forward, (
        "the actor cannot share prompts with this transformers (its causal LM takes no past_key_values); "
        "the shared-prompt path the MFU count models is off"
    )
    vocab = worker.actor_model.hf_config.vocab_size
    data = _shared_prompt_batch(vocab, prompt_length=64, long=64, short=8)
    worker.update_actor(data)  # warm-up (allocator, kernels)
    mfu = worker.update_actor(data).meta_info["metrics"]["perf/mfu/actor"]
    counted = actor.flops.total()

    times = []
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        actor.update_policy(data)
        synchronize()
        times.append(time.perf_counter() - start)
    with FlopCounterMode(display=False) as counter:
        actor.update_policy(data)
    operator_flops = counter.get_total_flops()
    reference = operator_flops / statistics.median(times) / 1e12
    assert counted <= operator_flops, (counted, operator_flops)
    assert mfu <= reference, (
        f"perf/mfu/actor={mfu:.4g} > {reference:.4g} (operator FLOPs {operator_flops:.4g} / synchronised "
        f"{statistics.median(times):.4g} s); counted {counted:.4g} FLOPs, so the worker's time was "
        f"{counted / mfu / 1e12:.4g} s"
    )


def test_an_agent_loop_config_file_runs_the_rollout_through_agent_loops_without_multi_turn(one_process, tmp_path):
    # upstream's agent-loop rollout runs the loops a config file registers whatever multi_turn says
    from verl.experimental.agent_loop import AGENT_LOOPS, AgentLoopRollout, SingleTurnAgentLoop
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    agents = tmp_path / "agents.yaml"
    agents.write_text("- name: one_turn_from_file\n  _target_: verl.experimental.agent_loop.SingleTurnAgentLoop\n")
    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.multi_turn.enable=false",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agents}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=one_turn_from_file",
        ],
        config_name="arith_demo",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="rollout", rollout_wrapper=AgentLoopRollout)
    worker.init_model()
    try:
        assert isinstance(worker.rollout, AgentLoopRollout)
        assert AGENT_LOOPS["one_turn_from_file"] is SingleTurnAgentLoop
        assert worker.rollout.default_agent == "one_turn_from_file"
    finally:
        AGENT_LOOPS.pop("one_turn_from_file", None)


def test_the_driver_sends_the_agent_loop_columns_whenever_the_worker_runs_agent_loops():
    # the worker's wrap and the driver's columns decide on one predicate: a config file of loops
    # without multi_turn must still send each row's agent_name, or rows would all run the default
    from verl.trainer.ppo.generation import generation_input
    from verl.workers.rollout.base import runs_agent_loops

    assert not runs_agent_loops({"multi_turn": {"enable": False}, "agent": {"agent_loop_config_path": None}})
    assert runs_agent_loops({"multi_turn": {"enable": True}})
    assert runs_agent_loops({"multi_turn": {"enable": False}, "agent": {"agent_loop_config_path": "agents.yaml"}})

    class Tok:
        eos_token_id, pad_token_id = 2, 0

    ids = torch.ones(2, 3, dtype=torch.long)
    batch = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": ids, "position_ids": ids},
        non_tensors={"agent_name": ["a", "b"]},
    )
    rollout = {"multi_turn": {"enable": False}, "agent": {"agent_loop_config_path": "agents.yaml"}}
    gen = generation_input(batch, Tok(), 1, runs_agent_loops(rollout))
    assert list(gen.non_tensor_batch["agent_name"]) == ["a", "b"]


def test_model_external_lib_is_imported_by_the_worker_before_the_model_loads(one_process, tmp_path, monkeypatch):
    # upstream's hook for registering custom model classes with transformers
    import sys

    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    (tmp_path / "k15_registers_a_model.py").write_text("REGISTERED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "k15_registers_a_model", raising=False)
    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.model.external_lib=k15_registers_a_model",
        ],
        config_name="arith_demo",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="rollout")
    assert "k15_registers_a_model" not in sys.modules
    worker.init_model()
    assert sys.modules["k15_registers_a_model"].REGISTERED


def test_actor_worker_applies_the_model_sections_memory_options(one_process):
    """`actor_rollout_ref.model.enable_activation_offload` and `tiled_mlp` reach the FSDP actor the worker
    builds (they were accepted and ignored before)."""
    from verl.models.transformers.tiled_mlp import remove_tiled_mlp_monkey_patch
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "actor_rollout_ref.model.enable_activation_offload=true",
            "actor_rollout_ref.model.tiled_mlp.enabled=true",
            "actor_rollout_ref.model.tiled_mlp.num_shards=2",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    try:
        worker.init_model()
        assert worker.actor.activation_offload is not None
        mlp = next(m for m in worker.actor.actor_module.modules() if type(m).__name__.endswith("MLP"))
        assert "_verl_untiled_forward" in type(mlp).__dict__  # the tiled forward replaced the MLP class's
    finally:
        remove_tiled_mlp_monkey_patch()
