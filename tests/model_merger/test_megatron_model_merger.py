"""`python -m verl.model_merger --backend megatron` on checkpoints MegatronCheckpointManager wrote at tp=2.

The checkpoints are written once per module by 2 gloo ranks (tp=2, which also pads the 263-token
vocabulary to 264): a causal LM with tied embeddings, saved with its Adam moments as training
saves it, one with an untied LM head, and a critic with a value head. They are merged by the CLI
in one process, as users run it. The reference for every
comparison is the HF model the megatron chunks were loaded from (`tests.megatron_helpers`, all
weights perturbed), so the whole round trip HF -> megatron shards -> dist_checkpointing -> merged
HF directory must be bit-exact.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, hf_state_dict, tiny_hf_model
from verl.model_merger.__main__ import main
from verl.models.factory import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODELS = {  # role -> (tie_word_embeddings, seed, value head)
    "actor": (True, 1, False),
    "untied": (False, 2, False),
    "critic": (True, 3, True),
}


def reference_model(role):
    tied, seed, _ = MODELS[role]
    return tiny_hf_model("qwen2", tie_word_embeddings=tied, num_layers=2, seed=seed)


def critic_reference_state(model) -> dict[str, torch.Tensor]:
    """The HF critic: the causal LM's body plus a perturbed [1, hidden] score head with bias."""
    state = {k: v for k, v in hf_state_dict(model).items() if not k.startswith("lm_head.")}
    generator = torch.Generator().manual_seed(7)
    state["score.weight"] = torch.randn(1, model.config.hidden_size, generator=generator)
    state["score.bias"] = torch.randn(1, generator=generator)
    return state


def _save(rank, world_size, root):
    from verl.models.mcore import load_hf_state_dict
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    for role, (_, _, value_head) in MODELS.items():
        model = reference_model(role)
        chunks = build_loaded_chunks(model, tp=2, value_head=value_head)
        if value_head:
            load_hf_state_dict(chunks, critic_reference_state(model), model.config, value_head=True)
        optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()])
        manager = MegatronCheckpointManager(
            chunks,
            optimizer,
            processing_class=build_tokenizer("tiny"),
            checkpoint_config={"save_contents": ["model", "optimizer", "extra"]},
            hf_config=model.config,
        )
        manager.save_checkpoint(os.path.join(root, "global_step_1", role), global_step=1)
        destroy_model_parallel()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_ckpt")
    run_distributed(_save, 2, str(root))
    return root


def cli(*args) -> subprocess.CompletedProcess:
    """`python -m verl.model_merger ARGS` as users run it. Not in this process: the merger sets up
    torch.distributed (gloo) here, and a pytest process that later forks the ranks of other tests
    must not have had gloo's threads running in it (a forked child can then hang in gloo)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "verl.model_merger", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def merge(ckpt, role, out, *extra, backend="megatron"):
    local_dir = ckpt / "global_step_1" / role
    proc = cli("merge", "--backend", backend, "--local_dir", str(local_dir), "--target_dir", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_tp2_checkpoint_merges_in_one_process_into_the_original_hf_weights_bit_exactly(ckpt, tmp_path):
    merge(ckpt, "actor", tmp_path / "hf")

    expected = hf_state_dict(reference_model("actor"))
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert stored.keys() == expected.keys(), "tied: lm_head stored once, as HF does; no padded vocabulary rows"
    for name, tensor in stored.items():
        assert torch.equal(tensor, expected[name]), name

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.shape[0] == 263
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.decode(tokenizer("What is 37+48?")["input_ids"]) == "What is 37+48?"
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference_model("actor")(input_ids=ids).logits)


@pytest.mark.slow
def test_untied_lm_head_is_merged_and_bf16_written_on_request(ckpt, tmp_path):
    merge(ckpt, "untied", tmp_path / "fp")
    merge(ckpt, "untied", tmp_path / "bf16", "--dtype", "bf16")
    expected = hf_state_dict(reference_model("untied"))
    assert "lm_head.weight" in expected
    stored = load_file(tmp_path / "fp" / "model.safetensors")
    assert stored.keys() == expected.keys()
    assert all(torch.equal(stored[k], expected[k]) for k in expected)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_critic_checkpoint_is_detected_and_becomes_a_one_label_token_classification_model(ckpt, tmp_path):
    merge(ckpt, "critic", tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and len(config["id2label"]) == 1
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    expected = critic_reference_state(reference_model("critic"))
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())


@pytest.mark.slow
def test_test_subcommand_compares_the_checkpoint_with_an_hf_directory(ckpt, tmp_path):
    reference = reference_model("actor")
    reference.save_pretrained(tmp_path / "ref")
    actor = str(ckpt / "global_step_1" / "actor")
    proc = cli("test", "--backend", "megatron", "--local_dir", actor, "--test_hf_dir", str(tmp_path / "ref"))
    assert proc.returncode == 0 and "test passed" in proc.stdout, proc.stderr[-3000:]

    other = reference_model("untied")  # same architecture, other weights
    other.config.tie_word_embeddings = True
    other.save_pretrained(tmp_path / "other")
    proc = cli("test", "--backend", "megatron", "--local_dir", actor, "--test_hf_dir", str(tmp_path / "other"))
    assert proc.returncode == 2 and "model.layers.1.mlp.up_proj.weight: values differ" in proc.stderr


def test_megatron_checkpoint_given_to_fsdp_or_a_wrong_directory_says_what_to_pass_instead(ckpt, tmp_path, capsys):
    def error_for(local_dir, backend):
        with pytest.raises(SystemExit):
            main(["merge", "--backend", backend, "--local_dir", str(local_dir), "--target_dir", str(tmp_path / "o")])
        return capsys.readouterr().err

    actor = ckpt / "global_step_1" / "actor"
    assert "merge it with --backend megatron" in error_for(actor, "fsdp")
    assert "--local_dir " + str(actor) in error_for(ckpt / "global_step_1", "megatron")
    assert "does not exist" in error_for(tmp_path / "nope", "megatron")
    assert not (tmp_path / "o").exists()
