"""Upstream's `TrainingWorker` (verl.workers.engine_workers) as upstream's own engine test drives it: a Ray
worker group of 2 data-parallel ranks on a real local cluster, a loss function set from the driver,
packed batches split over the ranks. Checked against independent references: each row's log-probs
from the HF model alone, and the gradient norm and loss of the same batch on one rank."""

from __future__ import annotations

import functools
import sys

import pytest
import ray
import torch
from omegaconf import OmegaConf
from ray import cloudpickle

from tests.distributed_helpers import make_ppo_batch, reference_response_log_probs
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils import tensordict_utils as tu
from verl.workers.config import (
    ActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    TrainingWorkerConfig,
)
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss, sft_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from verl.models.factory import make_tiny

    return make_tiny("tiny", str(tmp_path_factory.mktemp("tiny") / "model"), seed=0, dtype="float32")


def _config(path) -> TrainingWorkerConfig:
    return TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(path=path, use_remove_padding=True),
        # a small fp32 model: plain replicas whose gradients are averaged over the 2 ranks
        engine_config=FSDPEngineConfig(
            fsdp_size=-1, dtype="auto", use_dynamic_bsz=True, max_token_len_per_gpu=24, infer_max_token_len_per_gpu=64
        ),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3),
    )


@pytest.fixture(scope="module")
def pool(ray_session):
    """One pool of 2 CPU bundles for the module's worker groups (colocated: a test's group shares the
    bundles with the module's, so no test waits for CPUs another module's pools hold)."""
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False)
    yield pool
    pool.remove_placement_groups()


@pytest.fixture(scope="module")
def worker_group(pool, tiny_path):
    config = _config(tiny_path)
    wg = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=config)
    )
    wg.reset()
    yield wg, config
    wg.shutdown()


def _rl_batch(seed: int):
    batch = make_ppo_batch(batch_size=8, prompt_length=4, response_length=5, seed=seed)
    g = torch.Generator().manual_seed(seed)
    batch["old_log_probs"] = -torch.rand(8, 5, generator=g) - 3.0
    batch["advantages"] = torch.rand(8, 5, generator=g)
    return batch


def _infer(wg, batch):
    data = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(data, temperature=1.0, compute_loss=False)
    out = wg.infer_batch(data).get()
    return no_padding_2_padding(tu.get(out, "log_probs"), data)


def test_infer_batch_over_two_ranks_gives_each_rows_log_probs(worker_group, tiny_path):
    from transformers import AutoModelForCausalLM

    wg, config = worker_group
    wg.reset()
    wg.set_loss_fn(functools.partial(sft_loss, config=config))
    batch = _rl_batch(seed=1)
    log_probs = _infer(wg, batch)
    reference, _ = reference_response_log_probs(AutoModelForCausalLM.from_pretrained(tiny_path), batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask].double(), reference[mask], atol=2e-5, rtol=0)


def test_train_batch_on_two_ranks_equals_one_rank(worker_group, tiny_path):
    from verl.workers.engine import EngineRegistry

    wg, config = worker_group
    wg.reset()
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    wg.set_loss_fn(functools.partial(ppo_loss, config=actor))
    batch = _rl_batch(seed=2)
    before = _infer(wg, batch)
    data = left_right_2_no_padding(batch.clone())
    metrics = tu.get(wg.train_batch(data).get(), "metrics")

    single = EngineRegistry.new(
        "language_model", "fsdp", OmegaConf.create({"path": tiny_path}), config.engine_config, config.optimizer_config
    )
    local = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(local, use_dynamic_bsz=False, micro_batch_size_per_gpu=8)
    expected = single.train_batch(local, functools.partial(ppo_loss, config=actor))
    assert metrics["grad_norm"] == pytest.approx(expected["metrics"]["grad_norm"], rel=1e-4)
    # each rank's loss is its share of the batch's times dp_size; their mean is the batch's loss
    assert metrics["loss"] == pytest.approx(sum(expected["loss"]), rel=1e-4)
    assert metrics["actor/pg_loss"].aggregate() == pytest.approx(sum(expected["loss"]), rel=1e-4)
    assert "lr" not in metrics  # the schedule steps only when the batch asks
    # the update moved the policy: the log-probs changed
    assert not torch.allclose(_infer(wg, batch), before)


