"""Generation with images: the built-in engine and `HFRollout` on a vision-language model.

References are independent of the engine: transformers' own `generate` (greedy, token for token),
transformers' `generate` on each row alone, and a float64 forward of each row alone over prompt +
response with its images (log-probs). The batch mixes images of different sizes, a row with two
images, a text-only row, two rows with the same text and different images (which must not share a
prefill) and a row repeated with the same image (which does).
"""

from __future__ import annotations

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.vl_helpers import (
    PAD,
    hf_greedy,
    random_image,
    redraw,
    teacher_forced_log_probs,
    tiny_vl_dir,
    vl_prompt_batch,
)
from verl.workers.rollout.sampling import SamplingParams

R = 8


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def vl(request, tmp_path_factory):
    """(model directory, float32 model, processor), for each vision-language preset."""
    from transformers import AutoModelForImageTextToText

    from verl.utils.tokenizer import hf_processor

    path = tiny_vl_dir(str(tmp_path_factory.mktemp(request.param)), preset=request.param)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return path, model, hf_processor(path)


def _rows():
    square, other = random_image(56, 56, seed=1), random_image(56, 56, seed=2)
    return [
        ("Color?", [square]),  # 4 image tokens
        ("hi 12+3", []),  # text only
        ("a", [random_image(84, 28, seed=3)]),  # grid (1, 2, 6): 3 image tokens
        ("Color?", [other]),  # the same ids and positions as row 0, another image
        ("Color?", [square]),  # row 0 again: shares its prefill
        ("same?", [random_image(56, 112, seed=4), random_image(28, 28, seed=5)]),  # two images
    ]


def _engine(model, device: str = "cpu"):
    from verl.workers.rollout.native.engine import GenerationEngine

    return GenerationEngine.from_model(model, device=device, dtype="float32")


