"""The vLLM and SGLang adapters without their engines: request building, config mapping, weight-name
mapping, output parsing and the shared output layout. They run in the main test suite.

SGLang cannot be installed on these machines; its adapter is driven end to end against a stand-in
`sglang.Engine` that implements the documented offline API (generate / update_weights_from_tensor /
release_memory_occupation / resume_memory_occupation) on top of a real Hugging Face model, so
the test checks the adapter's requests, weight streaming and sleep protocol, and that its output
equals an independent greedy decode. The engine's own behaviour is not tested (docs/rollout_backends.md).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import chat_prompts, hf_greedy_loop
from verl.protocol import DataProto
from verl.workers.config import RolloutConfig
from verl.workers.rollout import get_rollout_class
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.engine_io import EngineResponse, assemble_output, hf_weight_name, prompt_token_lists
from verl.workers.rollout.external_engine import ExternalEngineRollout
from verl.workers.rollout.sampling import SamplingParams
from verl.workers.rollout.sglang_rollout import (
    SGLangRollout,
    bucket_named_tensors,
    parse_sglang_output,
    sglang_engine_kwargs,
    sglang_sampling_params,
)
from verl.workers.rollout.vllm_rollout import parse_vllm_output, vllm_engine_kwargs, vllm_sampling_kwargs, vLLMRollout

EOS, PAD = 3, 0


def _model_path() -> str:
    from verl.models import bundled_model_path

    return bundled_model_path()


def _prompts(questions=("12+34", "7+80", "99+1"), **meta) -> DataProto:
    return chat_prompts(_model_path(), questions, EOS, PAD, **meta)


# ------------------------------------------------------------------------------------ engine_io


def test_assemble_output_pads_masks_and_drops_tokens_after_the_first_stop():
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]]),
        },
        non_tensors={"uid": ["a", "b"]},
    )
    responses = [
        EngineResponse([11, EOS, 12, 13], [-0.5, -0.25, -9.0, -9.0]),  # an engine that ran past its stop
        EngineResponse([14, 15, 16, 17, 18, 19], [-1.0] * 6),  # longer than the response budget
    ]
    out = assemble_output(prompts, responses, 4, PAD, [EOS], True, {"k": 1})
    b = out.batch
    assert b["responses"].tolist() == [[11, EOS, PAD, PAD], [14, 15, 16, 17]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert b["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0.0, 0.0], [-1.0] * 4]
    assert b["input_ids"].tolist() == [[0, 5, 6, 11, EOS, PAD, PAD], [7, 8, 9, 14, 15, 16, 17]]
    assert b["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [1] * 7]
    assert b["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    assert list(out.non_tensor_batch["uid"]) == ["a", "b"] and out.meta_info == {"k": 1}
    with pytest.raises(RuntimeError, match="log-probs"):
        assemble_output(prompts, [EngineResponse([1, 2]), EngineResponse([3])], 4, PAD, [EOS], True, {})


def test_prompt_token_lists_strip_left_padding_and_weight_names_lose_wrappers():
    ids = torch.tensor([[0, 0, 4, 5], [6, 7, 8, 9]])
    assert prompt_token_lists(ids, (ids != 0).long()) == [[4, 5], [6, 7, 8, 9]]
    assert (
        hf_weight_name("_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_weight_name("_orig_mod.lm_head.weight") == "lm_head.weight"


def test_engines_are_registered_by_rollout_name():
    assert get_rollout_class("vllm") is vLLMRollout and get_rollout_class("sglang") is SGLangRollout
    assert issubclass(vLLMRollout, BaseRollout) and issubclass(SGLangRollout, BaseRollout)


# ------------------------------------------------------------------------------- config mapping


def _config(**overrides) -> RolloutConfig:
    base = dict(
        prompt_length=32,
        response_length=8,
        tensor_model_parallel_size=1,
        gpu_memory_utilization=0.4,
        max_num_batched_tokens=4096,
        max_num_seqs=64,
        enforce_eager=True,
        load_format="dummy_dtensor",
        engine_kwargs={"vllm": {"swap_space": 0}, "sglang": {"attention_backend": "triton"}},
    )
    base.update(overrides)
    return engine_config(**base)


def test_vllm_engine_arguments_follow_the_rollout_config():
    path = _model_path()
    kwargs = vllm_engine_kwargs(path, _config(), seed=3)
    assert kwargs["model"] == path and kwargs["skip_tokenizer_init"] is True
    assert kwargs["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in kwargs
    assert kwargs["gpu_memory_utilization"] == 0.4 and kwargs["max_num_seqs"] == 64
    assert kwargs["max_model_len"] == 40 and kwargs["max_num_batched_tokens"] == 4096
    assert kwargs["enforce_eager"] is True and kwargs["seed"] == 3
    assert kwargs["load_format"] == "dummy"  # the trainer's weights arrive before every generation
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert vllm_engine_kwargs(path, _config(logprobs_mode="raw_logits"))["logprobs_mode"] == "raw_logits"
    assert kwargs["swap_space"] == 0  # engine_kwargs.vllm passes through
    assert vllm_engine_kwargs(path, _config(load_format="safetensors"))["load_format"] == "safetensors"
    tp2 = vllm_engine_kwargs(path, _config(tensor_model_parallel_size=2, max_model_len=64, max_num_batched_tokens=16))
    assert tp2["distributed_executor_backend"] == "external_launcher" and tp2["tensor_parallel_size"] == 2
    assert tp2["max_model_len"] == 64 and tp2["max_num_batched_tokens"] == 64  # never below one full sequence
    if not torch.cuda.is_available():
        assert kwargs["dtype"] == "float32" and "enable_sleep_mode" not in kwargs
        assert 64 << 20 <= kwargs["kv_cache_memory_bytes"] <= 4 << 30


def test_sglang_engine_arguments_follow_the_rollout_config():
    kwargs = sglang_engine_kwargs("/m", _config(max_model_len=48), seed=2)
    assert kwargs["model_path"] == "/m" and kwargs["skip_tokenizer_init"] is True
    assert kwargs["tp_size"] == 1 and kwargs["mem_fraction_static"] == 0.4
    assert kwargs["max_running_requests"] == 64 and kwargs["chunked_prefill_size"] == 4096
    assert kwargs["context_length"] == 48 and kwargs["disable_cuda_graph"] is True
    assert kwargs["enable_memory_saver"] is True and kwargs["load_format"] == "dummy" and kwargs["random_seed"] == 2
    assert kwargs["attention_backend"] == "triton"
    assert sglang_engine_kwargs("/m", _config(enable_chunked_prefill=False))["chunked_prefill_size"] == -1


@pytest.mark.parametrize("bad", [{"gpu_memory_utilization": 1.5}, {"tensor_model_parallel_size": 0}])
def test_invalid_engine_config_is_rejected_with_the_key_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _config(**bad)


def test_sampling_parameters_map_onto_both_engines():
    sample = SamplingParams(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
    greedy = SamplingParams(do_sample=False)
    v = vllm_sampling_kwargs(sample, 8, [EOS], with_logprobs=True, ignore_eos=False)
    assert v == dict(
        n=1,
        max_tokens=8,
        stop_token_ids=[EOS],
        ignore_eos=False,
        detokenize=False,
        logprobs=0,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
    )
    g = vllm_sampling_kwargs(greedy, 8, [EOS], with_logprobs=False, ignore_eos=True)
    assert (g["temperature"], g["top_k"], g["logprobs"], g["ignore_eos"]) == (0.0, -1, None, True)
    assert vllm_sampling_kwargs(SamplingParams(top_k=-1), 4, [], False, False)["top_k"] == -1

    s = sglang_sampling_params(sample, 8, [EOS, 7])
    assert (s["max_new_tokens"], s["stop_token_ids"], s["temperature"], s["top_p"], s["top_k"]) == (
        8,
        [EOS, 7],
        0.7,
        0.9,
        5,
    )
    assert sglang_sampling_params(greedy, 8, [EOS])["temperature"] == 0.0


def test_engine_outputs_parse_into_tokens_and_sampled_token_log_probs():
    step = lambda token, lp: {token: SimpleNamespace(logprob=lp, rank=1)}  # noqa: E731
    completion = SimpleNamespace(token_ids=[5, EOS], logprobs=[step(5, -0.1), {**step(EOS, -0.2), 9: None}])
    assert parse_vllm_output(completion, True) == EngineResponse([5, EOS], [-0.1, -0.2])
    assert parse_vllm_output(completion, False).logprobs is None
    out = {"output_ids": [5, EOS], "meta_info": {"output_token_logprobs": [(-0.1, 5, None), (-0.2, EOS, None)]}}
    assert parse_sglang_output(out, True) == EngineResponse([5, EOS], [-0.1, -0.2])
    with pytest.raises(RuntimeError, match="line up"):
        parse_sglang_output({"output_ids": [5], "meta_info": {"output_token_logprobs": [(-0.1, 6, None)]}}, True)


def test_weight_buckets_respect_the_size_limit_and_rename():
    tensors = [(f"_fsdp_wrapped_module.w{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    buckets = list(bucket_named_tensors(iter(tensors), bucket_bytes=2048))
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert [len(b) for b in bucket_named_tensors([("big", torch.zeros(4096))], 1024)] == [1]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_is_an_error_that_says_how_to_install_it():
    with pytest.raises(ImportError, match="rollout_backends.md"):
        vLLMRollout(_model_path(), engine_config(response_length=4))


# ------------------------------------------------------------------------ SGLang, stand-in engine


class _StandInSGLangEngine:
    """The documented `sglang.Engine` offline API, greedy-decoding with a Hugging Face model."""

    def __init__(self, **kwargs):
        from transformers import AutoModelForCausalLM

        self.kwargs = kwargs
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"]).eval()
        self.calls: list[tuple] = []

    def generate(self, input_ids, sampling_params, return_logprob=False):
        self.calls.append(("generate", len(input_ids)))
        outputs = []
        for ids, params in zip(input_ids, sampling_params):
            assert params["temperature"] == 0.0, "the stand-in decodes greedily only"
            seq, tokens, logprobs = list(ids), [], []
            with torch.no_grad():
                for _ in range(params["max_new_tokens"]):
                    logits = self.model(torch.tensor([seq])).logits[0, -1].double()
                    token = int(logits.argmax())
                    tokens.append(token)
                    logprobs.append((float(logits.log_softmax(-1)[token]), token, None))
                    seq.append(token)
                    if token in params["stop_token_ids"]:
                        break
            meta = {"output_token_logprobs": logprobs} if return_logprob else {}
            outputs.append({"output_ids": tokens, "meta_info": meta})
        return outputs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", len(named_tensors), flush_cache))
        state = self.model.state_dict()
        for name, tensor in named_tensors:
            state[name].copy_(tensor)

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags)))

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture
def stand_in_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_StandInSGLangEngine))


def test_sglang_adapter_end_to_end_against_a_stand_in_engine(stand_in_sglang):
    from transformers import AutoModelForCausalLM

    rollout = SGLangRollout(
        _model_path(),
        engine_config(
            response_length=6,
            prompt_length=32,
            calculate_log_probs=True,
            checkpoint_engine={"update_weights_bucket_megabytes": 1},
        ),
    )
    engine = rollout.engine
    assert engine.kwargs["tp_size"] == 1 and engine.kwargs["context_length"] == 38

    # the hybrid-engine protocol: asleep during training, weights synced, generate, asleep again
    rollout.sleep()
    trained = AutoModelForCausalLM.from_pretrained(_model_path())
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    rollout.wake_up()
    rollout.update_weights(trained.state_dict().items())
    prompts = _prompts(do_sample=False)
    out = rollout.generate_sequences(prompts)
    rollout.sleep()

    ops = [c[0] for c in engine.calls]
    assert engine.calls[0] == ("release", ("kv_cache", "weights"))
    assert engine.calls[1] == ("resume", ("weights",))
    updates = [c for c in engine.calls if c[0] == "update"]
    assert len(updates) > 1 and all(not c[2] for c in updates[:-1]) and updates[-1][2]  # flush once, at the end
    assert ops.index("generate") == ops.index("resume", 2) + 1  # KV cache back only right before generating
    assert engine.calls[ops.index("generate") - 1] == ("resume", ("kv_cache",))
    assert engine.calls[-1] == ("release", ("kv_cache", "weights"))

    expected = hf_greedy_loop(trained.eval(), prompts.batch["input_ids"], prompts.batch["attention_mask"], 6)
    original = AutoModelForCausalLM.from_pretrained(_model_path()).eval()
    before = hf_greedy_loop(original, prompts.batch["input_ids"], prompts.batch["attention_mask"], 6)
    assert not torch.equal(before, expected), "the perturbation must change the greedy output, or the sync is untested"
    b = out.batch
    for row in range(len(prompts)):
        hits = (expected[row] == EOS).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else 6
        assert b["responses"][row, :stop].tolist() == expected[row, :stop].tolist()
        assert b["response_mask"][row].tolist() == [1] * stop + [0] * (6 - stop)
    with torch.no_grad():
        logits = trained(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    P = b["prompts"].shape[1]
    ref = logits[:, P - 1 : -1].double().log_softmax(-1).gather(-1, b["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(b["rollout_log_probs"].double(), ref * b["response_mask"], atol=1e-4, rtol=0)


def test_sglang_refuses_tensor_parallelism_it_cannot_host(stand_in_sglang):
    with pytest.raises(NotImplementedError, match="tensor_model_parallel_size=1"):
        SGLangRollout(_model_path(), engine_config(tensor_model_parallel_size=2))


def test_sglang_refuses_partial_rollouts_with_what_to_do_instead(stand_in_sglang):
    """The config check rejects partial rollouts with SGLang; a worker asked anyway says so."""
    rollout = SGLangRollout(_model_path(), engine_config(response_length=6, prompt_length=32))
    rollout.weight_refresh = types.SimpleNamespace(version=0, pending=lambda: True, load=lambda: 1)
    with pytest.raises(NotImplementedError, match="async_training.partial_rollout=false"):
        rollout.generate_sequences(_prompts(do_sample=False, partial_rollout=True))
    # without the request flag the refresh is not looked at
    assert rollout.generate_sequences(_prompts(do_sample=False)).batch["responses"].shape[1] == 6


# ---------------------------------------------------------------------- engine tensor parallelism


class _RecordingEngineRollout(ExternalEngineRollout):
    """A trivial engine: each response is its prompt reversed; remembers what it was asked."""

    def _generate(self, prompts, sampling, max_new_tokens, stop_token_ids, with_logprobs):
        self.requests = prompts
        return [EngineResponse(list(reversed(p))[:max_new_tokens]) for p in prompts]

    def update_weights(self, named_tensors):
        return {}

    def sleep(self):
        pass

    def wake_up(self):
        pass


def _tp_rank(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    # the trivial engine computes no log-probs, so it is not asked for them (on by default since upstream v0.9)
    config = engine_config(tensor_model_parallel_size=2, response_length=4, calculate_log_probs=False)
    rollout = _RecordingEngineRollout(_model_path(), config)
    # rank 0 holds two prompts, rank 1 one: the engine group must run all three on both ranks
    mine = [[10, 11, 12], [13, 14]] if rank == 0 else [[20, 21, 22, 23]]
    width = 4
    ids = torch.zeros(len(mine), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(mine):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    prompts = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask}, meta_info={"do_sample": False, "eos_token_id": EOS}
    )
    out = rollout.generate_sequences(prompts)
    assert rollout.requests == [[10, 11, 12], [13, 14], [20, 21, 22, 23]]
    got = out.batch["responses"].tolist()
    assert [row[: len(p)] for row, p in zip(got, mine)] == [list(reversed(p)) for p in mine]
    assert out.batch["response_mask"].sum(-1).tolist() == [len(p) for p in mine]
    dist.barrier()


def test_tensor_parallel_group_runs_the_union_of_its_ranks_prompts_and_each_keeps_its_own():
    from tests.distributed_helpers import run_distributed

    run_distributed(_tp_rank, 2)


def test_vllm_expert_parallelism_is_enable_expert_parallel_on_gpu_and_refused_on_cpu():
    path = _model_path()
    config = _config(tensor_model_parallel_size=2, expert_parallel_size=2)
    if torch.cuda.is_available():
        kwargs = vllm_engine_kwargs(path, config)
        assert kwargs["enable_expert_parallel"] is True and kwargs["tensor_parallel_size"] == 2
    else:
        with pytest.raises(ValueError, match="vLLM's CPU build crashes"):
            vllm_engine_kwargs(path, config)
    assert "enable_expert_parallel" not in vllm_engine_kwargs(path, _config(tensor_model_parallel_size=2))