def test_train_mini_batch_steps_once_per_mini_batch_and_the_schedule_once(worker_group):
    wg, _ = worker_group
    wg.reset()
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    wg.set_loss_fn(functools.partial(ppo_loss, config=actor))
    data = left_right_2_no_padding(_rl_batch(seed=3))
    tu.assign_non_tensor(data, mini_batch_size=4, epochs=2, seed=7, dataloader_kwargs={"shuffle": True})
    metrics = tu.get(wg.train_mini_batch(data).get(), "metrics")
    # 8 rows, 4 per mini-batch over 2 ranks: 2 steps per epoch, 2 epochs
    assert len(metrics["grad_norm"]) == 4 and len(metrics["loss"]) == 4
    assert len(metrics["lr"]) == 1


def test_checkpoint_round_trip_and_manual_placement(worker_group, tmp_path):
    wg, _ = worker_group
    wg.reset()
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    wg.set_loss_fn(functools.partial(ppo_loss, config=actor))
    batch = _rl_batch(seed=4)
    before = _infer(wg, batch)
    wg.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    wg.to("device")
    data = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(data, disable_auto_offload=True)
    wg.train_batch(data).get()
    wg.to("cpu")
    assert not torch.allclose(_infer(wg, batch), before)
    wg.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(_infer(wg, batch), before, atol=0, rtol=0)


def test_in_process_worker_refuses_what_the_batch_api_does_not_run(one_process, tiny_path):
    chosen = []

    def choose(model_config, device_name):
        chosen.append(device_name)
        return FSDPEngineConfig(fsdp_size=-1, dtype="auto", max_token_len_per_gpu=64), FSDPOptimizerConfig(lr=1e-3)

    worker = TrainingWorker(
        TrainingWorkerConfig(model_config=HFModelConfig(path=tiny_path), auto_select_engine_optim_fn=choose)
    )
    assert chosen == ["cpu"]
    with pytest.raises(RuntimeError, match=r"call reset\(\) first"):
        worker.to("cpu")
    worker.reset()
    worker.set_loss_fn(functools.partial(sft_loss, config=None))
    data = left_right_2_no_padding(make_ppo_batch(batch_size=2, prompt_length=3, response_length=3, seed=5))
    out = worker.infer_batch(data)
    assert tu.get(out, "log_probs").is_nested and tu.get(out, "metrics")["loss"] > 0  # the SFT loss: -log p > 0

    def built(engine_config):
        return TrainingWorker(
            TrainingWorkerConfig(
                model_config=HFModelConfig(path=tiny_path),
                engine_config=engine_config,
                optimizer_config=FSDPOptimizerConfig(lr=1e-3),
            )
        )

    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 does not divide the 1 workers"):
        built(FSDPEngineConfig(ulysses_sequence_parallel_size=2))


def test_megatron_worker_at_tensor_parallel_2_equals_the_fsdp_engine(pool, tiny_path, tmp_path):
    """The Megatron engine behind the worker: both ranks of the tp=2 group get the whole batch, one returns
    the results; the log-probs are each row's alone through the HF model, the update the FSDP engine's,
    and a checkpoint taken before it restores the policy."""

    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

    fsdp = _config(tiny_path)
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(path=tiny_path),
        engine_config=McoreEngineConfig(
            tensor_model_parallel_size=2,
            dtype="float32",
            use_dynamic_bsz=True,
            max_token_len_per_gpu=24,
            infer_max_token_len_per_gpu=64,
        ),
        optimizer_config=McoreOptimizerConfig(lr=1e-3),
    )
    wg = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=config)
    )
    try:
        _megatron_worker_checks(wg, fsdp, tiny_path, tmp_path)
    finally:
        wg.shutdown()


