"""HFRollout: the DataProto contract of `generate_sequences` (layout, masks, positions, sample
counts, validation sampling, log-probs), config handling, and loading from a checkpoint directory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.config_helpers import engine_config, section
from tests.workers.rollout.rollout_helpers import build_model, hf_greedy_loop, left_padded_prompts
from verl.protocol import DataProto
from verl.workers.config import RolloutConfig
from verl.workers.rollout import get_rollout_class
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.hf_rollout import HFRollout

EOS, PAD = 2, 0
LENGTHS = [6, 2, 4, 5]
R = 10


def _prompts(lengths=LENGTHS, seed=0, uids=None, **meta):
    input_ids, attention_mask = left_padded_prompts(lengths, seed=seed)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    uids = uids if uids is not None else [f"u{i}" for i in range(len(lengths))]
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors={"uid": uids, "data_source": ["arith"] * len(lengths)},
        meta_info={"eos_token_id": EOS, "pad_token_id": PAD, **meta},
    )


def _rollout(model, **config):
    return HFRollout(model, engine_config(response_length=R, **config), device="cpu")


def test_registered_as_hf_and_implements_base_rollout():
    assert get_rollout_class("hf") is HFRollout and issubclass(HFRollout, BaseRollout)
    with pytest.raises(ValueError, match="choose one of"):
        get_rollout_class("nope")


def test_output_layout_masks_and_positions(qwen2_model):
    prompts = _prompts(do_sample=False, custom="kept")
    out = _rollout(qwen2_model).generate_sequences(prompts)
    b = out.batch
    B, P = prompts.batch["input_ids"].shape
    assert b["prompts"].shape == (B, P) and b["responses"].shape == (B, R)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert b[key].shape == (B, P + R)
    assert b["response_mask"].shape == (B, R)
    assert torch.equal(b["prompts"], prompts.batch["input_ids"])
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    assert torch.equal(b["attention_mask"], torch.cat([prompts.batch["attention_mask"], b["response_mask"]], 1))
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(b["position_ids"][:, P:], last + torch.arange(1, R + 1))

    reference = hf_greedy_loop(qwen2_model, prompts.batch["input_ids"], prompts.batch["attention_mask"], R)
    for row in range(B):
        hits = (reference[row] == EOS).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else R  # EOS kept and masked 1
        assert b["responses"][row, :stop].tolist() == reference[row, :stop].tolist()
        assert b["responses"][row, stop:].eq(PAD).all()
        assert b["response_mask"][row].tolist() == [1] * stop + [0] * (R - stop)
    finished_early = (b["response_mask"] == 0).any(-1)
    assert finished_early.any() and not finished_early.all()  # the EOS cases are exercised
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3"]
    assert out.meta_info["custom"] == "kept" and out.meta_info["timing"]["generate_sequences"] > 0


def test_rollout_log_probs_match_the_trainers_recomputation(qwen2_model):
    rollout = _rollout(qwen2_model, calculate_log_probs=True, temperature=0.7)
    out = rollout.generate_sequences(_prompts(temperature=0.7))
    b = out.batch
    P = b["prompts"].shape[1]
    with torch.no_grad():
        logits = qwen2_model(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    ref = (logits[:, P - 1 : -1].double() / 0.7).log_softmax(-1).gather(-1, b["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(b["rollout_log_probs"].double(), ref * b["response_mask"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"])
def test_logprobs_mode_chooses_what_reaches_rollout_log_probs(qwen2_model, mode):
    rollout = _rollout(qwen2_model, calculate_log_probs=True, temperature=0.7, top_k=5, logprobs_mode=mode)
    b = rollout.generate_sequences(_prompts()).batch
    P = b["prompts"].shape[1]
    with torch.no_grad():
        logits = qwen2_model(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    values = logits[:, P - 1 : -1].double()  # the model's own (raw) logits at each response position
    if mode.startswith("processed"):  # temperature, then top-k: the 5 largest stay, the rest -inf
        values = values / 0.7
        fifth = values.topk(5, dim=-1).values[..., -1:]
        values = values.masked_fill(values < fifth, float("-inf"))
    if mode.endswith("logprobs"):
        values = values.log_softmax(-1)
    ref = values.gather(-1, b["responses"][..., None]).squeeze(-1).masked_fill(b["response_mask"] == 0, 0.0)
    torch.testing.assert_close(b["rollout_log_probs"].double(), ref, atol=1e-4, rtol=0)


def test_unrepeated_batch_is_repeated_n_times_interleaved(qwen2_model):
    out = _rollout(qwen2_model, n=3).generate_sequences(_prompts())
    assert len(out) == 12
    assert list(out.non_tensor_batch["uid"][:6]) == ["u0"] * 3 + ["u1"] * 3
    assert torch.equal(out.batch["prompts"][0], out.batch["prompts"][2])
    assert not torch.equal(out.batch["responses"][0:3], out.batch["responses"][0:1].expand(3, -1)), "samples all equal"


def test_batch_repeated_by_the_driver_is_not_repeated_again(qwen2_model):
    prompts = _prompts().repeat(3, interleave=True)
    assert len(_rollout(qwen2_model, n=3).generate_sequences(prompts)) == 12
    # meta_info["n"] is explicit and wins
    assert len(_rollout(qwen2_model, n=3).generate_sequences(_prompts(n=2))) == 8


def test_validation_uses_val_kwargs_and_greedy_draws_one_sample(qwen2_model):
    rollout = _rollout(qwen2_model, n=4, temperature=1.5, val_kwargs={"temperature": 0, "n": 1})
    prompts = _prompts(validate=True)
    greedy = _rollout(qwen2_model).generate_sequences(_prompts(do_sample=False))
    for _ in range(2):
        out = rollout.generate_sequences(prompts)
        assert torch.equal(out.batch["responses"], greedy.batch["responses"])
    # sampled validation (val_kwargs.do_sample) still draws
    sampled = _rollout(qwen2_model, val_kwargs={"temperature": 1.0, "do_sample": True, "n": 2})
    assert len(sampled.generate_sequences(prompts)) == 8


def test_large_batches_generate_in_chunks_with_identical_results(qwen2_model):
    prompts = _prompts(do_sample=False)
    whole = _rollout(qwen2_model).generate_sequences(prompts)
    chunked = _rollout(qwen2_model, max_num_seqs=3).generate_sequences(prompts)
    assert torch.equal(whole.batch["responses"], chunked.batch["responses"])


def test_a_dict_or_dictconfig_section_becomes_the_rollout_config_with_the_yaml_defaults(qwen2_model):
    from omegaconf import OmegaConf

    yaml = section("actor_rollout_ref.rollout")
    raw = {"name": "hf", "dtype": "auto", "temperature": 0.5, "val_kwargs": {"top_p": 0.7}}
    for config in (raw, OmegaConf.create(raw)):
        rollout = HFRollout(qwen2_model, config, device="cpu")
        assert isinstance(rollout.config, RolloutConfig)
        assert rollout.config.temperature == 0.5 and rollout.config.val_kwargs.top_p == 0.7
        # keys the section leaves out take the YAML's values (here the validation temperature 0 and max_num_seqs 256)
        assert rollout.config.val_kwargs.temperature == yaml["val_kwargs"]["temperature"] == 0
        assert rollout.config.max_num_seqs == yaml["max_num_seqs"] == 256
    with pytest.raises(ValueError, match="unknown key.*'temprature'"):
        HFRollout(qwen2_model, {"temprature": 0.5}, device="cpu")
    with pytest.raises(ValueError, match="rollout.response_length=0 must be a positive integer"):
        engine_config(response_length=0)


def test_loads_a_checkpoint_directory_and_defaults_token_ids_from_its_config(qwen2_model, tmp_path):
    qwen2_model.save_pretrained(tmp_path)
    from_dir = HFRollout(str(tmp_path), engine_config(response_length=R), device="cpu")
    prompts = _prompts(do_sample=False)
    prompts.meta_info = {"do_sample": False}  # eos/pad come from the model config (2 and 0)
    out = from_dir.generate_sequences(prompts)
    expected = _rollout(qwen2_model).generate_sequences(_prompts(do_sample=False))
    assert torch.equal(out.batch["responses"], expected.batch["responses"])


def test_sleep_wake_and_sync_through_the_rollout_interface(qwen2_model):
    rollout = _rollout(qwen2_model)
    prompts = _prompts(do_sample=False)
    before = rollout.generate_sequences(prompts).batch["responses"]
    rollout.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        rollout.generate_sequences(prompts)
    rollout.wake_up()
    metrics = rollout.update_weights(qwen2_model.named_parameters())
    assert set(metrics) == {"timing_s/update_weights"}
    assert torch.equal(rollout.generate_sequences(prompts).batch["responses"], before)
    rollout.release()
    assert rollout.engine.memory_bytes() == {"weights": 0, "kv_cache": 0}


def test_missing_pad_token_is_explained():
    model = build_model("qwen2", eos_token_id=None, pad_token_id=None)
    prompts = _prompts(do_sample=False)
    prompts.meta_info = {"do_sample": False}
    with pytest.raises(ValueError, match="pad_token_id"):
        _rollout(model).generate_sequences(prompts)


def test_non_tensor_columns_follow_repetition(qwen2_model):
    prompts = _prompts(uids=np.array(["a", "b", "c", "d"], dtype=object))
    out = _rollout(qwen2_model, n=2).generate_sequences(prompts)
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert list(out.non_tensor_batch["data_source"]) == ["arith"] * 8


def test_cuda_graphs_speed_path_is_not_asked_for_on_cpu(qwen2_model):
    from verl.utils.speed_paths import SpeedPath

    for model in (qwen2_model, build_model("gpt2")):
        assert _rollout(model).speed_paths() == [
            SpeedPath("cuda_graphs", False, False, "the rollout runs on cpu, which has no CUDA graphs")
        ]
