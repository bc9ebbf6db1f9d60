"""DataParallelPPOCritic over a vision-language model: the generic value head over Qwen2.5-VL (tiny-vl) and
Qwen3-VL (tiny-qwen3-vl).

The reference runs the value model on each row alone, unpadded, with the processor's own inputs (the
model computes its own M-RoPE positions). float64 throughout.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.distributed_helpers import one_thread
from tests.workers.actor.test_dp_actor_vision import make_vl_batch
from verl.trainer.ppo.core_algos import compute_value_loss
from verl.workers.critic import DataParallelPPOCritic

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def vl_critic(request, tmp_path_factory):
    """(processor, float64 value model over the preset, its causal LM)."""
    from verl.models.factory import make_tiny
    from verl.utils.model import load_causal_lm, load_valuehead_model
    from verl.utils.tokenizer import hf_processor

    path = make_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))
    critic = load_valuehead_model(path, torch_dtype=torch.float64)
    if getattr(critic.config.get_text_config(), "num_experts", 0):  # grouped_mm has no float64 kernel on CPU
        critic.set_experts_implementation("eager")
    return hf_processor(path), critic, load_causal_lm(path)


def reference_values(model, per_row, response_width) -> torch.Tensor:
    values = []
    for out, response in per_row:
        prompt = out["input_ids"]
        ids = torch.cat([prompt, response[None]], dim=1)
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        kwargs["mm_token_type_ids"] = torch.cat([out["mm_token_type_ids"], torch.zeros_like(response)[None]], dim=1)
        if "pixel_values" in out:
            kwargs["pixel_values"] = out["pixel_values"].to(torch.float64)
            kwargs["image_grid_thw"] = out["image_grid_thw"]
        scores = model(**kwargs, use_cache=False).logits[0, prompt.shape[1] - 1 : -1, 0]
        values.append(torch.nn.functional.pad(scores, (0, response_width - len(response))))
    return torch.stack(values)


def critic_config(**overrides):
    config = {
        "ppo_mini_batch_size": 4,
        "ppo_micro_batch_size_per_gpu": 2,
        "use_dynamic_bsz": False,
        "ppo_max_token_len_per_gpu": 60,
        "ppo_epochs": 1,
        "grad_clip": 1e9,
        "cliprange_value": 0.5,
        "loss_agg_mode": "token-mean",
        "model": {"use_remove_padding": False},
    }
    config.update(overrides)
    return config


def test_the_value_head_loads_over_the_image_text_backbone(vl_critic):
    _, critic, lm = vl_critic
    family = {"qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL", "qwen3_vl_moe": "Qwen3VLMoe"}[lm.config.model_type]
    assert type(critic).__name__ == f"{family}ForTokenClassification"
    backbone = lm.state_dict()
    for name, tensor in critic.state_dict().items():
        if name.startswith("score."):
            assert tensor.shape[0] == 1
            continue
        assert torch.equal(tensor.double(), backbone[name].double()), name


PATHS = {
    "padded": ({}, {"micro_batch_size": 2}),
    "remove_padding": ({"model": {"use_remove_padding": True}}, {"micro_batch_size": 2}),
    "dynamic_bsz": (
        {"model": {"use_remove_padding": True}, "use_dynamic_bsz": True},
        {"use_dynamic_bsz": True, "max_token_len": 60},
    ),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_values_equal_each_row_alone_through_the_value_model(vl_critic, path):
    processor, model, _ = vl_critic
    data, per_row = make_vl_batch(processor, model.config)
    config, meta = PATHS[path]
    critic = DataParallelPPOCritic(critic_config(**config), model, None)
    data.meta_info.update(meta)
    with torch.no_grad():
        values = critic.compute_values(data)
        expected = reference_values(model, per_row, data.batch["responses"].shape[1])
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(values[mask], expected[mask], atol=1e-10, rtol=0)
    data.non_tensor_batch["multi_modal_inputs"] = np.array([{}] * len(data) + [None], dtype=object)[:-1]
    with torch.no_grad():
        blind = critic.compute_values(data)
    assert (blind[mask] - expected[mask]).abs().max() > 1e-6  # the images matter


@pytest.mark.parametrize("path", ["padded", "dynamic_bsz"])
def test_update_equals_the_per_row_reference_gradient(vl_critic, path):
    processor, model, _ = vl_critic
    data, per_row = make_vl_batch(processor, model.config, seed=5)
    response_width = data.batch["responses"].shape[1]
    mask = data.batch["response_mask"]
    with torch.no_grad():
        old = reference_values(model, per_row, response_width)
    data.batch["values"] = old
    data.batch["returns"] = (old + torch.linspace(-1, 1, old.numel(), dtype=torch.float64).view_as(old)) * mask
    reference = copy.deepcopy(model)
    loss, _ = compute_value_loss(
        reference_values(reference, per_row, response_width),
        data.batch["returns"],
        data.batch["values"],
        mask,
        cliprange_value=0.5,
        loss_agg_mode="token-mean",
    )
    loss.backward()
    trained = copy.deepcopy(model)
    config, _ = PATHS[path]
    critic = DataParallelPPOCritic(critic_config(**config), trained, torch.optim.SGD(trained.parameters(), lr=1.0))
    critic.update_critic(data)
    for name, param in trained.named_parameters():
        delta = param.detach() - model.get_parameter(name).detach()
        torch.testing.assert_close(delta, -reference.get_parameter(name).grad, atol=1e-10, rtol=1e-7, msg=name)
    assert reference.get_parameter("model.visual.patch_embed.proj.weight").grad.abs().max() > 0


def test_ulysses_sequence_parallelism_is_refused_for_a_vision_language_critic(vl_critic):
    _, model, _ = vl_critic
    config = critic_config(model={"use_remove_padding": True}, ulysses_sequence_parallel_size=2)
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 with a vision-language critic"):
        DataParallelPPOCritic(config, model, None)