def _step_equals_the_one_rank_fsdp_engines(wg, batch, fsdp, tiny_path, actor) -> torch.Tensor:
    """Train `wg` and a one-rank FSDP engine (`fsdp`'s engine and optimizer sections) on `batch` with the
    same PPO loss: the step's gradient norm and loss agree, and so do the updated policies' log-probs,
    which it returns (the worker's, padded)."""
    from verl.workers.engine import EngineRegistry

    metrics = tu.get(wg.train_batch(left_right_2_no_padding(batch.clone())).get(), "metrics")
    single = EngineRegistry.new(
        "language_model", "fsdp", OmegaConf.create({"path": tiny_path}), fsdp.engine_config, fsdp.optimizer_config
    )
    local = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(local, use_dynamic_bsz=False, micro_batch_size_per_gpu=8)
    expected = single.train_batch(local, functools.partial(ppo_loss, config=actor))
    assert metrics["grad_norm"] == pytest.approx(expected["metrics"]["grad_norm"], rel=1e-4)
    assert metrics["loss"] == pytest.approx(sum(expected["loss"]), rel=1e-4)
    mask = batch["response_mask"].bool()
    with torch.no_grad():  # the same step on both: the updated policies agree
        stepped = _infer(wg, batch)
        single_out = single.infer_batch(_infer_data(batch))["model_output"]["log_probs"]
    torch.testing.assert_close(
        stepped[mask], no_padding_2_padding(single_out, _infer_data(batch))[mask], atol=1e-5, rtol=0
    )
    return stepped


def _megatron_worker_checks(wg, fsdp, tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    wg.reset()
    actor = ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    wg.set_loss_fn(functools.partial(ppo_loss, config=actor))
    batch = _rl_batch(seed=2)
    before = _infer(wg, batch)
    reference, _ = reference_response_log_probs(AutoModelForCausalLM.from_pretrained(tiny_path), batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(before[mask].double(), reference[mask], atol=2e-5, rtol=0)
    wg.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)

    stepped = _step_equals_the_one_rank_fsdp_engines(wg, batch, fsdp, tiny_path, actor)
    assert not torch.allclose(stepped[mask], before[mask])
    wg.to("cpu")
    wg.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(_infer(wg, batch), before, atol=0, rtol=0)


def test_ulysses_worker_at_sequence_parallel_2_equals_one_rank(pool, tiny_path):
    """Ulysses sp=2 over 2 ranks (dp=1): each packed micro-batch is split between the ranks (odd token
    counts padded), both get the whole batch and one returns it; log-probs and entropy equal each row
    alone through the HF model, the step's gradient norm and loss the one-rank engine's."""
    from transformers import AutoModelForCausalLM

    one_rank = _config(tiny_path)
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(path=tiny_path, use_remove_padding=True),
        engine_config=FSDPEngineConfig(
            ulysses_sequence_parallel_size=2,
            fsdp_size=-1,
            dtype="auto",
            use_dynamic_bsz=True,
            max_token_len_per_gpu=24,
            infer_max_token_len_per_gpu=64,
        ),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3),
    )
    wg = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=config)
    )
    try:
        wg.reset()
        actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
        wg.set_loss_fn(functools.partial(ppo_loss, config=actor))
        batch = _rl_batch(seed=2)
        assert int(batch["attention_mask"].sum()) % 2 == 1  # the packed tokens do not split evenly
        data = left_right_2_no_padding(batch.clone())
        tu.assign_non_tensor(data, temperature=1.0, compute_loss=False, calculate_entropy=True)
        out = wg.infer_batch(data).get()
        log_probs = no_padding_2_padding(tu.get(out, "log_probs"), data)
        hf = AutoModelForCausalLM.from_pretrained(tiny_path)
        reference, _ = reference_response_log_probs(hf, batch)
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(log_probs[mask].double(), reference[mask], atol=2e-5, rtol=0)
        assert tu.get(out, "entropy").is_nested

        _step_equals_the_one_rank_fsdp_engines(wg, batch, one_rank, tiny_path, actor)
    finally:
        wg.shutdown()


