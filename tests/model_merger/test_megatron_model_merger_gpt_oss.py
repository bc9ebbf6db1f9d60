"""`python -m verl.model_merger --backend megatron` on a gpt-oss checkpoint (`tiny-gptoss`) that
MegatronCheckpointManager wrote on 2 gloo ranks at tp=2 (sequence parallel) x ep=2 (whole experts:
expert_tensor_parallel_size=1): the merged directory holds HF's own tensors bit-exactly (the sinks
split by heads, the biases, the interleaved gate/up of the experts, the router's bias) and loads as
transformers' `GptOssForCausalLM` with the reference's logits."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, hf_state_dict, tiny_gptoss_hf_model
from tests.model_merger.test_megatron_model_merger import merge
from verl.models.factory import build_tokenizer


def _save(rank, world_size, root):
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    model = tiny_gptoss_hf_model()
    chunks = build_loaded_chunks(model, tp=2, ep=2, etp=1, sequence_parallel=True)
    manager = MegatronCheckpointManager(
        chunks,
        processing_class=build_tokenizer("tiny-gptoss"),
        checkpoint_config={"save_contents": ["model", "extra"]},
        hf_config=model.config,
    )
    manager.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1)


@pytest.mark.slow
def test_tp2_ep2_gpt_oss_checkpoint_merges_into_a_gpt_oss_model_transformers_loads(tmp_path):
    run_distributed(_save, 2, str(tmp_path / "ckpt"))
    merge(tmp_path / "ckpt", "actor", tmp_path / "hf")

    reference = tiny_gptoss_hf_model()
    expected = hf_state_dict(reference)
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert stored.keys() == expected.keys()
    for name, tensor in stored.items():
        assert torch.equal(tensor, expected[name]), name

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "GptOssForCausalLM"
    assert model.config.layer_types == ["sliding_attention", "full_attention"] and model.config.sliding_window == 4
    model.set_experts_implementation("eager")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=0, rtol=0)
