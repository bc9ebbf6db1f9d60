"""Test helpers: a random-init tiny Qwen2, PPO-shaped batches, and 2-rank gloo process groups.

Kept tiny on purpose (2 layers, hidden 64, vocabulary 40) so a spawn of two ranks plus a few
forward/backward passes takes seconds on 2 CPU cores. Models are float64 where tests compare
against references computed another way, so tolerances can be tight.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

VOCAB = 40
PAD = 0


@contextlib.contextmanager
def device_preference(name: str):
    """Run a block with verl's device forced to `name` (`VERL_DEVICE`, read on every device query):
    an fp32 CPU reference beside a GPU run in the same process, where `auto` would pick CUDA and
    move the reference's batches there."""
    previous = os.environ.get("VERL_DEVICE")
    os.environ["VERL_DEVICE"] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("VERL_DEVICE", None)
        else:
            os.environ["VERL_DEVICE"] = previous


def assert_first_adamw_step_follows(before: dict, reference, updated: dict, lr: float) -> None:
    """A low-precision model's first AdamW step (`updated`: name -> weights after it, on the CPU)
    against an fp32 reference model's (`reference`, after its step) from the same `before` weights.

    AdamW's first step moves each weight by lr * g / (|g| + eps), i.e. by ~lr with the sign of its
    gradient wherever |g| >> eps: every tensor must move by ~lr (with bf16 masters a 1e-6 step would
    vanish below bf16's 2^-8 spacing), and where the fp32 step is clearly ~lr, >= 90% of the weights
    must move the same way (bf16 compute perturbs gradients by ~1%, flipping only near-zero ones)."""
    agree, sure = 0, 0
    for name, start in before.items():
        ref_delta = reference.get_parameter(name).detach() - start
        delta = updated[name] - start
        largest = float(delta.abs().max())
        assert 0.5 * lr < largest < 2 * lr, f"{name}: the bf16 update moved it by at most {largest:.3g}, lr={lr}"
        clear = ref_delta.abs() > 0.9 * lr
        sure += int(clear.sum())
        agree += int((torch.sign(delta) == torch.sign(ref_delta))[clear].sum())
    assert sure > 0 and agree / sure >= 0.9, f"the bf16 step's direction agrees on {agree}/{sure} weights"


@pytest.fixture(autouse=False)
def one_thread():
    """Run a test with one intra-op thread: on a shared 2-core machine, two spinning OpenMP threads
    make tiny-model forwards ~100x slower (measured: 0.8 s vs 2 ms for one forward)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_qwen2_config(tie_word_embeddings: bool = True, num_labels: int | None = None):
    from transformers import Qwen2Config

    kwargs = {"num_labels": num_labels, "classifier_dropout": 0.0} if num_labels else {}
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=PAD,
        **kwargs,
    )


def make_tiny_causal_lm(seed: int = 0, dtype=torch.float64, tie_word_embeddings: bool = True):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_qwen2_config(tie_word_embeddings)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)


def make_tiny_value_model(seed: int = 0, dtype=torch.float64):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)
    config = tiny_qwen2_config(num_labels=1)
    return AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa").to(dtype)


def make_ppo_batch(
    batch_size: int = 8,
    prompt_length: int = 6,
    response_length: int = 5,
    seed: int = 0,
    prompt_lengths: list[int] | None = None,
    response_lengths: list[int] | None = None,
):
    """TensorDict in the project layout: left-padded prompts, right-padded responses.

    Keys: prompts, responses, input_ids, attention_mask, position_ids, response_mask.
    """
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    if prompt_lengths is None:
        prompt_lengths = torch.randint(1, prompt_length + 1, (batch_size,), generator=g).tolist()
    if response_lengths is None:
        response_lengths = torch.randint(1, response_length + 1, (batch_size,), generator=g).tolist()
    prompts = torch.full((batch_size, prompt_length), PAD)
    responses = torch.full((batch_size, response_length), PAD)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        prompts[i, prompt_length - p :] = torch.randint(3, VOCAB, (p,), generator=g)
        responses[i, :r] = torch.randint(3, VOCAB, (r,), generator=g)
    prompt_mask = (torch.arange(prompt_length)[None] >= prompt_length - torch.tensor(prompt_lengths)[:, None]).long()
    response_mask = (torch.arange(response_length)[None] < torch.tensor(response_lengths)[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return TensorDict(ppo_tensors(prompts, responses, attention_mask, response_mask), batch_size=[batch_size])


def ppo_tensors(prompts, responses, attention_mask, response_mask) -> dict:
    """The batch keys of the project layout from left-padded `prompts` [B, P], right-padded `responses`
    [B, R], `attention_mask` [B, P+R] and `response_mask` [B, R]: input_ids and position_ids derived."""
    from verl.utils.model import compute_position_id_with_mask

    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
    }


@torch.no_grad()
def reference_response_log_probs(model, batch, temperature: float = 1.0):
    """Per-sequence reference: each row's real tokens alone through the model, no mask, no padding.

    Returns (log_probs [B, R], entropy [B, R]) at response positions, 0 at response padding.
    """
    response_length = batch["responses"].shape[1]
    prompt_length = batch["input_ids"].shape[1] - response_length
    out_lp = torch.zeros(batch["responses"].shape, dtype=torch.float64)
    out_ent = torch.zeros_like(out_lp)
    for i in range(len(batch)):
        mask = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][mask]
        num_prompt = int(mask[:prompt_length].sum())
        num_response = int(mask[prompt_length:].sum())
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        for k in range(num_response):
            row = logp[num_prompt - 1 + k]
            out_lp[i, k] = row[ids[num_prompt + k]]
            out_ent[i, k] = -(row.exp() * row).sum()
    return out_lp, out_ent


RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torch.distributed reads from the environment: a test's own group must not inherit a launcher's."""