def _values_loss(model_output, data, dp_group=None):
    """A loss on every token's value (sum of squares over the batch's tokens, a mean over them)."""
    values = model_output["values"].values()
    return (values.double() ** 2).mean().float(), {}


def test_ulysses_value_model_at_sequence_parallel_2_equals_one_rank(pool, tiny_path, tmp_path):
    """The value head's path under Ulysses: values gathered whole, and a step's gradient norm, equal the
    one-rank engine's on a value model saved with its head (both load the same weights)."""
    from verl.utils.model import load_valuehead_model
    from verl.utils.tokenizer import hf_tokenizer
    from verl.workers.engine import EngineRegistry

    critic_path = str(tmp_path / "critic")
    load_valuehead_model(tiny_path).save_pretrained(critic_path)
    hf_tokenizer(tiny_path).save_pretrained(critic_path)
    engine_config = dict(fsdp_size=-1, dtype="auto", use_dynamic_bsz=False, micro_batch_size_per_gpu=3)
    config = TrainingWorkerConfig(
        model_type="value_model",
        model_config=HFModelConfig(path=critic_path, use_remove_padding=True),
        engine_config=FSDPEngineConfig(ulysses_sequence_parallel_size=2, **engine_config),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3),
    )
    wg = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=config)
    )
    try:
        wg.reset()
        wg.set_loss_fn(_values_loss)
        batch = _rl_batch(seed=5)
        single = EngineRegistry.new(
            "value_model",
            "fsdp",
            OmegaConf.create({"path": critic_path}),
            FSDPEngineConfig(**engine_config),
            FSDPOptimizerConfig(lr=1e-3),
        )
        data = left_right_2_no_padding(batch.clone())
        local = data.clone()
        tu.assign_non_tensor(local, use_dynamic_bsz=False, micro_batch_size_per_gpu=3)
        got = no_padding_2_padding(tu.get(wg.infer_batch(data.clone()).get(), "values"), data)
        want = no_padding_2_padding(single.infer_batch(local.clone())["model_output"]["values"], data)
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
        metrics = tu.get(wg.train_batch(data.clone()).get(), "metrics")
        expected = single.train_batch(local.clone(), _values_loss)
        assert metrics["grad_norm"] == pytest.approx(expected["metrics"]["grad_norm"], rel=1e-4)
    finally:
        wg.shutdown()


def _infer_data(batch):
    data = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=8, temperature=1.0)
    return data


def test_mfu_is_the_steps_flops_over_what_the_devices_could_do(one_process, tiny_path, monkeypatch):
    from verl.utils.flops_counter import FlopsCounter

    monkeypatch.setenv("VERL_PEAK_FLOPS", "2e12")
    worker = TrainingWorker(_config(tiny_path))
    worker.reset()
    flops = FlopsCounter.for_model(worker.engine.hf_config).training_flops([4, 6, 9])
    assert worker._mfu([4, 6, 9], 0.5, forward_only=False) == pytest.approx(flops / 0.5 / 2e12, rel=1e-12)
    assert worker._mfu([4, 6, 9], 0.5, forward_only=True) == pytest.approx(flops / 0.5 / 2e12 / 3, rel=1e-12)
    assert worker._mfu(None, 0.5, forward_only=False) is None
    monkeypatch.delenv("VERL_PEAK_FLOPS")
    assert worker._mfu([4, 6, 9], 0.5, forward_only=False) is None  # no GPU here: the peak is unknown
