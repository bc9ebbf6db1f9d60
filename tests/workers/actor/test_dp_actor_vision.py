"""DataParallelPPOActor on a vision-language model (the tiny-vl preset, transformers' Qwen2.5-VL, and the
tiny-qwen3-vl preset, transformers' Qwen3-VL with DeepStack and interleaved M-RoPE).

The reference is the HF model run on each row alone, unpadded, with the processor's own inputs
(its `pixel_values`, `image_grid_thw` and `mm_token_type_ids`), so the model computes its own
M-RoPE positions: nothing of the actor's batch layout (left padding, (B, 4, L) position ids,
`multi_modal_inputs` routed by row) is shared with it. Everything runs in float64.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.distributed_helpers import one_thread, run_distributed
from tests.workers.actor.test_dp_actor import actor_config as base_actor_config
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.vision import input_only_token_ids
from verl.workers.actor import DataParallelPPOActor

TEMPERATURE = 0.7

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

# (image sizes (width, height), question, response length): rows with one image, none, two images of
# different grids, and one image again, so every micro-batch of 2 mixes rows with and without images
ROWS = [
    ([(56, 56)], "Color?", 5),
    ([], "What is 2+3?", 3),
    ([(28, 28), (56, 28)], "Same?", 6),
    ([(56, 56)], "Shape?", 2),
]


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def vl(request, tmp_path_factory):
    """(model directory, processor, float64 model), for each vision-language preset."""
    from verl.models.factory import make_tiny
    from verl.utils.tokenizer import hf_processor

    path = make_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))
    return path, hf_processor(path), float64_model(path)


def float64_model(path):
    """The model at `path` in float64 (a mixture-of-experts one with the eager experts: transformers' grouped_mm
    has no float64 kernel on CPU)."""
    from verl.utils.model import load_causal_lm

    model = load_causal_lm(path, torch_dtype=torch.float64)
    if getattr(model.config.get_text_config(), "num_experts", 0):
        model.set_experts_implementation("eager")
    return model


def _row_inputs(processor, sizes, question, seed):
    """The processor's outputs for one prompt with random images of `sizes`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor(text=[text], images=images or None, return_tensors="pt")


def make_vl_batch(processor, config, rows=ROWS, seed=0):
    """(DataProto in the contract's layout, per-row reference inputs). Prompts left-padded, responses
    right-padded, position ids (B, 4, L) over prompt + response, advantages +-1 per row, old log-probs
    filled in by the caller."""
    from verl.utils.vision import vl_position_ids

    gen = torch.Generator().manual_seed(seed)
    per_row = []
    for i, (sizes, question, response_length) in enumerate(rows):
        out = _row_inputs(processor, sizes, question, seed * 100 + i)
        response = torch.randint(5, 200, (response_length,), generator=gen)
        per_row.append((out, response))
    prompt_width = max(out["input_ids"].shape[1] for out, _ in per_row)
    response_width = max(len(r) for _, r in per_row)
    batch_size = len(rows)
    input_ids = torch.zeros((batch_size, prompt_width + response_width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    responses = torch.zeros((batch_size, response_width), dtype=torch.long)
    multi_modal_inputs, grids = [], []
    for row, (out, response) in enumerate(per_row):
        prompt = out["input_ids"][0]
        input_ids[row, prompt_width - len(prompt) : prompt_width] = prompt
        input_ids[row, prompt_width : prompt_width + len(response)] = response
        attention_mask[row, prompt_width - len(prompt) : prompt_width + len(response)] = 1
        responses[row, : len(response)] = response
        if "pixel_values" in out:
            multi_modal_inputs.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]})
            grids.append(out["image_grid_thw"])
        else:
            multi_modal_inputs.append({})
    position_ids = vl_position_ids(config, input_ids, attention_mask, torch.cat(grids))
    response_mask = attention_mask[:, prompt_width:].to(torch.float64)
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(batch_size)], dtype=torch.float64)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": response_mask,
        "advantages": sign[:, None] * response_mask,
    }
    non_tensors = {"multi_modal_inputs": np.array(multi_modal_inputs + [None], dtype=object)[:-1]}
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": TEMPERATURE})
    return data, per_row


