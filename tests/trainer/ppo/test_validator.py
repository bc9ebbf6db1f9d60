"""The Validator's schedule, and the validation dump of its run() (the metrics of run() are covered
end to end by the trainer tests)."""

import json

import numpy as np
import torch
from omegaconf import OmegaConf

from verl.models.factory import build_tokenizer
from verl.protocol import DataProto
from verl.trainer.ppo.validator import Validator, due


def _validator(dataloader=(), reward_fn=print, **trainer):
    trainer = {"val_before_train": True, "test_freq": -1, **trainer}
    return Validator(OmegaConf.create(trainer), OmegaConf.create({}), dataloader, reward_fn, None, None)


def test_due_runs_every_freq_steps_and_on_the_last_step_and_never_when_disabled():
    assert [s for s in range(1, 8) if due(3, s, is_last=s == 7)] == [3, 6, 7]
    assert not any(due(0, s, is_last=True) for s in range(1, 5))
    assert not any(due(-1, s, is_last=True) for s in range(1, 5))


def test_should_validate_follows_test_freq_and_needs_data_and_a_reward_fn():
    v = _validator(test_freq=2)
    assert [s for s in range(1, 6) if v.should_validate(s, is_last=False)] == [2, 4]
    assert v.should_validate(5, is_last=True)
    assert not _validator(dataloader=None, test_freq=2).should_validate(2, is_last=False)
    assert not _validator(reward_fn=None, test_freq=2).should_validate(2, is_last=False)


def test_validation_before_training_follows_val_before_train_and_needs_data():
    assert _validator().should_validate_before_training()
    assert not _validator(val_before_train=False).should_validate_before_training()
    assert not _validator(dataloader=None).should_validate_before_training()


class _EchoGenerator:
    """A one-rank rollout that answers every prompt with the token ids of `answer`."""

    world_size = 1

    def __init__(self, tokenizer, answer: str):
        self.response = torch.tensor(tokenizer(answer, add_special_tokens=False)["input_ids"])

    def generate_sequences(self, gen: DataProto) -> DataProto:
        prompts = gen.batch["input_ids"]
        responses = self.response.expand(len(prompts), -1)
        input_ids = torch.cat([prompts, responses], dim=1)
        return DataProto.from_dict(
            {
                "prompts": prompts,
                "responses": responses,
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids),
            }
        )


def _exact_match_reward(batch: DataProto, return_dict: bool = False):
    """Score 1.0 on the last token when the response's text contains the row's ground truth."""
    texts = _TOKENIZER.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    truths = [r["ground_truth"] for r in batch.non_tensor_batch["reward_model"]]
    scores = [float(t in text) for text, t in zip(texts, truths, strict=True)]
    reward = torch.zeros(batch.batch["responses"].shape)
    reward[:, -1] = torch.tensor(scores)
    return {"reward_tensor": reward, "reward_extra_info": {"acc": scores, "pred": texts}}


_TOKENIZER = build_tokenizer("tiny")


def test_validation_data_dir_gets_one_jsonl_line_per_sample_with_upstreams_fields(tmp_path):
    prompts = ["1+1=", "2+3="]
    ids = _TOKENIZER(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    batch = {
        "input_ids": ids["input_ids"],
        "attention_mask": ids["attention_mask"],
        "position_ids": torch.arange(ids["input_ids"].shape[1]).expand(2, -1),
        "data_source": np.array(["arith", "arith"], dtype=object),
        "reward_model": np.array([{"ground_truth": "2"}, {"ground_truth": "5"}], dtype=object),
    }
    out_dir = tmp_path / "val"
    trainer = OmegaConf.create({"val_before_train": True, "test_freq": 1, "validation_data_dir": str(out_dir)})
    rollout = OmegaConf.create({"val_kwargs": {"n": 2, "do_sample": False}})
    v = Validator(trainer, rollout, [batch], _exact_match_reward, _EchoGenerator(_TOKENIZER, "2"), _TOKENIZER)

    metrics = v.run(step=7)

    lines = [json.loads(line) for line in (out_dir / "7.jsonl").read_text().splitlines()]
    # each prompt twice (val_kwargs.n=2, interleaved); the echo answer "2" is right for 1+1 only
    assert [row["gts"] for row in lines] == ["2", "2", "5", "5"]
    assert [row["score"] for row in lines] == [1.0, 1.0, 0.0, 0.0]
    assert [row["acc"] for row in lines] == [1.0, 1.0, 0.0, 0.0]
    assert all(row["step"] == 7 and row["output"].strip() == "2" == row["pred"].strip() for row in lines)
    assert [row["input"].replace(" ", "") for row in lines] == ["1+1=", "1+1=", "2+3=", "2+3="]
    assert metrics["val-core/arith/acc/mean@2"] == 0.5


def test_no_validation_dump_without_validation_data_dir(tmp_path):
    ids = _TOKENIZER(["1+1="], add_special_tokens=False, return_tensors="pt")
    batch = {
        "input_ids": ids["input_ids"],
        "attention_mask": ids["attention_mask"],
        "position_ids": torch.arange(ids["input_ids"].shape[1]).unsqueeze(0),
        "reward_model": np.array([{"ground_truth": "2"}], dtype=object),
    }
    trainer = OmegaConf.create({"val_before_train": True, "test_freq": 1, "validation_data_dir": None})
    rollout = OmegaConf.create({"val_kwargs": {"n": 1, "do_sample": False}})
    v = Validator(trainer, rollout, [batch], _exact_match_reward, _EchoGenerator(_TOKENIZER, "2"), _TOKENIZER)
    v.run(step=1)
    assert list(tmp_path.iterdir()) == []


def test_log_val_generations_keeps_the_pass_texts_for_the_trackers(tmp_path):
    prompts = ["1+1=", "2+3="]
    ids = _TOKENIZER(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    batch = {
        "input_ids": ids["input_ids"],
        "attention_mask": ids["attention_mask"],
        "position_ids": torch.arange(ids["input_ids"].shape[1]).expand(2, -1),
        "reward_model": np.array([{"ground_truth": "2"}, {"ground_truth": "5"}], dtype=object),
    }
    rollout = OmegaConf.create({"val_kwargs": {"n": 1, "do_sample": False}})
    trainer = OmegaConf.create({"val_before_train": True, "test_freq": 1, "log_val_generations": 1})
    v = Validator(trainer, rollout, [batch], _exact_match_reward, _EchoGenerator(_TOKENIZER, "2"), _TOKENIZER)
    v.run(step=1)
    inputs, outputs, scores = v.last_samples
    assert [i.replace(" ", "") for i in inputs] == prompts
    assert [o.strip() for o in outputs] == ["2", "2"] and scores == [1.0, 0.0]
    assert list(tmp_path.iterdir()) == []  # nothing dumped: validation_data_dir is not set
    quiet = OmegaConf.create({"val_before_train": True, "test_freq": 1, "log_val_generations": 0})
    v = Validator(quiet, rollout, [batch], _exact_match_reward, _EchoGenerator(_TOKENIZER, "2"), _TOKENIZER)
    v.run(step=1)
    assert v.last_samples is None
