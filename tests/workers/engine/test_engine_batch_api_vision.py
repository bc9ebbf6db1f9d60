"""The FSDP engine's batch API (`train_batch` / `infer_batch`) on a vision-language model (the tiny-vl
preset, transformers' Qwen2.5-VL; tiny-qwen3-vl for the log-probs too): a packed batch carries the
rows' `multi_modal_inputs` and (B, 4, j) M-RoPE position ids.

References share nothing of the engine's batch layout: each row alone, unpadded, through a float64
copy of the HF model with the processor's own inputs (the model computes its own M-RoPE positions);
the PPO actor's `compute_log_prob` on the same padded rows; and a float64 autograd gradient of the
whole batch's PPO loss. The engine computes in float32.
"""

from __future__ import annotations

import functools

import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import one_thread
from tests.workers.actor.test_dp_actor_vision import actor_config, float64_model, make_vl_batch
from verl.utils import tensordict_utils as tu
from verl.utils.vision import input_only_token_ids
from verl.workers.config import ActorConfig, FSDPEngineConfig
from verl.workers.engine import EngineRegistry
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

TEMPERATURE = 0.7


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-qwen3-vl"])
def vl(request, tmp_path_factory):
    """(model directory, processor) for each vision-language preset."""
    from verl.models.factory import make_tiny
    from verl.utils.tokenizer import hf_processor

    path = make_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))
    return path, hf_processor(path)


def _engine(path, model_type="language_model", **engine_kwargs):
    engine_config = FSDPEngineConfig(fsdp_size=-1, dtype="auto", **engine_kwargs)  # a plain fp32 replica
    return EngineRegistry.new(
        model_type, "fsdp", OmegaConf.create({"path": path}), engine_config, {"lr": 1e-3, "clip_grad": 1e9}
    )


def _packed(data, **settings):
    """The padded DataProto `data` as the batch API's TensorDict (its multi_modal_inputs a per-row column)."""
    packed = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(packed, **settings)
    return packed


def _row_alone(model, out, response, temperature):
    """Log-prob rows [r, V] of `response` after one processor-made prompt, the model alone on that row,
    the input-only vision markers out of the distribution (the policy's tokens)."""
    prompt = out["input_ids"]
    ids = torch.cat([prompt, response[None]], dim=1)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    kwargs["mm_token_type_ids"] = torch.cat([out["mm_token_type_ids"], torch.zeros_like(response)[None]], dim=1)
    if "pixel_values" in out:
        kwargs["pixel_values"] = out["pixel_values"].to(torch.float64)
        kwargs["image_grid_thw"] = out["image_grid_thw"]
    logits = model(**kwargs, use_cache=False).logits[0, prompt.shape[1] - 1 : -1] / temperature
    logits = logits.index_fill(-1, torch.tensor(input_only_token_ids(model.config)), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def test_infer_batch_equals_each_row_alone_and_the_ppo_actor(vl):
    path, processor = vl
    engine = _engine(path)
    data, per_row = make_vl_batch(processor, engine.hf_config)
    seen = []

    def record(model_output, data, dp_group=None):
        """Each micro-batch's rows and images (a forward-only loss function sees what the forward saw)."""
        rows = data["multi_modal_inputs"].tolist()
        grids = [row["image_grid_thw"] for row in rows if row]
        seen.append((data["input_ids"].offsets().diff().tolist(), sum(len(g) for g in grids)))
        return model_output["log_probs"].values().sum() * 0, {}

    # a token budget of 40: rows of ~20 tokens go two by two, grouped by the balancer, not in row order
    packed = _packed(data, use_dynamic_bsz=True, max_token_len_per_gpu=40, temperature=TEMPERATURE)
    tu.assign_non_tensor(packed, calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(packed, loss_function=record)
    lengths = packed["input_ids"].offsets().diff().tolist()
    assert len(seen) == 2 and sorted(n for rows, _ in seen for n in rows) == sorted(lengths)
    assert sum(images for _, images in seen) == 4  # every image once: 1 + 0 + 2 + 1 rows' grids
    log_probs = no_padding_2_padding(out["model_output"]["log_probs"], packed)
    entropy = no_padding_2_padding(out["model_output"]["entropy"], packed)
    mask = data.batch["response_mask"].bool()

    reference = float64_model(path)
    with torch.no_grad():
        for i, (prompt_out, response) in enumerate(per_row):
            logp = _row_alone(reference, prompt_out, response, TEMPERATURE)
            n = len(response)
            expected = logp.gather(-1, response[:, None])[:, 0]
            expected_entropy = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
            torch.testing.assert_close(log_probs[i, :n].double(), expected, atol=3e-5, rtol=0)
            torch.testing.assert_close(entropy[i, :n].double(), expected_entropy, atol=3e-5, rtol=0)

    # the PPO actor on the same rows (padded, 2 rows per micro-batch in row order) and the same weights
    from verl.workers.actor import DataParallelPPOActor

    actor = DataParallelPPOActor(actor_config(use_remove_padding=True), engine.module)
    data.meta_info.update(micro_batch_size=2, temperature=TEMPERATURE)
    with torch.no_grad():
        actor_lp, actor_entropy = actor.compute_log_prob(data, calculate_entropy=True)
    torch.testing.assert_close(log_probs[mask], actor_lp[mask].to(log_probs.dtype), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy[mask], actor_entropy[mask].to(entropy.dtype), atol=1e-6, rtol=0)

    # the images matter: the same batch without them gives other log-probs
    blind = data.to_tensordict()
    blind["multi_modal_inputs"] = tu.get_tensordict({"x": [{}] * len(data)})["x"]
    blind = left_right_2_no_padding(blind)
    tu.assign_non_tensor(blind, use_dynamic_bsz=True, max_token_len_per_gpu=40, temperature=TEMPERATURE)
    blind_lp = no_padding_2_padding(engine.infer_batch(blind)["model_output"]["log_probs"], blind)
    assert (blind_lp[mask] - log_probs[mask]).abs().max() > 1e-3


def _reference_grad_norm(path, per_row, old_log_probs, advantages, clip_ratio) -> float:
    """The whole batch's PPO loss (token-mean, clipped ratio) in float64 autograd, each row alone."""
    model = float64_model(path)
    rows = []
    for out, response in per_row:
        logp = _row_alone(model, out, response, 1.0)
        token_lp = logp.gather(-1, response[:, None])[:, 0]
        rows.append(torch.nn.functional.pad(token_lp, (0, old_log_probs.shape[1] - len(response))))
    log_prob = torch.stack(rows)
    mask = torch.zeros_like(log_prob)
    for i, (_, response) in enumerate(per_row):
        mask[i, : len(response)] = 1
    ratio = torch.exp(log_prob - old_log_probs.double())
    adv = advantages.double()
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))
    ((pg * mask).sum() / mask.sum()).backward()
    return float(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None)))


