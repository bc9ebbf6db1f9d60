"""Upstream's batch-level engine interface (`verl.workers.engine.batch_api`) on the Megatron engine, on 2
gloo ranks, fp32, in each layout the ranks allow: tensor parallel 2, two data-parallel replicas (tp=1),
pipeline parallel 2 (also with two virtual stages), context parallel 2; tp=2 runs sequence parallel
(the config's default).

Checked in every layout against references computed apart from megatron: `infer_batch`'s log-probs and
entropy (temperature 0.7) equal each row run alone through the HF model; `train_batch`'s gradient norm
and loss equal a float64 autograd reference of the whole batch's PPO loss and the FSDP engine's on the
same batch (so every layout equals every other); the value engine's values equal the HF token classifier
holding the engine's own exported weights, row by row, and its gradient norm under a loss on the values
that classifier's."""

from __future__ import annotations

import functools

import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import make_ppo_batch, reference_response_log_probs, run_distributed
from tests.workers.engine.test_engine_batch_api import _engine as fsdp_engine
from tests.workers.engine.test_engine_batch_api import _packed, _reference_grad_norm
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

LAYOUTS = [
    {"tensor_model_parallel_size": 2},
    {"tensor_model_parallel_size": 1},  # two data-parallel replicas, each given half the rows
    {"pipeline_model_parallel_size": 2},
    {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
    {"context_parallel_size": 2},
]
OPTIM = {"lr": 1e-3, "clip_grad": 1.0}
TEMPERATURE = 0.7


def _loss_fn():
    return functools.partial(
        ppo_loss, config=ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    )


def _rl_batch():
    batch = make_ppo_batch(batch_size=6, prompt_length=4, response_length=5, seed=2)
    g = torch.Generator().manual_seed(5)
    batch["old_log_probs"] = -torch.rand(6, 5, generator=g) - 3.0
    batch["advantages"] = torch.rand(6, 5, generator=g)
    return batch


def _layout(path, sizes: dict, batch, expected: dict) -> None:
    from verl.utils.megatron.parallel_state import destroy_model_parallel
    from verl.workers.engine import MegatronEngineWithLMHead

    meg = {"seed": 7, "dtype": "float32", **sizes}
    dp_size = MegatronEngineWithLMHead.init_parallel(meg)
    engine = MegatronEngineWithLMHead(OmegaConf.create({"path": path}), meg, OPTIM)
    assert engine.get_data_parallel_size() == dp_size
    # each replica its rows (2 replicas: alternate rows), every rank of a replica the same ones
    rows = list(range(engine.get_data_parallel_rank(), len(batch), dp_size))
    mine = batch[rows]
    where = f"layout {sizes}"

    data = _packed(
        mine, use_dynamic_bsz=True, max_token_len_per_gpu=10, temperature=TEMPERATURE, calculate_entropy=True
    )
    with engine.eval_mode():
        out = engine.infer_batch(data)
    mask = mine["response_mask"].bool()
    if engine.is_mp_src_rank_with_outputs():
        log_probs = no_padding_2_padding(out["model_output"]["log_probs"], data)
        entropy = no_padding_2_padding(out["model_output"]["entropy"], data)
        ref_lp, ref_ent = expected["log_probs"][rows], expected["entropy"][rows]
        torch.testing.assert_close(log_probs[mask].double(), ref_lp[mask], atol=2e-5, rtol=0, msg=where)
        torch.testing.assert_close(entropy[mask].double(), ref_ent[mask], atol=2e-5, rtol=0, msg=where)
    elif sizes.get("pipeline_model_parallel_size"):  # the first stage has no outputs to report
        assert out["model_output"] == {} and out["loss"] == []

    # one micro-batch per replica: the interleaved schedule halves it (the loss gets the rows it ran)
    settings = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 6}
    with engine.train_mode():
        out = engine.train_batch(_packed(mine, **settings), loss_function=_loss_fn())
    if engine.is_mp_src_rank_with_outputs():
        assert out["metrics"]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), where
        assert out["metrics"]["grad_norm"] == pytest.approx(expected["fsdp_grad_norm"], rel=1e-4), where
        loss = torch.tensor(sum(out["loss"]), dtype=torch.float64)
        torch.distributed.all_reduce(loss, group=engine.get_data_parallel_group())
        # each replica's loss is its share of the batch's times dp_size: their mean is the batch's
        assert float(loss) / dp_size == pytest.approx(expected["fsdp_loss"], rel=1e-5), where
    destroy_model_parallel()


