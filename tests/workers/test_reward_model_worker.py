"""The reward-model workers score what the HF sequence classifier scores: the FSDP backend's worker
and the megatron one at tp=2, pp=2 and cp=2, on the policy's token ids, after re-tokenising with the
reward model's own tokenizer and chat template, and cut to reward_model.max_length. The reference scores each row alone, unpadded, in
float64; the score sits on each row's last response token and nowhere else."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.workers.config import RewardModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _make_reward_model(path, other_template: bool = False) -> None:
    """A Qwen2 sequence classifier on the bundled model's body, with a random, large score head, and
    the bundled tokenizer (with `other_template`, under another chat template)."""
    from pathlib import Path

    path = Path(path)
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(bundled_model_path())
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.mul_(50.0)  # scores of order 1, so that a wrong pooled token shows
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{bundled_model_path()}/{name}", path)
    if other_template:  # the policy's ids then are not this model's input: responses are re-rendered
        (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")


def _data() -> DataProto:
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=3)
    raw = np.empty(8, dtype=object)
    for i in range(8):
        raw[i] = [{"role": "user", "content": f"What is {i} + {i + 1}?"}]
    return DataProto.from_dict(tensors=dict(td.items()), non_tensors={"raw_prompt": raw})


@torch.no_grad()
def _reference(path, data: DataProto, retokenize: bool, keep_last: int | None = None) -> torch.Tensor:
    """[B] float64 scores, one row at a time without padding (`keep_last`: its last tokens only)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).double().eval()
    tok = AutoTokenizer.from_pretrained(path)
    scores = []
    for i in range(len(data)):
        if retokenize:
            response = data.batch["responses"][i][data.batch["response_mask"][i].bool()]
            chat = [
                *data.non_tensor_batch["raw_prompt"][i],
                {"role": "assistant", "content": tok.decode(response, skip_special_tokens=True)},
            ]
            ids = torch.tensor(
                tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
            )
        else:
            ids = data.batch["input_ids"][i][data.batch["attention_mask"][i].bool()]
        if keep_last is not None:
            ids = ids[-keep_last:]
        scores.append(model(input_ids=ids[None]).logits[0, 0])
    return torch.stack(scores)


def _config(
    path, strategy: str, retokenize: bool, tp: int = 1, pp: int = 1, max_length: int | None = None, cp: int = 1
):
    from verl.trainer.config import load_ppo_config

    overrides = [
        "reward_model.enable=true",
        f"reward_model.strategy={strategy}",
        f"reward_model.model.path={path}",
        "reward_model.micro_batch_size_per_gpu=3",  # uneven micro-batches
        f"reward_model.model.input_tokenizer={bundled_model_path() if retokenize else 'null'}",
        "trainer.n_gpus_per_node=2",
        f"reward_model.max_length={max_length or 'null'}",
    ]
    if strategy == "megatron":  # the megatron composition holds reward_model.megatron
        # the actor takes the same layout, so the reward model shares the actor's worker processes
        for section in ("reward_model", "actor_rollout_ref.actor", "actor_rollout_ref.ref"):
            overrides += [
                f"{section}.megatron.tensor_model_parallel_size={tp}",
                f"{section}.megatron.pipeline_model_parallel_size={pp}",
                f"{section}.megatron.context_parallel_size={cp}",
            ]
    name = "arith_demo_megatron" if strategy == "megatron" else "arith_demo"
    return load_ppo_config(overrides, config_name=name).reward_model


def _check(scores: DataProto, data: DataProto, expected: torch.Tensor, what: str) -> None:
    rm_scores = scores.batch["rm_scores"]
    mask = data.batch["response_mask"]
    last = mask.sum(-1) - 1
    rows = torch.arange(len(data))
    # float32 workers against a float64 reference, scores up to ~30: about 1e-5 of rounding
    torch.testing.assert_close(rm_scores[rows, last].double(), expected, atol=5e-5, rtol=0, msg=what)
    rm_scores[rows, last] = 0
    assert not rm_scores.any(), f"{what}: scores outside the last response token"


