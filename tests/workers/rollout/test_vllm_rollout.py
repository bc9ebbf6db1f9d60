"""vLLMRollout with a real vLLM engine (marker `vllm`; runs in the vllm virtualenv, see .ci/vllm.sh).

- after a weight sync, vLLM's greedy output equals the synced Hugging Face model's greedy decode
  (an engine started with random weights, as the hybrid engine starts it, then a perturbed model);
- the log-probs vLLM reports for sampled tokens equal the trainer's recomputation (the actor's
  `compute_log_prob` at the sampling temperature) within float32 tolerance;
- `rollout.logprobs_mode` reaches the engine: raw_logits are the model's logits of the sampled
  tokens, whatever the temperature and top-k (an engine of its own);
- an engine sharded over two workers (tensor_model_parallel_size=2) generates each worker's prompts.

`python -m verl.trainer.main_ppo` with rollout.name=vllm: tests/trainer/test_main_ppo_rollout_backends.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import chat_prompts, hf_greedy_loop

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from verl.protocol import DataProto  # noqa: E402

EOS, PAD = 3, 0
R = 8


def _model_path() -> str:
    from verl.models import bundled_model_path

    return bundled_model_path()


def _prompts(questions, **meta) -> DataProto:
    return chat_prompts(_model_path(), questions, EOS, PAD, **meta)


QUESTIONS = ["12+34", "7+80", "99+1", "45+45", "23+19", "60+7"]


@pytest.fixture(scope="module")
def rollout():
    from verl.workers.rollout.vllm_rollout import vLLMRollout

    # the hybrid engine's start: random weights (load_format=dummy_*) that the trainer overwrites
    engine = vLLMRollout(
        _model_path(),
        engine_config(
            prompt_length=32,
            response_length=R,
            load_format="dummy_dtensor",
            calculate_log_probs=True,
            max_num_seqs=64,
            enforce_eager=True,
        ),
    )
    yield engine
    engine.release()


def _hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_model_path()).eval()


def _expected_greedy(model, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(responses, response_mask) of an independent greedy decode, cut after the first EOS."""
    ref = hf_greedy_loop(model, prompts.batch["input_ids"], prompts.batch["attention_mask"], R)
    mask = torch.zeros_like(ref)
    for row in range(ref.shape[0]):
        hits = (ref[row] == EOS).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else R
        mask[row, :stop] = 1
    return torch.where(mask.bool(), ref, PAD), mask


def _sync_and_generate(rollout, model, prompts) -> DataProto:
    """The hybrid engine's sequence: wake up, sync the trainer's weights, generate, sleep."""
    rollout.wake_up()
    rollout.update_weights(iter(model.state_dict().items()))
    out = rollout.generate_sequences(prompts)
    rollout.sleep()
    return out


def test_after_a_weight_sync_greedy_output_equals_the_synced_models(rollout):
    prompts = _prompts(QUESTIONS, do_sample=False)
    model = _hf_model()
    out = _sync_and_generate(rollout, model, prompts)
    responses, mask = _expected_greedy(model, prompts)
    assert torch.equal(out.batch["responses"], responses) and torch.equal(out.batch["response_mask"], mask)
    assert mask.sum(-1).lt(R).any(), "no response stopped at EOS: the stop handling is not exercised"

    # a trained model (perturbed weights) must come through the next sync exactly
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    trained_responses, trained_mask = _expected_greedy(model, prompts)
    assert not torch.equal(trained_responses, responses), "the perturbation did not change greedy outputs"
    out = _sync_and_generate(rollout, model, prompts)
    assert torch.equal(out.batch["responses"], trained_responses)
    assert torch.equal(out.batch["response_mask"], trained_mask)
    b = out.batch
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))


def test_sampled_log_probs_match_the_trainers_recomputation(rollout):
    from verl.workers.actor import DataParallelPPOActor

    temperature = 0.8
    model = _hf_model()
    prompts = _prompts(QUESTIONS, temperature=temperature)
    out = _sync_and_generate(rollout, model, prompts.repeat(4, interleave=True))
    b = out.batch
    assert b["responses"].shape == (4 * len(QUESTIONS), R)
    actor = DataParallelPPOActor({"ppo_mini_batch_size": 1}, model)
    data = DataProto(batch=b.clone(), meta_info={"temperature": temperature, "micro_batch_size": 8})
    trainer_log_probs, _ = actor.compute_log_prob(data)
    mask = b["response_mask"].bool()
    diff = (b["rollout_log_probs"] - trainer_log_probs).abs()[mask]
    assert diff.max().item() < 2e-3, f"vLLM vs trainer log-prob gap {diff.max().item():.2e}"
    assert (b["rollout_log_probs"][~mask] == 0).all()
    # sampling, not greedy: the four samples of some prompt differ
    groups = b["responses"].view(len(QUESTIONS), 4, R)
    assert any(len({tuple(s.tolist()) for s in g}) > 1 for g in groups)


def test_logprobs_mode_raw_logits_reaches_the_engine():
    from verl.workers.rollout.vllm_rollout import vLLMRollout

    config = engine_config(
        prompt_length=32,
        response_length=R,
        load_format="dummy_dtensor",
        calculate_log_probs=True,
        enforce_eager=True,
        top_k=5,
        logprobs_mode="raw_logits",
    )
    engine = vLLMRollout(_model_path(), config)
    try:
        model = _hf_model()
        b = _sync_and_generate(engine, model, _prompts(QUESTIONS, temperature=0.8).repeat(2, interleave=True)).batch
    finally:
        engine.release()
    P = b["prompts"].shape[1]
    with torch.no_grad():
        logits = model(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    raw = logits[:, P - 1 : -1].gather(-1, b["responses"][..., None]).squeeze(-1)
    mask = b["response_mask"].bool()
    assert (b["rollout_log_probs"] - raw).abs()[mask].max().item() < 1e-3
    assert (b["rollout_log_probs"][mask] > 0).any()  # logits, not log-probs (which are all <= 0)


def _tensor_parallel_rank(rank: int, world_size: int, port: int, results) -> None:
    import torch.distributed as dist

    from verl.workers.rollout.vllm_rollout import vLLMRollout

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    engine = vLLMRollout(
        _model_path(),
        engine_config(prompt_length=32, response_length=R, tensor_model_parallel_size=2, max_num_seqs=16),
    )
    engine.update_weights(iter(_hf_model().state_dict().items()))
    # each rank brings its own prompts (data-parallel dispatch); the engine group runs all of them
    mine = QUESTIONS[:4] if rank == 0 else QUESTIONS[4:]
    out = engine.generate_sequences(_prompts(mine, do_sample=False))
    results[rank] = (out.batch["responses"].tolist(), out.batch["response_mask"].tolist())
    dist.barrier()


def test_tensor_parallel_engine_shared_by_two_workers_generates_each_workers_prompts():
    import torch.multiprocessing as mp

    from tests.distributed_helpers import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_tensor_parallel_rank, args=(2, free_port(), results), nprocs=2)
        got = dict(results)
    # the batch of all prompts is padded wider than each rank's own: compare per prompt
    for rank, questions in ((0, QUESTIONS[:4]), (1, QUESTIONS[4:])):
        responses, mask = _expected_greedy(_hf_model(), _prompts(questions))
        assert got[rank] == (responses.tolist(), mask.tolist())