def reference_log_probs(model, per_row, response_width):
    """(log-probs, entropy) [B, R] (0 past each response), each row alone through the HF model."""
    log_probs, entropies = [], []
    for out, response in per_row:
        prompt = out["input_ids"]
        ids = torch.cat([prompt, response[None]], dim=1)
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        # the model computes its own M-RoPE positions from these (transformers' get_rope_index)
        kwargs["mm_token_type_ids"] = torch.cat([out["mm_token_type_ids"], torch.zeros_like(response)[None]], dim=1)
        if "pixel_values" in out:
            kwargs["pixel_values"] = out["pixel_values"].to(torch.float64)
            kwargs["image_grid_thw"] = out["image_grid_thw"]
        logits = model(**kwargs, use_cache=False).logits[0, prompt.shape[1] - 1 : -1] / TEMPERATURE
        # the policy is over the tokens the model can emit: its input-only vision markers are excluded
        logits = logits.index_fill(-1, torch.tensor(input_only_token_ids(model.config)), float("-inf"))
        logp = torch.log_softmax(logits, dim=-1)
        pad = response_width - len(response)
        log_probs.append(torch.nn.functional.pad(logp.gather(-1, response[:, None])[:, 0], (0, pad)))
        entropies.append(torch.nn.functional.pad(-(logp.exp() * logp.clamp(min=-1e300)).sum(-1), (0, pad)))
    return torch.stack(log_probs), torch.stack(entropies)


def actor_config(**overrides):
    """test_dp_actor's actor section with this file's sizes and every row kept (zero-advantage ones too)."""
    return base_actor_config(
        **{"ppo_mini_batch_size": 4, "ppo_max_token_len_per_gpu": 64, "skip_zero_advantage_rows": False, **overrides}
    )


PATHS = {
    "padded": ({}, {"micro_batch_size": 2}),
    "remove_padding": ({"use_remove_padding": True}, {"micro_batch_size": 2}),
    "dynamic_bsz": (
        {"use_remove_padding": True, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 60},
        {"use_dynamic_bsz": True, "max_token_len": 60},
    ),
    "padded_dynamic_bsz": (
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 60},
        {"use_dynamic_bsz": True, "max_token_len": 60},
    ),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_log_probs_and_entropy_equal_each_row_alone_through_hf(vl, path):
    _, processor, model = vl
    data, per_row = make_vl_batch(processor, model.config)
    expected_lp, expected_ent = reference_log_probs(model, per_row, data.batch["responses"].shape[1])
    config, meta = PATHS[path]
    actor = DataParallelPPOActor(actor_config(**config), model)
    # a vision-language model runs every row in full, and the speed-path report says why
    assert not actor.share_prompt_forward and not actor.shared_prompt_path.active
    assert "vision-language" in actor.shared_prompt_path.reason
    data.meta_info.update(meta)
    with torch.no_grad():
        log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], expected_lp[mask], atol=1e-10, rtol=0)
    torch.testing.assert_close(entropy[mask], expected_ent[mask], atol=1e-10, rtol=0)
    # the images matter: the same batch without them gives other log-probs
    data.non_tensor_batch["multi_modal_inputs"] = np.array([{}] * len(data) + [None], dtype=object)[:-1]
    with torch.no_grad():
        blind, _ = actor.compute_log_prob(data)
    assert (blind[mask] - expected_lp[mask]).abs().max() > 1e-4


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_fused_kernels_log_probs_equal_each_row_alone(vl, use_remove_padding):
    """The fused head masks the input-only vision markers as the unfused one does (the reference masks them)."""
    _, processor, model = vl
    data, per_row = make_vl_batch(processor, model.config, seed=1)
    expected_lp, expected_ent = reference_log_probs(model, per_row, data.batch["responses"].shape[1])
    actor = DataParallelPPOActor(actor_config(use_remove_padding=use_remove_padding), model, use_fused_kernels=True)
    data.meta_info["micro_batch_size"] = 2
    with torch.no_grad():
        log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    mask = data.batch["response_mask"].bool()
    # the fused head computes in float32
    torch.testing.assert_close(log_probs[mask], expected_lp[mask].float().double(), atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy[mask], expected_ent[mask].float().double(), atol=2e-5, rtol=0)