def test_train_batch_gradient_norm_is_the_whole_batchs_however_the_rows_are_split(vl):
    path, processor = vl
    data, per_row = make_vl_batch(processor, _engine(path).hf_config, seed=1)
    g = torch.Generator().manual_seed(3)
    shape = data.batch["responses"].shape
    data.batch["old_log_probs"] = -torch.rand(shape, generator=g) - 3.0
    data.batch["advantages"] = (torch.rand(shape, generator=g) - 0.3) * data.batch["response_mask"]
    data.batch["advantages"] = data.batch["advantages"].float()
    data.batch["response_mask"] = data.batch["response_mask"].float()
    data.meta_info.pop("temperature")
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    loss_fn = functools.partial(ppo_loss, config=config)
    expected = _reference_grad_norm(
        path, per_row, data.batch["old_log_probs"], data.batch["advantages"], config.clip_ratio
    )
    losses = []
    for settings in (
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 40},  # token budget: balanced pairs of rows
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4},  # the whole batch at once
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 3},  # 3 + 1 rows
    ):
        engine = _engine(path)
        with engine.train_mode():
            out = engine.train_batch(_packed(data, **settings), loss_function=loss_fn)
        assert out["metrics"]["grad_norm"] == pytest.approx(expected, rel=1e-4), settings
        losses.append(sum(out["loss"]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[2] == pytest.approx(losses[1], rel=1e-5)


def test_the_value_engine_scores_an_image_batch_as_each_row_alone(vl):
    path, processor = vl
    engine = _engine(path, model_type="value_model")
    data, per_row = make_vl_batch(processor, engine.hf_config, seed=2)
    packed = _packed(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=3)
    values = engine.infer_batch(packed)["model_output"]["values"].unbind()
    with torch.no_grad():
        for i, (out, response) in enumerate(per_row):
            ids = torch.cat([out["input_ids"], response[None]], dim=1)
            kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            kwargs["mm_token_type_ids"] = torch.cat([out["mm_token_type_ids"], torch.zeros_like(response)[None]], dim=1)
            kwargs.update({k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out})
            alone = engine.module(**kwargs, use_cache=False).logits[0, :, 0]
            torch.testing.assert_close(values[i], alone, atol=1e-5, rtol=0)


def test_vision_batches_where_they_cannot_run_are_refused_with_the_reason(vl, tmp_path):
    from verl.models.factory import make_tiny
    from verl.workers.engine.batch_api import EngineBatchAPI
    from verl.workers.engine.megatron.batch import padded_rows

    path, processor = vl
    engine = _engine(path)
    data, _ = make_vl_batch(processor, engine.hf_config, seed=3)
    settings = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2}
    # images with text position ids
    flat = data.to_tensordict()
    flat["position_ids"] = flat["position_ids"][:, 0]
    flat = left_right_2_no_padding(flat)
    tu.assign_non_tensor(flat, **settings)
    with pytest.raises(ValueError, match=r"\(batch, 4, length\)"):
        engine.infer_batch(flat)
    # a text model: no M-RoPE positions, no images
    text = _engine(make_tiny("tiny", str(tmp_path / "tiny")))
    with pytest.raises(ValueError, match="not a vision-language model"):
        text.infer_batch(_packed(data, **settings))
    with pytest.raises(ValueError, match="no vision tower"):
        text.infer_batch(flat)
    # Ulysses: the sequence-parallel forward does not split image features
    with pytest.raises(NotImplementedError, match="does not split image features.*use 1"):
        _engine(path, ulysses_sequence_parallel_size=2)
    # the Megatron engine's batch forward (as its PPO actor) passes no images
    micro_batch = _packed(data, **settings)
    with pytest.raises(NotImplementedError, match="Megatron engine's batch API takes text batches only.*fsdp"):
        padded_rows(micro_batch, 0)
    with pytest.raises(NotImplementedError, match="passes no images"):
        EngineBatchAPI._micro_batch_images(engine, micro_batch)
    # one dict per row
    bad = _packed(data, **settings)
    del bad["multi_modal_inputs"]
    tu.assign_non_tensor_data(bad, "multi_modal_inputs", [{}])
    with pytest.raises(ValueError, match="per-row column holding one dict per row"):
        engine.infer_batch(bad)


def test_a_text_only_batch_on_a_vision_language_model_needs_no_images(vl):
    """No multi_modal_inputs column at all: the text row of the image batch, alone, with its M-RoPE positions."""
    path, processor = vl
    engine = _engine(path)
    data, per_row = make_vl_batch(processor, engine.hf_config)
    assert "pixel_values" not in per_row[1][0]
    text = data.select_idxs([1])
    text.non_tensor_batch.pop("multi_modal_inputs")
    packed = _packed(text, use_dynamic_bsz=False, micro_batch_size_per_gpu=1, temperature=TEMPERATURE)
    assert packed["position_ids"].dim() == 3
    log_probs = no_padding_2_padding(engine.infer_batch(packed)["model_output"]["log_probs"], packed)
    out, response = per_row[1]
    with torch.no_grad():
        expected = _row_alone(float64_model(path), out, response, TEMPERATURE).gather(-1, response[:, None])[:, 0]
    torch.testing.assert_close(log_probs[0, : len(response)].double(), expected, atol=3e-5, rtol=0)


def test_the_training_worker_runs_image_batches_as_its_engine(vl, one_process):
    """In process: `infer_batch` gives the engine's log-probs, `train_batch` its gradient norm, and
    `train_mini_batch` (rows shuffled into mini-batches with their images) steps once per mini-batch."""
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    path, processor = vl
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_config=HFModelConfig(path=path),
            engine_config=FSDPEngineConfig(fsdp_size=-1, dtype="auto", max_token_len_per_gpu=40),
            optimizer_config=FSDPOptimizerConfig(lr=1e-3, clip_grad=1e9),
        )
    )
    worker.reset()
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    worker.set_loss_fn(functools.partial(ppo_loss, config=config))
    data, _ = make_vl_batch(processor, worker.engine.hf_config, seed=4)
    g = torch.Generator().manual_seed(4)
    data.batch["old_log_probs"] = -torch.rand(data.batch["responses"].shape, generator=g) - 3.0
    # positive advantages: with old log-probs far above the model's, negative ones would be clipped (no gradient)
    data.batch["advantages"] = data.batch["advantages"].float().abs()
    data.batch["response_mask"] = data.batch["response_mask"].float()
    data.meta_info.pop("temperature")
    mask = data.batch["response_mask"].bool()

    engine = _engine(path)
    expected = no_padding_2_padding(
        engine.infer_batch(_packed(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=4))["model_output"][
            "log_probs"
        ],
        _packed(data),
    )
    packed = _packed(data, compute_loss=False)
    log_probs = no_padding_2_padding(tu.get(worker.infer_batch(packed), "log_probs"), packed)
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-6, rtol=0)

    loss_fn = functools.partial(ppo_loss, config=config)
    engine_norm = engine.train_batch(_packed(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=1), loss_fn)
    metrics = tu.get(worker.train_batch(_packed(data)), "metrics")
    assert metrics["grad_norm"] == pytest.approx(engine_norm["metrics"]["grad_norm"], rel=1e-5)

    mini = _packed(data, mini_batch_size=2, dataloader_kwargs={"shuffle": True})
    metrics = tu.get(worker.train_mini_batch(mini), "metrics")
    assert len(metrics["grad_norm"]) == 2 and all(n > 0 for n in metrics["grad_norm"])
