"""`python -m verl.model_merger` on a mixture-of-experts checkpoint (tiny-moe: 3-D expert tensors
sharded by FSDP2 over 2 gloo ranks): the merged HF directory loads into Qwen3MoeForCausalLM with
the weights the ranks gathered after training, and the model config keeps its expert layout."""

import json
import os

import torch
from transformers import AutoModelForCausalLM

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.model_merger.test_fsdp_model_merger import merge
from verl.models.factory import build_model
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict


def _train_and_save(rank, world_size, root):
    model, tokenizer = build_model("tiny-moe", seed=4)
    model = apply_fsdp2(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0] == 2, "experts split over 2 ranks"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_ppo_batch(batch_size=4, seed=rank)
    model(input_ids=batch["input_ids"], use_cache=False).logits.square().mean().backward()
    optimizer.step()
    manager = FSDPCheckpointManager(
        model, optimizer, processing_class=tokenizer, checkpoint_config={"save_contents": ["model", "hf_model"]}
    )
    manager.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1)
    full = get_full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(root, "full_actor.pt"))


def test_moe_checkpoint_from_two_ranks_merges_into_a_qwen3_moe_directory_with_the_trained_weights(tmp_path):
    root = tmp_path / "ckpt"
    torch.set_num_threads(1)
    run_distributed(_train_and_save, 2, str(root))
    merge(root, "actor", tmp_path / "hf")

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # both names of the expert count: transformers 5 reads num_local_experts, 4.x (pinned engines) num_experts
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == config["num_local_experts"] == 4
    assert config["num_experts_per_tok"] == 2
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    expected = torch.load(root / "full_actor.pt")
    assert model.state_dict().keys() == expected.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    fresh, _ = build_model("tiny-moe", seed=4)
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(expected[experts], fresh.state_dict()[experts]), "the step must have moved the experts"