def reference_update_delta(model, data, per_row) -> dict[str, torch.Tensor]:
    """-grad of the token-mean vanilla PPO loss over the batch (the SGD lr=1 update), from per-row forwards."""
    model = copy.deepcopy(model)
    log_probs, _ = reference_log_probs(model, per_row, data.batch["responses"].shape[1])
    td = data.batch
    loss, _ = get_policy_loss_fn("vanilla")(
        td["old_log_probs"], log_probs, td["advantages"], td["response_mask"], "token-mean"
    )
    loss.backward()
    return {n: -p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("path", ["padded", "remove_padding", "dynamic_bsz"])
def test_update_equals_the_per_row_reference_gradient_vision_tower_included(vl, path):
    _, processor, model = vl
    data, per_row = make_vl_batch(processor, model.config, seed=2)
    with torch.no_grad():
        data.batch["old_log_probs"] = reference_log_probs(model, per_row, data.batch["responses"].shape[1])[0]
    expected = reference_update_delta(model, data, per_row)
    trained = copy.deepcopy(model)
    config, _ = PATHS[path]
    actor = DataParallelPPOActor(actor_config(**config), trained, torch.optim.SGD(trained.parameters(), lr=1.0))
    metrics = actor.update_policy(data)
    assert metrics["actor/skipped_nonfinite_grad"] == [0.0]
    delta = {n: p.detach() - model.get_parameter(n).detach() for n, p in trained.named_parameters()}
    assert delta.keys() == expected.keys()
    for name in delta:
        torch.testing.assert_close(delta[name], expected[name], atol=1e-10, rtol=1e-7, msg=name)
    # the vision tower is trained (its gradient is nonzero)
    assert expected["model.visual.patch_embed.proj.weight"].abs().max() > 1e-8


@pytest.mark.parametrize("vl", ["tiny-qwen3-vl"], indirect=True)
@pytest.mark.parametrize("path", ["padded", "remove_padding"])
def test_qwen3_vl_deepstack_features_reach_the_decoder_in_the_actors_forward(vl, path):
    """The actor equals the HF forward (above); here that forward is shown to depend on DeepStack: with the
    DeepStack mergers' outputs zeroed (the main merger untouched) the reference moves, and the actor
    follows it exactly, so a forward that dropped DeepStack could not pass the comparison above."""
    _, processor, model = vl
    data, per_row = make_vl_batch(processor, model.config, seed=5)
    response_width = data.batch["responses"].shape[1]
    mask = data.batch["response_mask"].bool()
    without = copy.deepcopy(model)
    with torch.no_grad():
        for merger in without.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
        with_lp, _ = reference_log_probs(model, per_row, response_width)
        without_lp, _ = reference_log_probs(without, per_row, response_width)
        config, meta = PATHS[path]
        data.meta_info.update(meta)
        actor_lp, _ = DataParallelPPOActor(actor_config(**config), without).compute_log_prob(data)
    image_rows = torch.tensor([bool(inputs) for inputs in data.non_tensor_batch["multi_modal_inputs"]])
    moved = (with_lp - without_lp).abs().amax(-1)
    assert (moved[image_rows] > 1e-4).all() and (moved[~image_rows] == 0).all()
    torch.testing.assert_close(actor_lp[mask], without_lp[mask], atol=1e-10, rtol=0)


def test_batch_with_images_and_text_position_ids_is_refused(vl):
    _, processor, model = vl
    data, _ = make_vl_batch(processor, model.config)
    data.batch["position_ids"] = data.batch["position_ids"][:, 0]
    data.meta_info["micro_batch_size"] = 4
    actor = DataParallelPPOActor(actor_config(), model)
    with pytest.raises(ValueError, match=r"\(batch, 4, length\)"):
        actor.compute_log_prob(data)


def test_gradient_checkpointing_gives_the_same_update(vl):
    from verl.utils.model import enable_gradient_checkpointing

    _, processor, model = vl
    data, per_row = make_vl_batch(processor, model.config, seed=3)
    with torch.no_grad():
        data.batch["old_log_probs"] = reference_log_probs(model, per_row, data.batch["responses"].shape[1])[0]
    expected = reference_update_delta(model, data, per_row)
    trained = copy.deepcopy(model)
    enable_gradient_checkpointing(trained)
    config = actor_config(use_remove_padding=True)
    DataParallelPPOActor(config, trained, torch.optim.SGD(trained.parameters(), lr=1.0)).update_policy(data)
    for name, param in trained.named_parameters():
        delta = param.detach() - model.get_parameter(name).detach()
        torch.testing.assert_close(delta, expected[name], atol=1e-10, rtol=1e-7, msg=name)


def test_ulysses_sequence_parallelism_is_refused_for_a_vision_language_model(vl):
    _, _, model = vl
    config = actor_config(use_remove_padding=True, ulysses_sequence_parallel_size=2)
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 with a vision-language model.*set it to 1"):
        DataParallelPPOActor(config, model)


def test_an_actor_whose_forward_takes_no_images_refuses_an_image_batch(vl):
    """A backend without `supports_multi_modal` (Megatron's) must not train on the text alone."""
    _, processor, model = vl

    class TextOnlyActor(DataParallelPPOActor):
        supports_multi_modal = False

    data, _ = make_vl_batch(processor, model.config)
    data.meta_info["micro_batch_size"] = 4
    with pytest.raises(ValueError, match="multi_modal_inputs.*strategy=fsdp"):
        TextOnlyActor(actor_config(), model).compute_log_prob(data)


def test_images_for_a_text_model_say_what_to_change(vl):
    from tests.distributed_helpers import make_tiny_causal_lm

    _, processor, model = vl
    data, _ = make_vl_batch(processor, model.config)
    data.meta_info["micro_batch_size"] = 4
    with pytest.raises(ValueError, match="has no vision tower; use a vision-language model"):
        DataParallelPPOActor(actor_config(), make_tiny_causal_lm()).compute_log_prob(data)


def test_zero_advantage_rows_left_out_keep_each_rows_images(vl):
    """With rows 0 and 2 at zero advantage left out of the forward, rows 1 and 3 must still get their own images."""
    _, processor, model = vl
    data, per_row = make_vl_batch(processor, model.config, seed=4)
    data.batch["advantages"][0] = 0.0
    data.batch["advantages"][2] = 0.0
    with torch.no_grad():
        data.batch["old_log_probs"] = reference_log_probs(model, per_row, data.batch["responses"].shape[1])[0]
    expected = reference_update_delta(model, data, per_row)
    trained = copy.deepcopy(model)
    config = actor_config(skip_zero_advantage_rows=True, ppo_micro_batch_size_per_gpu=1)
    metrics = DataParallelPPOActor(config, trained, torch.optim.SGD(trained.parameters(), lr=1.0)).update_policy(data)
    assert metrics["actor/zero_adv_rows_skipped"] == [0.5]
    for name, param in trained.named_parameters():
        delta = param.detach() - model.get_parameter(name).detach()
        torch.testing.assert_close(delta, expected[name], atol=1e-10, rtol=1e-7, msg=name)


IMAGE_ROWS = [
    ([(56, 56)], "Color?", 4),
    ([(28, 56)], "Shape?", 3),
    ([(28, 28), (28, 28)], "Same?", 5),
    ([(56, 28)], "Size?", 2),
]


def _two_rank_fsdp_vl(rank, world_size, path):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params
    from verl.utils.tokenizer import hf_processor

    processor = hf_processor(path)
    reference = float64_model(path)
    model = apply_fsdp2(float64_model(path), {"fsdp_size": 2})
    assert type(model.model.visual.blocks[0]).__name__.startswith("FSDP")
    data, per_row = make_vl_batch(processor, reference.config, rows=IMAGE_ROWS, seed=6)
    with torch.no_grad():
        data.batch["old_log_probs"] = reference_log_probs(reference, per_row, data.batch["responses"].shape[1])[0]
    expected = reference_update_delta(reference, data, per_row)
    # each rank holds 2 of the 4 rows (with their images); one update over both equals the full-batch one
    local = data.select_idxs(torch.arange(rank * 2, rank * 2 + 2))
    config = actor_config(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, use_remove_padding=True)
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))
    actor.update_policy(local)
    full = dict(iter_full_params(model))
    for name, grad in expected.items():  # the parameters (the tied lm_head.weight is the embedding)
        delta = full[name] - reference.state_dict()[name]
        torch.testing.assert_close(delta, grad, atol=1e-10, rtol=1e-7, msg=name)
    # images on one rank and none on the other: both ranks raise instead of waiting on each other
    if rank == 1:
        local.non_tensor_batch["multi_modal_inputs"] = np.array([{}, {}, None], dtype=object)[:-1]
    local.meta_info["micro_batch_size"] = 2
    with pytest.raises(ValueError, match="images on some data-parallel ranks and none on others"):
        actor.compute_log_prob(local)


