"""vLLM with a vision-language model (markers `gpu` and `vllm`): requests in upstream's form,
`TokensPrompt(prompt_token_ids=<one image token per image>, multi_modal_data={"image": [...]})`.

vLLM's Qwen2-VL code imports torchvision, which has no CPU build matching this project's torch, so
on the CPU machines the rollout refuses such a model (tests/workers/rollout/test_vl_rollout.py) and
this file only runs on a CUDA machine with vllm and torchvision installed:
- vLLM's greedy responses equal the built-in engine's, row for row, on prompts with images of
  different sizes, two images, and text only (both float32);
- after a weight sync with the trainer's names (`model.visual.*`, `model.language_model.*`), vLLM
  generates the synced weights' greedy responses (an engine started with random weights, as the
  hybrid engine starts it).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.test_vl_rollout import R, _rows
from tests.workers.rollout.vl_helpers import redraw, tiny_vl_dir, vl_prompt_batch

pytest.importorskip("vllm")
pytest.importorskip("torchvision")
pytestmark = [pytest.mark.vllm, pytest.mark.gpu]


# Qwen3-VL's (DeepStack, interleaved M-RoPE) has not run on a GPU machine here yet, nor has Qwen2.5-VL's
@pytest.fixture(scope="module", params=["tiny-vl", "tiny-qwen3-vl"])
def vl(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from verl.utils.tokenizer import hf_processor

    if not torch.cuda.is_available():
        pytest.skip("vLLM's vision-language path is exercised on a CUDA device only")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = tiny_vl_dir(str(tmp_path_factory.mktemp(request.param)), preset=request.param)
    return path, AutoModelForImageTextToText.from_pretrained(path).eval(), hf_processor(path)


def _config(**overrides):
    return engine_config(
        response_length=R, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, **overrides
    )


def test_vllm_greedy_equals_the_built_in_engine_with_images_and_after_a_weight_sync(vl):
    from verl.workers.rollout.hf_rollout import HFRollout
    from verl.workers.rollout.vllm_rollout import vLLMRollout

    path, model, processor = vl
    prompts, _ = vl_prompt_batch(processor, model.config, _rows(), do_sample=False, eos_token_id=[])
    expected = HFRollout(path, _config(), device="cuda").generate_sequences(prompts)
    rollout = vLLMRollout(path, _config(load_format="auto"))
    out = rollout.generate_sequences(prompts)
    assert torch.equal(out.batch["responses"].cpu(), expected.batch["responses"].cpu())
    assert torch.equal(out.batch["position_ids"].cpu(), expected.batch["position_ids"].cpu())

    other = redraw(copy.deepcopy(model), seed=7)
    rollout.update_weights(iter(other.state_dict().items()))
    synced = HFRollout(other, _config(), device="cuda").generate_sequences(prompts)
    assert not torch.equal(synced.batch["responses"], expected.batch["responses"])
    assert torch.equal(rollout.generate_sequences(prompts).batch["responses"].cpu(), synced.batch["responses"].cpu())