def _value_model(path, batch) -> None:
    from transformers import AutoModelForTokenClassification

    from verl.utils.megatron.parallel_state import destroy_model_parallel
    from verl.workers.engine import MegatronEngineWithValueHead

    meg = {"seed": 7, "dtype": "float32", "tensor_model_parallel_size": 2}
    MegatronEngineWithValueHead.init_parallel(meg)
    engine = MegatronEngineWithValueHead(OmegaConf.create({"path": path}), meg, OPTIM)
    data = _packed(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    with engine.eval_mode():
        out = engine.infer_batch(data)
    weights = dict(engine.iter_hf_params())  # a collective: every rank
    if engine.is_mp_src_rank_with_outputs():
        values = no_padding_2_padding(out["model_output"]["values"], data)
        hf = AutoModelForTokenClassification.from_pretrained(path, num_labels=1)
        missing, unexpected = hf.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        with torch.no_grad():
            for i in range(len(batch)):
                keep = batch["attention_mask"][i].bool()
                alone = hf(input_ids=batch["input_ids"][i][keep][None]).logits[0, :, 0]
                n = int(batch["response_mask"][i].sum())
                torch.testing.assert_close(values[i, :n], alone[-n - 1 : -1], atol=1e-5, rtol=0)

    def squares(model_output, data, dp_group=None):  # a loss on every token's value
        loss = model_output["values"].values().pow(2).sum() * 0.01
        return loss, {}

    out = engine.train_batch(data, loss_function=squares)
    if engine.is_mp_src_rank_with_outputs():
        hf.zero_grad()
        total = sum(
            hf(input_ids=batch["input_ids"][i][batch["attention_mask"][i].bool()][None]).logits.pow(2).sum() * 0.01
            for i in range(len(batch))
        )
        total.backward()
        expected = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None)))
        assert out["metrics"]["grad_norm"] == pytest.approx(expected, rel=1e-4)
        assert sum(out["loss"]) == pytest.approx(float(total), rel=1e-5)
    destroy_model_parallel()


def _ranks(rank, world_size, path, batch, expected):
    for sizes in LAYOUTS:
        _layout(path, sizes, batch, expected)
    _value_model(path, make_ppo_batch(batch_size=3, prompt_length=4, response_length=4, seed=3))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from verl.models.factory import make_tiny

    return make_tiny("tiny", str(tmp_path_factory.mktemp("tiny") / "model"), seed=0, dtype="float32")


def test_megatron_batch_api_equals_the_references_in_every_layout(tiny_path):
    from transformers import AutoModelForCausalLM

    batch = _rl_batch()
    expected = {}
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(tiny_path)
        expected["log_probs"], expected["entropy"] = reference_response_log_probs(hf, batch, temperature=TEMPERATURE)
    expected["grad_norm"] = _reference_grad_norm(tiny_path, batch.clone(), _loss_fn().keywords["config"])
    fsdp = fsdp_engine(tiny_path).train_batch(
        _packed(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=6), loss_function=_loss_fn()
    )
    expected["fsdp_grad_norm"], expected["fsdp_loss"] = fsdp["metrics"]["grad_norm"], sum(fsdp["loss"])
    run_distributed(_ranks, 2, tiny_path, batch, expected)


def test_padded_rows_lay_each_sequence_from_column_zero_and_refuse_shifted_positions():
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron.batch import padded_rows

    rows = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    ids = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    positions = torch.nested.as_nested_tensor([torch.arange(len(r)) for r in rows], layout=torch.jagged)
    data = tu.get_tensordict({"input_ids": ids, "position_ids": positions})
    padded = padded_rows(data, index=4)
    assert padded["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert padded["responses"].tolist() == [[6, 7], [0, 0], [10, 0]]  # a one-token prompt, the rest predicted
    assert padded["_micro_batch"].tolist() == [4, 4, 4] and padded["_row"].tolist() == [0, 1, 2]
    shifted = torch.nested.as_nested_tensor([torch.arange(len(r)) + 2 for r in rows], layout=torch.jagged)
    with pytest.raises(ValueError, match="position_ids to count 0, 1, 2"):
        padded_rows(tu.get_tensordict({"input_ids": ids, "position_ids": shifted}), index=0)