@pytest.mark.slow
def test_fsdp2_update_over_two_ranks_with_images_equals_the_full_batch_reference(vl):
    path, _, _ = vl
    run_distributed(_two_rank_fsdp_vl, 2, path)


@pytest.mark.parametrize("vl", ["tiny-qwen3-vl-moe"], indirect=True)
def test_qwen3_vl_moe_load_balancing_loss_with_images_equals_the_one_transformers_reports(vl):
    """`override_config.output_router_logits=true` sets the top-level key; Qwen3-VL-MoE keeps its experts in the
    text config. The actor's logged loss over the packed micro-batch (images included) equals transformers' own
    `aux_loss` of the same packed forward, and the update differs from the one without it."""
    from verl.models.moe import METRIC
    from verl.utils.model import extract_multi_modal_inputs
    from verl.utils.remove_padding import unpad_input, unpad_position_ids

    _, processor, model = vl
    data, per_row = make_vl_batch(processor, model.config, seed=7)
    with torch.no_grad():
        data.batch["old_log_probs"] = reference_log_probs(model, per_row, data.batch["responses"].shape[1])[0]
    td = data.batch
    ids, indices = unpad_input(td["input_ids"], td["attention_mask"])
    images = extract_multi_modal_inputs(list(data.non_tensor_batch["multi_modal_inputs"]))
    with torch.no_grad():
        out = model(
            input_ids=ids,
            position_ids=unpad_position_ids(td["position_ids"], indices),
            pixel_values=images["pixel_values"].double(),
            image_grid_thw=images["image_grid_thw"],
            output_router_logits=True,
            use_cache=False,
        )
    config = actor_config(use_remove_padding=True, ppo_micro_batch_size_per_gpu=4)
    with_aux, without = copy.deepcopy(model), copy.deepcopy(model)
    with_aux.config.output_router_logits = True  # what override_config sets
    with_aux.config.router_aux_loss_coef = 0.5
    actor = DataParallelPPOActor(config, with_aux, torch.optim.SGD(with_aux.parameters(), lr=1.0))
    assert actor.router_aux.enabled and actor.router_aux.top_k == 2 and actor.router_aux.coef == 0.5
    metrics = actor.update_policy(data)
    assert metrics[METRIC] == [pytest.approx(out.aux_loss.item(), rel=1e-6)]  # transformers sums in float32
    DataParallelPPOActor(config, without, torch.optim.SGD(without.parameters(), lr=1.0)).update_policy(data)
    router = "model.language_model.layers.0.mlp.gate.weight"
    assert (with_aux.get_parameter(router) - without.get_parameter(router)).abs().max() > 1e-6