@pytest.fixture
def one_process(monkeypatch):
    """A worker built in this process joins a one-rank gloo group of its own (no launcher's rank
    variables, VERL_DEVICE=cpu); the group is destroyed afterwards."""
    import torch.distributed as dist

    for name in RANK_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_group():
    """This process as a real one-rank gloo group for a whole test module, so a trainer's collectives
    run in the test's interpreter."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def nccl_group(monkeypatch):
    """This process as a one-rank NCCL group on CUDA device 0, the device-generic code picking CUDA
    (`VERL_DEVICE=auto`); for the FSDP GPU checks (callers skip without a GPU)."""
    import torch.distributed as dist

    monkeypatch.setenv("VERL_DEVICE", "auto")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def disable_tf32(monkeypatch) -> None:
    """TF32 off for this test. torch >= 2.9 has `fp32_precision`, and once it was set (verl's
    `enable_tf32` sets it) reading the older `allow_tf32` flags raises, so the newer switch is used
    where it exists."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        monkeypatch.setattr(matmul, "fp32_precision", "ieee")
        monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")
    else:
        monkeypatch.setattr(matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.fixture
def one_gpu_group(monkeypatch):
    """This process as a one-rank NCCL group on CUDA device 0 with exact fp32 matmuls (TF32 off), for
    the megatron checks on one GPU; skips without a GPU. Megatron's and torch's groups are torn down
    afterwards."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for name in RANK_ENV:
        monkeypatch.delenv(name, raising=False)
    disable_tf32(monkeypatch)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        yield
    finally:
        from verl.utils.megatron.parallel_state import destroy_model_parallel

        destroy_model_parallel()
        dist.destroy_process_group()


def free_port() -> int:
    """A port for a rank-0 server the ranks bind later: verl's pick outside the kernel's ephemeral
    range (`get_free_port`), not `bind(0)`, whose port any outgoing connection (Ray's many) can take
    between the pick and rank 0's bind (EADDRINUSE)."""
    from verl.single_controller.base.worker import get_free_port

    return get_free_port()


def _entry(rank: int, world_size: int, port: int, fn, args, errors):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        VERL_DEVICE="cpu",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


# What the ranks start with already imported: the forkserver imports these once, and every rank
# forks from it. Without them every rank of every test paid, on its own: the tiny models' modeling
# modules (transformers imports them lazily: ~1 s idle, 11 s at load 33), megatron.core (~2 s idle,
# 17 s at load 20) and verl's workers (~0.3 s idle), a hundred-odd spawns a tier run. A module that
# is not installed (megatron-core) is skipped: the forkserver skips any preload that fails to import.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",  # the MoE tests' architecture (verl.models.factory)
    "tests.distributed_helpers",
    "verl.protocol",
    "verl.workers.fsdp_workers",
    "megatron.core",
    "megatron.core.models.gpt",
]


def _start_method() -> str:
    """How `run_distributed` starts its ranks: from a forkserver, or spawned once CUDA is initialised
    here (a GPU test ran earlier: CUDA cannot be used again in a child forked after its parent
    initialised it, although the ranks stay on CPU). `VERL_TEST_START_METHOD` forces one.

    Never forked from this process: a fork copies every object of the test process into the ranks
    but none of its threads, so an object whose native threads are gone in the child hangs the rank
    that touches it. Seen: a gloo process group that an earlier in-process test left referenced
    (megatron's globals) still had its gloo threads in pytest's process; a forked rank replaced that
    global, and the group's destructor waited forever to join threads that do not exist in the child
    (`tests/workers/test_fsdp_workers.py` then `tests/workers/actor/test_megatron_actor_moe.py`).
    Ray's driver threads (gRPC) did the same once the session cluster was up. Forking only from a
    one-thread process would not save the fork: numpy's OpenBLAS pool starts a thread when torch is
    imported, and torch's OpenMP pool another after the first forward, so nearly every test process
    has several threads. The forkserver is a fresh interpreter, started once per pytest process, that
    preloads FORKSERVER_PRELOAD; ranks fork from it, clean, and import only the test's own module.
    """
    forced = os.environ.get("VERL_TEST_START_METHOD")
    if forced:
        return forced
    if torch.cuda.is_initialized():
        return "spawn"
    return "forkserver"


def run_distributed(fn, world_size: int = 2, *args) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` processes forming a gloo group.

    The ranks fork from a forkserver that has already imported torch, transformers, megatron and
    verl's workers (`FORKSERVER_PRELOAD`), which saves seconds of imports per rank on a loaded
    2-core machine; `fn` and `args` must pickle (a module-level function). Each rank uses one
    intra-op thread. An exception in any rank fails the caller with that rank's traceback.
    """
    start_method = _start_method()
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts (the first time)
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _entry, args=(world_size, free_port(), fn, args, errors), nprocs=world_size, start_method=start_method
        )
    except Exception as e:
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        raise AssertionError("\n".join(messages) or str(e)) from None


def run_in_fresh_interpreter(module: str, case: str, *args, timeout_s: float = 300) -> dict:
    """Call `module.case(*args)` in a new Python process and return the JSON object it returns (or
    prints last). For checks that need a process of their own: their own default process group or
    CUDA context, or a communicator they may leave aborted. `args` must be JSON-serialisable."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, importlib\n"
        f"result = getattr(importlib.import_module({module!r}), {case!r})(*json.loads(sys.argv[1]))\n"
        "print(json.dumps(result), flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(args))], capture_output=True, text=True, timeout=timeout_s, env=env
    )
    assert run.returncode == 0, f"{case} failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])
