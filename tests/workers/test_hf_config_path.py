"""`actor_rollout_ref.model.hf_config_path` (upstream's): another directory's config.json over the
weights of `model.path`, for every loader of the policy.

The config directory holds the bundled model's config with 2 of its 4 decoder layers and another
rope theta; the reference is transformers' own `from_pretrained(path, config=that config)` in float64.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.distributed_helpers import make_ppo_batch, one_thread, reference_response_log_probs
from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.utils.model import load_causal_lm, model_dir_with_config

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def _config_dir(path, generation_config: bool = True) -> str:
    """A directory with only a config.json: the bundled model's with 2 layers and rope theta 500
    (and, with `generation_config`, a generation_config.json of its own)."""
    os.makedirs(path)
    with open(os.path.join(bundled_model_path(), "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 2
    config["layer_types"] = config["layer_types"][:2]
    config["rope_parameters"]["rope_theta"] = 500.0
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if generation_config:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"max_new_tokens": 7, "eos_token_id": 3}, f)
    return str(path)


def _reference(config_dir: str):
    config = AutoConfig.from_pretrained(config_dir)
    return AutoModelForCausalLM.from_pretrained(bundled_model_path(), config=config, dtype=torch.float64).eval()


def test_the_model_directory_has_the_config_of_hf_config_path_and_the_weights_of_path(tmp_path):
    assert model_dir_with_config(bundled_model_path(), None) == bundled_model_path()
    config_dir = _config_dir(tmp_path / "config")
    model_dir = model_dir_with_config(bundled_model_path(), config_dir)
    assert model_dir_with_config(bundled_model_path(), config_dir) == model_dir  # made once, then reused
    files = set(os.listdir(model_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files

    model = load_causal_lm(model_dir, torch_dtype=torch.float64).eval()
    assert len(model.model.layers) == 2 and model.config.rope_parameters["rope_theta"] == 500.0
    assert model.generation_config.max_new_tokens == 7  # the generation config follows the config (upstream)
    full = load_causal_lm(bundled_model_path(), torch_dtype=torch.float64).eval()
    ids = torch.tensor([[2, 17, 40, 9, 101, 5]])
    with torch.no_grad():
        got, expected, four_layers = (m(input_ids=ids).logits for m in (model, _reference(config_dir), full))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert (got - four_layers).abs().max() > 1e-2

    # without a generation_config.json in the config directory, path's is not used either (upstream
    # derives it from the config)
    bare = model_dir_with_config(bundled_model_path(), _config_dir(tmp_path / "bare", generation_config=False))
    assert "generation_config.json" not in os.listdir(bare) and "config.json" in os.listdir(bare)


def test_a_config_directory_without_config_json_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref.model.hf_config_path=.* has no config.json"):
        model_dir_with_config(bundled_model_path(), str(tmp_path / "empty"))


def test_actor_reference_and_rollout_all_build_the_model_of_hf_config_path(one_process, tmp_path):
    from verl.trainer.config import load_ppo_config
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    config_dir = _config_dir(tmp_path / "config")
    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            f"actor_rollout_ref.model.hf_config_path={config_dir}",
            "trainer.n_gpus_per_node=1",
            "data.max_response_length=4",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.actor.use_kl_loss=true",  # builds the reference policy
        ],
        config_name="arith_demo",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    worker.init_model()
    for name, model in (("actor", worker.actor_model.module), ("ref", worker.ref_model.module)):
        assert len(model.model.layers) == 2, name
        assert model.config.rope_parameters["rope_theta"] == 500.0, name

    td = make_ppo_batch(batch_size=4, prompt_length=5, response_length=4, seed=1)
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": td["prompts"],
            "attention_mask": td["attention_mask"][:, :5],
            "position_ids": td["position_ids"][:, :5],
        },
        meta_info={"eos_token_id": 3, "pad_token_id": 0},
    )
    out = worker.generate_sequences(prompts)
    # the engine samples from the 2-layer model with the weights synced from the actor
    expected, _ = reference_response_log_probs(_reference(config_dir), out.batch)
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(
        out.batch["rollout_log_probs"].double()[mask], expected[mask], rtol=0, atol=1e-4, msg="rollout"
    )
    ref = worker.compute_ref_log_prob(out).batch["ref_log_prob"]
    torch.testing.assert_close(ref.double()[mask], expected[mask], rtol=0, atol=1e-4, msg="ref")


def _megatron_engine_builds_the_config_of_hf_config_path(rank, world_size, config_dir):
    from tests.megatron_helpers import setup_megatron
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    setup_megatron()
    engine = MegatronEngineWithLMHead({"path": bundled_model_path(), "hf_config_path": config_dir}, {})
    assert engine.hf_config.num_hidden_layers == 2 and engine.hf_config.rope_parameters["rope_theta"] == 500.0
    (chunk,) = engine.chunks
    assert len(chunk.decoder.layers) == 2
    assert chunk.rotary_pos_emb.inv_freq[1].item() == pytest.approx(500.0 ** (-2 / 64))


@pytest.mark.slow
def test_the_megatron_engine_builds_the_model_of_hf_config_path(tmp_path):
    from tests.distributed_helpers import run_distributed

    run_distributed(_megatron_engine_builds_the_config_of_hf_config_path, 1, _config_dir(tmp_path / "config"))
