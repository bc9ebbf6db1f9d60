"""`python -m verl.model_merger` on checkpoints that FSDPCheckpointManager wrote from 2 gloo ranks.

The checkpoints are built once per module (one fork of 2 ranks, three models) and merged in this
single process, where torch.distributed is never initialised. The reference for every comparison
is the full state dict the ranks themselves gathered after training (`get_full_state_dict`).
"""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from tests.distributed_helpers import make_ppo_batch, make_tiny_causal_lm, make_tiny_value_model, run_distributed
from verl.model_merger.__main__ import main
from verl.models.factory import build_tokenizer
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict


def _train_and_save(rank, world_size, root):
    models = {
        "actor": make_tiny_causal_lm(seed=1, dtype=torch.float32),
        "untied": make_tiny_causal_lm(seed=2, dtype=torch.float32, tie_word_embeddings=False),
        "critic": make_tiny_value_model(seed=3, dtype=torch.float32),
    }
    for role, model in models.items():
        model = apply_fsdp2(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # one real step, so the weights differ from any freshly initialised model
        batch = make_ppo_batch(batch_size=4, seed=rank)
        model(input_ids=batch["input_ids"], use_cache=False).logits.square().mean().backward()
        optimizer.step()
        contents = ["model", "optimizer", "extra"] + (["hf_model"] if role == "actor" else [])
        manager = FSDPCheckpointManager(
            model,
            optimizer,
            processing_class=build_tokenizer("tiny"),
            checkpoint_config={"save_contents": contents},
        )
        manager.save_checkpoint(os.path.join(root, "global_step_1", role), global_step=1)
        full = get_full_state_dict(model)
        if rank == 0:
            torch.save(full, os.path.join(root, f"full_{role}.pt"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    torch.set_num_threads(1)
    run_distributed(_train_and_save, 2, str(root))
    return root


def merge(ckpt, role, out, *extra, backend="fsdp"):
    main(
        [
            "merge",
            "--backend",
            backend,
            "--local_dir",
            str(ckpt / "global_step_1" / role),
            "--target_dir",
            str(out),
            *extra,
        ]
    )


def full_state(ckpt, role):
    return torch.load(ckpt / f"full_{role}.pt")


def test_two_rank_checkpoint_merges_in_one_process_into_an_hf_dir_equal_to_the_trained_weights(ckpt, tmp_path):
    merge(ckpt, "actor", tmp_path / "hf")
    assert not dist.is_initialized()
    files = set(os.listdir(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors"), "tied: stored once, as HF does"

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected = full_state(ckpt, "actor")
    assert model.dtype == torch.float32 and model.state_dict().keys() == expected.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight

    # the tokenizer and generation config are the checkpoint's own files
    ckpt_hf = ckpt / "global_step_1" / "actor" / "huggingface"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (ckpt_hf / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.decode(tokenizer("What is 37+48?")["input_ids"]) == "What is 37+48?"


def test_merging_into_the_checkpoints_own_huggingface_dir_keeps_its_tokenizer_and_adds_the_weights(ckpt, tmp_path):
    # verl-recipe char_count's README: merge --local_dir $CKPT_PATH --target_dir $CKPT_PATH/huggingface/
    local = tmp_path / "global_step_1"
    shutil.copytree(ckpt / "global_step_1" / "actor", local)
    tokenizer_before = (local / "huggingface" / "tokenizer.json").read_bytes()
    main(["merge", "--backend", "fsdp", "--local_dir", str(local), "--target_dir", f"{local}/huggingface/"])

    assert (local / "huggingface" / "tokenizer.json").read_bytes() == tokenizer_before
    model = AutoModelForCausalLM.from_pretrained(local / "huggingface")
    expected = full_state(ckpt, "actor")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_untied_head_is_kept_and_bf16_is_written_on_request(ckpt, tmp_path):
    merge(ckpt, "untied", tmp_path / "fp", "--dtype", "auto")
    merge(ckpt, "untied", tmp_path / "bf16", "--dtype", "bf16")
    expected = full_state(ckpt, "untied")
    assert not torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])
    stored = load_file(tmp_path / "fp" / "model.safetensors")
    assert stored.keys() == expected.keys()
    assert all(torch.equal(stored[k], expected[k]) for k in expected)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_critic_checkpoint_becomes_a_token_classification_model(ckpt, tmp_path):
    merge(ckpt, "critic", tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and len(config["id2label"]) == 1
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    expected = full_state(ckpt, "critic")
    assert model.state_dict().keys() == expected.keys() and "score.weight" in expected
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())
    # values of the merged critic are those of the trained one
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = make_tiny_value_model(dtype=torch.float32)
    reference.load_state_dict(expected)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_test_subcommand_passes_on_the_checkpoints_own_hf_export_and_names_a_changed_tensor(ckpt, tmp_path, capsys):
    actor = ckpt / "global_step_1" / "actor"
    main(["test", "--backend", "fsdp", "--local_dir", str(actor), "--test_hf_dir", str(actor / "huggingface")])
    assert "test passed" in capsys.readouterr().out

    changed = tmp_path / "changed"
    shutil.copytree(actor / "huggingface", changed)
    weights = load_file(changed / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] += 1e-3
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--backend", "fsdp", "--local_dir", str(actor), "--test_hf_dir", str(changed)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.layers.1.mlp.up_proj.weight: values differ" in err and "model.norm.weight" not in err


def test_a_directory_that_is_not_a_checkpoint_says_which_files_are_expected(ckpt, tmp_path, capsys):
    def error_for(local_dir):
        with pytest.raises(SystemExit):
            main(["merge", "--backend", "fsdp", "--local_dir", str(local_dir), "--target_dir", str(tmp_path / "o")])
        return capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    err = error_for(tmp_path / "empty")
    assert "is not an FSDP checkpoint" in err and "model/" in err and ".metadata" in err and "huggingface/" in err
    assert "--local_dir " + str(ckpt / "global_step_1" / "actor") in error_for(ckpt / "global_step_1")
    assert "does not exist" in error_for(tmp_path / "nope")
    assert not (tmp_path / "o").exists()


def test_tying_weights_the_checkpoint_does_not_share_is_refused(ckpt, tmp_path, capsys):
    with pytest.raises(SystemExit):
        merge(ckpt, "untied", tmp_path / "o", "--tie-word-embedding")
    assert "holds different tensors" in capsys.readouterr().err


def test_fsdp_checkpoint_given_to_the_megatron_backend_says_to_use_fsdp(ckpt, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        merge(ckpt, "actor", tmp_path / "o", backend="megatron")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "is not a megatron checkpoint" in err and "--backend fsdp" in err
    assert not (tmp_path / "o").exists()