def _generate(engine, prompts, **kwargs):
    return engine.generate(
        prompts.batch["input_ids"],
        prompts.batch["attention_mask"],
        R,
        kwargs.pop("sampling", SamplingParams(do_sample=False)),
        pad_token_id=PAD,
        position_ids=prompts.batch["position_ids"],
        multi_modal_inputs=list(prompts.non_tensor_batch["multi_modal_inputs"]),
        **kwargs,
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_generation_equals_transformers_generate_token_for_token(vl, device):
    """transformers' generate runs on CPU in both cases; the engine on `device` (float32 throughout)."""
    _, model, processor = vl
    prompts, mm_types = vl_prompt_batch(processor, model.config, _rows())
    engine = _engine(model, device)
    expected = hf_greedy(model, prompts, mm_types, R)
    assert torch.equal(_generate(engine, prompts).responses.cpu(), expected)
    # the images reach the tokens: the same text with another image answers otherwise
    assert not torch.equal(expected[0], expected[3]) and torch.equal(expected[0], expected[4])

    # with a stop token some rows finish early and leave the batch (compaction): still equal
    eos = int(expected[0, 2])
    stopped = hf_greedy(model, prompts, mm_types, R, eos=eos)
    out = _generate(engine, prompts, eos_token_id=eos)
    assert torch.equal(out.responses.cpu(), stopped)
    lengths = out.response_mask.cpu().sum(-1)
    assert lengths.min() < R and lengths.max() == R  # some rows stopped, some ran to the end


def test_positions_are_given_or_computed_alike(vl):
    _, model, processor = vl
    prompts, _ = vl_prompt_batch(processor, model.config, _rows()[:3])
    engine = _engine(model)
    given = _generate(engine, prompts).responses
    computed = engine.generate(
        prompts.batch["input_ids"],
        prompts.batch["attention_mask"],
        R,
        SamplingParams(do_sample=False),
        pad_token_id=PAD,
        multi_modal_inputs=list(prompts.non_tensor_batch["multi_modal_inputs"]),
    ).responses
    assert torch.equal(given, computed)


def test_sampled_log_probs_equal_a_float64_forward_of_each_row_with_its_images(vl):
    _, model, processor = vl
    prompts, _ = vl_prompt_batch(processor, model.config, _rows())
    gen = torch.Generator().manual_seed(0)
    out = _generate(
        _engine(model),
        prompts,
        sampling=SamplingParams(do_sample=True, temperature=1.0),
        return_logprobs=True,
        generator=gen,
        eos_token_id=list(range(2, 40)),
    )
    expected = teacher_forced_log_probs(model, prompts, out.responses, out.response_mask)
    # float32 engine against a float64 reference
    torch.testing.assert_close(out.logprobs.double(), expected, atol=2e-5, rtol=0)
    assert out.response_mask.sum() > 2 * len(_rows())  # enough sampled tokens compared


@pytest.mark.parametrize("vl", ["tiny-qwen3-vl", "tiny-qwen3-vl-moe"], indirect=True)
def test_qwen3_vl_deepstack_features_reach_the_engines_prefill_and_decode(vl):
    """The engine's sampled log-probs equal the float64 forward (above) of the model with DeepStack, and not of
    the same model with its DeepStack mergers' outputs zeroed: the image rows' prefill and the decode steps
    after it (which attend to the prefilled image tokens) carry the DeepStack features."""
    import copy

    _, model, processor = vl
    prompts, _ = vl_prompt_batch(processor, model.config, _rows())
    out = _generate(
        _engine(model),
        prompts,
        sampling=SamplingParams(do_sample=True, temperature=1.0),
        return_logprobs=True,
        generator=torch.Generator().manual_seed(1),
        eos_token_id=[],
    )
    without = copy.deepcopy(model)
    with torch.no_grad():
        for merger in without.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
    expected = teacher_forced_log_probs(model, prompts, out.responses, out.response_mask)
    blind = teacher_forced_log_probs(without, prompts, out.responses, out.response_mask)
    torch.testing.assert_close(out.logprobs.double(), expected, atol=2e-5, rtol=0)
    image_rows = [i for i, inputs in enumerate(prompts.non_tensor_batch["multi_modal_inputs"]) if inputs]
    gap = (out.logprobs.double() - blind).abs()
    # every image row differs at its first token (prefill) and after it (decode); the text-only row does not
    assert all(gap[i, 0] > 1e-3 and gap[i, 1:].max() > 1e-3 for i in image_rows)
    assert gap[1].max() < 2e-5 and 1 not in image_rows


def test_text_model_and_bad_inputs_are_refused(vl):
    from tests.workers.rollout.rollout_helpers import build_model
    from verl.workers.rollout.native.engine import GenerationEngine
    from verl.workers.rollout.native.llama_decoder import unsupported_reason

    path, model, processor = vl
    prompts, _ = vl_prompt_batch(processor, model.config, _rows()[:2])
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    images = list(prompts.non_tensor_batch["multi_modal_inputs"])
    text_engine = GenerationEngine.from_model(build_model("qwen2"), device="cpu")
    with pytest.raises(ValueError, match="not a vision-language model"):
        text_engine.generate(ids.clamp(max=40), mask, 2, multi_modal_inputs=images, pad_token_id=PAD)
    text_rollout = _rollout(build_model("qwen2"))
    with pytest.raises(ValueError, match="not a vision-language model"):  # images given as PIL only
        text_rollout.generate_sequences(_without_inputs(prompts))
    with pytest.raises(ValueError, match="M-RoPE"):
        text_engine.generate(ids.clamp(max=40), mask, 2, position_ids=prompts.batch["position_ids"], pad_token_id=PAD)
    engine = _engine(model)
    with pytest.raises(ValueError, match=r"\[batch, 4, prompt_len\]"):
        engine.generate(ids, mask, 2, position_ids=mask.cumsum(-1), multi_modal_inputs=images, pad_token_id=PAD)
    with pytest.raises(ValueError, match="videos are not supported"):
        engine.generate(ids, mask, 2, multi_modal_inputs=[{"pixel_values_videos": 1}, {}], pad_token_id=PAD)
    with pytest.raises(ValueError, match="one per row"):
        engine.generate(ids, mask, 2, multi_modal_inputs=images[:1], pad_token_id=PAD)
    # the native decoder says why it does not run the model; what needs it is refused with that reason
    assert "vision-language" in unsupported_reason(model.config)
    with pytest.raises(ValueError, match="vision-language"):
        GenerationEngine.from_model(path, device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="CUDA graphs need the native decoder.*vision-language"):
        GenerationEngine.from_model(path, device="cpu", use_cuda_graph=True)


# ------------------------------------------------------------------------------------- HFRollout
def _without_inputs(prompts):
    """`prompts` with the images as PIL only (no `multi_modal_inputs`) and no position ids."""
    out = prompts.select_idxs(list(range(len(prompts))))
    out.non_tensor_batch.pop("multi_modal_inputs")
    del out.batch["position_ids"]
    return out


def _rollout(path, **overrides):
    from verl.workers.rollout.hf_rollout import HFRollout

    return HFRollout(path, engine_config(response_length=R, **overrides), device="cpu")


def _greedy_alone(model, prompts, row: int) -> list[int]:
    """transformers' generate on one row alone (no padding), its tokens up to R (the input-only vision markers
    suppressed, as the rollout does)."""
    from verl.utils.vision import input_only_token_ids

    one = prompts.select_idxs([row])
    keep = one.batch["attention_mask"][0].bool()
    from verl.utils.model import extract_multi_modal_inputs

    images = extract_multi_modal_inputs(list(one.non_tensor_batch["multi_modal_inputs"]))
    ids = one.batch["input_ids"][:, keep]
    types = (ids == model.config.image_token_id).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types, **images,
            max_new_tokens=R, do_sample=False, pad_token_id=PAD, eos_token_id=None,
            suppress_tokens=input_only_token_ids(model.config),
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_rollout_output_follows_the_contract_in_chunks_and_repeats(vl):
    """GRPO-style repeated rows, generated in chunks of 4 rows (`max_num_seqs`): each response equals
    transformers' generate on that row alone; positions equal `vl_position_ids` over prompt +
    response; `multi_modal_inputs` stay row-aligned."""
    from verl.utils.vision import vl_position_ids

    path, model, processor = vl
    prompts, _ = vl_prompt_batch(processor, model.config, _rows()[:4], do_sample=False)
    prompts = prompts.repeat(2, interleave=True)
    out = _rollout(path, max_num_seqs=4).generate_sequences(prompts)

    B, P = prompts.batch["input_ids"].shape
    assert out.batch["responses"].shape == (B, R) and out.batch["position_ids"].shape == (B, 4, P + R)
    for row in range(0, B, 2):  # rows 2k and 2k+1 are one prompt's two samples
        expected = _greedy_alone(model, prompts, row)
        assert out.batch["responses"][row].tolist() == expected == out.batch["responses"][row + 1].tolist()
    rows_images = list(out.non_tensor_batch["multi_modal_inputs"])
    assert all(a is b for a, b in zip(rows_images, prompts.non_tensor_batch["multi_modal_inputs"]))
    grids = torch.cat([r["image_grid_thw"] for r in rows_images if r])
    expected = vl_position_ids(model.config, out.batch["input_ids"], out.batch["attention_mask"], grids)
    assert torch.equal(out.batch["position_ids"], expected)


def test_rollout_runs_the_image_processor_when_only_images_are_given(vl):
    path, model, processor = vl
    prompts, _ = vl_prompt_batch(processor, model.config, _rows()[:3], do_sample=False)
    rollout = _rollout(path)
    with_inputs = rollout.generate_sequences(prompts)
    images_only = _without_inputs(prompts)  # the rollout computes the inputs and the positions
    out = rollout.generate_sequences(images_only)
    assert torch.equal(out.batch["responses"], with_inputs.batch["responses"])
    assert torch.equal(out.batch["position_ids"], with_inputs.batch["position_ids"])
    for made, given in zip(out.non_tensor_batch["multi_modal_inputs"], prompts.non_tensor_batch["multi_modal_inputs"]):
        assert made.keys() == given.keys()
        for key in given:
            torch.testing.assert_close(made[key], given[key])
    images_only.non_tensor_batch["multi_modal_data"][0] = {"videos": [object()]}
    with pytest.raises(ValueError, match="images only"):
        rollout.generate_sequences(images_only)


def test_weight_sync_takes_the_trainer_names_and_the_transformers_4_names(vl):
    """After a level-2 sleep the engine generates only with the weights synced into it: a model
    redrawn with another seed, sent with transformers 5's names (`model.visual.*`,
    `model.language_model.*`) and with the released checkpoints' (`visual.*`, `model.layers.*`)."""
    import copy
    import re

    path, model, processor = vl
    other = redraw(copy.deepcopy(model), seed=7)
    prompts, _ = vl_prompt_batch(processor, model.config, _rows()[:1], do_sample=False)
    expected = _greedy_alone(other, prompts, 0)
    assert expected != _greedy_alone(model, prompts, 0)
    state = other.state_dict()
    assert any(n.startswith("model.visual.") for n in state) and any(
        n.startswith("model.language_model.") for n in state
    )
    legacy = {
        re.sub(r"^model\.language_model\.", "model.", re.sub(r"^model\.visual\.", "visual.", n)): t
        for n, t in state.items()
    }
    rollout = _rollout(path)
    for names in (state, legacy):
        rollout.sleep()
        rollout.wake_up()
        with pytest.raises(RuntimeError, match="not synced"):
            rollout.generate_sequences(prompts)
        rollout.update_weights(iter(names.items()))
        assert rollout.generate_sequences(prompts).batch["responses"][0].tolist() == expected


# ------------------------------------------------------------------------- external engines (no engine)
def test_engine_requests_hold_one_image_token_per_image_and_the_images(vl):
    from verl.workers.rollout.engine_io import image_requests

    _, model, processor = vl
    rows = _rows()
    prompts, _ = vl_prompt_batch(processor, model.config, rows)
    requests, images = image_requests(prompts, model.config.image_token_id)
    # upstream's raw_prompt_ids: the chat template's ids before the processor expanded the image tokens
    assert requests == [list(ids) for ids in prompts.non_tensor_batch["raw_prompt_ids"]]
    assert [len(i or []) for i in images] == [len(r[1]) for r in rows]
    assert images[5][1] is rows[5][1][1] or images[5][1] == rows[5][1][1]
    prompts.non_tensor_batch["multi_modal_data"][0] = {}
    with pytest.raises(ValueError, match="row 0 has 1 image"):
        image_requests(prompts, model.config.image_token_id)


def test_vllm_and_sglang_refuse_a_vision_language_model_they_cannot_run(vl, monkeypatch):
    import importlib.util

    from verl.workers.rollout import vllm_rollout
    from verl.workers.rollout.sglang_rollout import SGLangRollout

    path = vl[0]
    if importlib.util.find_spec("torchvision") is None:  # this CPU machine: refused before vLLM is imported
        with pytest.raises(ValueError, match="rollout.name=hf, which generates with images on CPU"):
            vllm_rollout.vLLMRollout(path, engine_config())
    with pytest.raises(NotImplementedError, match="SGLangRollout with the vision-language model"):
        SGLangRollout(path, engine_config())
    # vLLM's multimodal processor needs the tokenizer: not skipped for a vision-language model
    assert vllm_rollout.vllm_engine_kwargs(path, engine_config())["skip_tokenizer_init"] is False


def test_partial_rollout_resumes_rows_with_their_images_under_the_new_weights(vl):
    """Newer weights arrive after 3 sampled columns: the unfinished rows are prefilled again, with
    their images, under them. Each token's log-prob must be the one of the weights that sampled it,
    scored by a float64 forward with the row's images (without them, the resumed rows' would not be)."""
    import copy

    from tests.workers.rollout.rollout_helpers import SwapTo

    path, model, processor = vl
    new = redraw(copy.deepcopy(model), seed=3)
    rows = [_rows()[i] for i in (0, 1, 5)]  # an image, text only, two images
    prompts, _ = vl_prompt_batch(
        processor, model.config, rows, partial_rollout=True, partial_rollout_check_steps=3, eos_token_id=[]
    )
    rollout = _rollout(path, calculate_log_probs=True, temperature=1.0)
    rollout.weight_refresh = SwapTo(rollout, new)
    torch.manual_seed(0)
    out = rollout.generate_sequences(prompts)
    assert out.non_tensor_batch["weight_version_max"].tolist() == [1] * len(rows)  # every row was resumed
    got = out.batch["rollout_log_probs"].double()
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    before = teacher_forced_log_probs(model, prompts, responses, mask)[:, :3]
    after = teacher_forced_log_probs(new, prompts, responses, mask)[:, 3:]
    torch.testing.assert_close(got[:, :3], before, atol=2e-5, rtol=0)
    torch.testing.assert_close(got[:, 3:], after, atol=2e-5, rtol=0)


def test_the_input_only_vision_markers_are_never_sampled(vl):
    """A model pushed to prefer `<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>` and `<|vision_end|>`
    (+30 on their logits) still never emits them, greedy or sampled; vLLM gets them as a -100 logit bias.
    A sampled marker would break every later forward of the row (transformers matches image tokens
    against image features)."""
    from verl.utils.vision import input_only_token_ids
    from verl.workers.rollout.vllm_rollout import vllm_sampling_kwargs

    _, model, processor = vl
    markers = input_only_token_ids(model.config)
    assert len(markers) == 4 and model.config.image_token_id in markers
    prompts, _ = vl_prompt_batch(processor, model.config, _rows())

    def prefer_markers(module, args, output):
        output = output.clone()
        output[..., markers] += 30.0
        return output

    handle = model.lm_head.register_forward_hook(prefer_markers)
    try:
        engine = _engine(model)
        for sampling in (SamplingParams(do_sample=False), SamplingParams(do_sample=True, temperature=1.0)):
            out = _generate(engine, prompts, sampling=sampling, generator=torch.Generator().manual_seed(0))
            sampled = out.responses[out.response_mask.bool()]
            assert sampled.numel() == len(_rows()) * R
            assert not torch.isin(sampled, torch.tensor(markers)).any()
        # the hook is live: without the rollout's mask the markers would win every greedy step
        with torch.no_grad():
            logits = model(input_ids=prompts.batch["input_ids"][1:2]).logits[0, -1]
        assert int(logits.argmax()) in markers
    finally:
        handle.remove()
    kwargs = vllm_sampling_kwargs(SamplingParams(), 4, [], False, False, markers)
    assert kwargs["logit_bias"] == {m: -100.0 for m in markers}
    assert "logit_bias" not in vllm_sampling_kwargs(SamplingParams(), 4, [], False, False)