def _score_everywhere(rank, world_size, same_path, other_path):
    from verl.utils.megatron.parallel_state import destroy_model_parallel
    from verl.workers import fsdp_workers, megatron_workers

    data = _data()
    expected = {False: _reference(same_path, data, False), True: _reference(other_path, data, True)}
    assert expected[False].abs().max() > 0.1 and not torch.allclose(expected[False], expected[True])

    # the policy's tokenizer is the reward model's: its ids are scored as they are, no raw_prompt needed
    worker = fsdp_workers.RewardModelWorker(_config(same_path, "fsdp", True))
    # the section is built once into upstream's typed class, which the worker reads
    assert type(worker.config) is RewardModelConfig and worker.config.micro_batch_size_per_gpu == 3
    worker.init_model()
    assert worker.input_tokenizer is None
    plain = DataProto.from_dict(tensors=dict(data.batch.items()))
    half = plain.chunk(world_size)[rank]
    _check(worker.compute_rm_score(half), half, expected[False].chunk(world_size)[rank], "same tokenizer")
    worker = fsdp_workers.RewardModelWorker(_config(other_path, "fsdp", True))
    worker.init_model()
    with pytest.raises(ValueError, match="data.return_raw_chat=true"):
        worker.compute_rm_score(half)

    for retokenize in (False, True):
        path = other_path if retokenize else same_path
        # FSDP backend: data-parallel, each rank scores its half
        worker = fsdp_workers.RewardModelWorker(_config(path, "fsdp", retokenize))
        worker.init_model()
        half = data.chunk(world_size)[rank]
        _check(worker.compute_rm_score(half), half, expected[retokenize].chunk(world_size)[rank], f"fsdp {retokenize}")
        # megatron backend: one model copy over both ranks, every rank sees the whole batch
        for tp, pp, cp in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
            worker = megatron_workers.RewardModelWorker(_config(path, "megatron", retokenize, tp, pp, cp=cp))
            assert (worker.config.megatron.tensor_model_parallel_size, worker.config.nccl_timeout) == (tp, 600)
            worker.init_model()
            what = f"megatron tp={tp} pp={pp} cp={cp} {retokenize}"
            _check(worker.compute_rm_score(data), data, expected[retokenize], what)
            destroy_model_parallel()

    # reward_model.max_length: a longer row keeps its last tokens (the response), on both backends
    cut = _reference(same_path, data, False, keep_last=6)
    assert not torch.allclose(cut, expected[False])
    worker = fsdp_workers.RewardModelWorker(_config(same_path, "fsdp", False, max_length=6))
    worker.init_model()
    half = data.chunk(world_size)[rank]
    _check(worker.compute_rm_score(half), half, cut.chunk(world_size)[rank], "fsdp max_length")
    worker = megatron_workers.RewardModelWorker(_config(same_path, "megatron", False, 2, 1, max_length=6))
    worker.init_model()
    _check(worker.compute_rm_score(data), data, cut, "megatron max_length")
    destroy_model_parallel()


def test_reward_model_workers_score_like_the_hf_classifier(tmp_path):
    _make_reward_model(tmp_path / "rm")
    _make_reward_model(tmp_path / "rm_other_template", other_template=True)
    run_distributed(_score_everywhere, 2, str(tmp_path / "rm"), str(tmp_path / "rm_other_template"))


@torch.no_grad()
def test_reward_model_override_config_changes_the_model_the_worker_scores_with(tmp_path, one_process):
    """reward_model.model.override_config edits the reward model's HF config before its weights load
    (here: only its first decoder layer is built), so the scores are those of the edited model."""
    from transformers import AutoModelForSequenceClassification

    from verl.trainer.config import load_ppo_config
    from verl.workers import fsdp_workers

    path = tmp_path / "rm"
    _make_reward_model(path)
    cfg = load_ppo_config(
        [
            "reward_model.enable=true",
            f"reward_model.model.path={path}",
            "reward_model.model.input_tokenizer=null",
            "+reward_model.model.override_config.num_hidden_layers=1",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo",
    ).reward_model
    worker = fsdp_workers.RewardModelWorker(cfg)
    worker.init_model()
    assert worker.model.config.num_hidden_layers == 1 and len(worker.model.model.layers) == 1

    data = _data()
    one_layer = AutoModelForSequenceClassification.from_pretrained(path, num_hidden_layers=1).double().eval()
    full = _reference(path, data, retokenize=False)
    expected = []
    for i in range(len(data)):
        ids = data.batch["input_ids"][i][data.batch["attention_mask"][i].bool()]
        expected.append(one_layer(input_ids=ids[None]).logits[0, 0])
    expected = torch.stack(expected)
    assert (expected - full).abs().max() > 0.1, "the override must change the scores for this test to mean anything"
    _check(worker.compute_rm_score(data), data, expected, "override_config num_hidden_layers=1")


def _megatron_scores_with_override(rank, world_size, path):
    from transformers import AutoModelForSequenceClassification

    from verl.trainer.config import load_ppo_config
    from verl.utils.megatron.parallel_state import destroy_model_parallel
    from verl.workers import megatron_workers

    cfg = load_ppo_config(
        [
            "reward_model.enable=true",
            "reward_model.strategy=megatron",
            f"reward_model.model.path={path}",
            "reward_model.model.input_tokenizer=null",
            "+reward_model.model.override_config.num_hidden_layers=1",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo_megatron",
    ).reward_model
    worker = megatron_workers.RewardModelWorker(cfg)
    worker.init_model()
    assert worker.reward_model.hf_config.num_hidden_layers == 1
    data = _data()
    one_layer = AutoModelForSequenceClassification.from_pretrained(path, num_hidden_layers=1).double().eval()
    with torch.no_grad():
        expected = torch.stack(
            [
                one_layer(input_ids=ids[mask.bool()][None]).logits[0, 0]
                for ids, mask in zip(data.batch["input_ids"], data.batch["attention_mask"], strict=True)
            ]
        )
    _check(worker.compute_rm_score(data), data, expected, "megatron override_config num_hidden_layers=1")
    destroy_model_parallel()


@pytest.mark.slow
def test_megatron_reward_model_override_config_changes_the_model_it_scores_with(tmp_path):
    _make_reward_model(tmp_path / "rm")
    run_distributed(_megatron_scores_with_override, 1, str(tmp_path / "rm"))
