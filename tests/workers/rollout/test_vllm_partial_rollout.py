"""Partial rollouts with a real vLLM engine (marker `vllm`; runs in the vllm virtualenv, .ci/vllm.sh):
newer weights arriving mid-generation are loaded between two engine steps and the unfinished
requests go on with them from prompt + their tokens so far.

The reference scores every sampled token with each weight version in float64 by a plain HF
forward over prompt + response (no KV cache, nothing shared with vLLM): vLLM's log-prob of a token
must be the one of the version that sampled it, so a token sampled after the pause with a key or
value left over from the old weights would show.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import SwapTo, build_model, response_log_probs, sampled_prompt_batch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from verl.protocol import DataProto  # noqa: E402

PAD = 0
# Many stop tokens, so that some rows stop before the pause and some go on past it.
EOS = list(range(2, 10))
R = 10
CHECK_STEPS = 3
LENGTHS = [6, 2, 4, 5, 3, 6, 4, 2, 5, 3, 4, 6, 5, 3, 6, 2]


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    v0, v1 = build_model("qwen2", seed=0), build_model("qwen2", seed=1)
    path = tmp_path_factory.mktemp("v0")
    v0.save_pretrained(path)
    return str(path), v0, v1


def _rollout(path):
    from verl.workers.rollout.vllm_rollout import vLLMRollout

    return vLLMRollout(
        path,
        engine_config(
            prompt_length=8,
            response_length=R,
            calculate_log_probs=True,
            temperature=1.0,
            max_num_seqs=32,
            enforce_eager=True,
        ),
    )


def _prompts(**meta) -> DataProto:
    return sampled_prompt_batch(LENGTHS, EOS, PAD, **meta)


def test_paused_requests_go_on_with_the_new_weights_and_each_token_has_its_versions_log_prob(versions):
    path, v0, v1 = versions
    rollout = _rollout(path)
    rollout.weight_refresh = SwapTo(rollout, v1)
    out = rollout.generate_sequences(_prompts(partial_rollout=True, partial_rollout_check_steps=CHECK_STEPS))
    rollout.release()

    mask = out.batch["response_mask"].bool()
    got = out.batch["rollout_log_probs"].double()
    lp0, lp1 = response_log_probs(v0, out), response_log_probs(v1, out)
    close0 = ((got - lp0).abs() < 2e-3) | ~mask
    close1 = ((got - lp1).abs() < 2e-3) | ~mask
    # the versions disagree on every sampled token, so each token tells which one sampled it
    assert ((lp0 - lp1).abs() > 1e-2)[mask].all()

    # one pause, at the same column for every row running then: tokens before it are v0's, after it v1's
    v0_cols = close0.all(0).nonzero().flatten().tolist()
    cut = len(v0_cols)
    assert v0_cols == list(range(cut)) and 1 <= cut <= CHECK_STEPS, f"v0 columns {v0_cols}"
    assert close1[:, cut:].all(), "a token after the pause is not the new weights' sample"
    spans = mask[:, cut].numpy()  # still generating when the new weights came in
    assert spans.sum() >= 2 and (~spans).sum() >= 1, "need rows on both sides for the test to mean much"
    assert not close1[spans, :cut].all(), "tokens before the pause look like v1's: nothing was paused"

    assert out.non_tensor_batch["weight_version"].tolist() == [0] * len(LENGTHS)
    assert out.non_tensor_batch["weight_version_max"].tolist() == spans.astype(int).tolist()
    # paused at the first check; the resumed requests keep checking (nothing newer comes)
    assert rollout.weight_refresh.version == 1 and rollout.weight_refresh.num_checks >= 2
    b = out.batch
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    # responses stop at the first stop token; the padded tail is PAD and masked
    for row in range(len(LENGTHS)):
        length = int(mask[row].sum())
        hits = [i for i, t in enumerate(b["responses"][row, :length].tolist()) if t in EOS]
        assert hits == ([length - 1] if length < R else hits[:1]) and hits[:1] in ([], [length - 1])
        assert (b["responses"][row, length:] == PAD).all()


def test_without_newer_weights_the_stepped_generation_samples_from_one_version(versions):
    path, v0, v1 = versions
    rollout = _rollout(path)
    rollout.weight_refresh = SwapTo(rollout, v1, waiting=False)
    out = rollout.generate_sequences(_prompts(partial_rollout=True, partial_rollout_check_steps=1))
    rollout.release()
    assert rollout.weight_refresh.num_checks >= R - 1 and rollout.weight_refresh.version == 0
    assert out.non_tensor_batch["weight_version_max"].tolist() == [0] * len(LENGTHS)
    mask = out.batch["response_mask"].bool()
    assert mask.sum(-1).lt(R).any() and mask.sum(-1).gt(1).any()
    diff = (out.batch["rollout_log_probs"].double() - response_log_probs(v0, out)).abs()
    assert diff.max().item() < 2e-3


class _LateReader(SwapTo):
    """A rank whose own look at the store never sees the new version (it reads too early): it must
    pause anyway, because the other rank of its engine group does."""

    def pending(self) -> bool:
        self.num_checks += 1
        return False


def _greedy_with_a_switch(v0, v1, prompts: DataProto, cut: int) -> torch.Tensor:
    """Independent reference: `cut` greedy tokens of v0, then v1 greedy from prompt + those tokens
    (full HF forwards, no cache), cut after the first stop token and padded."""
    from tests.workers.rollout.rollout_helpers import hf_greedy_loop

    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    head = hf_greedy_loop(v0, ids, mask, cut)
    tail = hf_greedy_loop(v1, torch.cat([ids, head], 1), torch.cat([mask, torch.ones_like(head)], 1), R - cut)
    full = torch.cat([head, tail], 1)
    for row in range(full.shape[0]):
        hits = [i for i, t in enumerate(full[row].tolist()) if t in EOS]
        if hits:
            full[row, hits[0] + 1 :] = PAD
    return full


def _tensor_parallel_rank(rank: int, world_size: int, port: int, path: str, results) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    from verl.workers.rollout.vllm_rollout import vLLMRollout

    engine = vLLMRollout(
        path, engine_config(prompt_length=8, response_length=R, tensor_model_parallel_size=2, max_num_seqs=32)
    )
    v1 = build_model("qwen2", seed=1)
    engine.weight_refresh = (SwapTo if rank == 0 else _LateReader)(engine, v1)
    half = len(LENGTHS) // 2
    prompts = _prompts(do_sample=False, partial_rollout=True, partial_rollout_check_steps=CHECK_STEPS)
    mine = prompts[:half] if rank == 0 else prompts[half:]
    out = engine.generate_sequences(mine)
    results[rank] = (
        out.batch["responses"],
        out.non_tensor_batch["weight_version_max"].tolist(),
        engine.weight_refresh.version,
    )
    dist.barrier()


def test_tensor_parallel_ranks_pause_together_when_only_one_sees_the_new_weights(versions):
    import torch.multiprocessing as mp

    from tests.distributed_helpers import free_port

    path, v0, v1 = versions
    with mp.Manager() as manager:
        results = manager.dict()
        ranks = mp.spawn(_tensor_parallel_rank, args=(2, free_port(), path, results), nprocs=2, join=False)
        # a rank left generating while the other loads weights would wait forever: bounded
        deadline = time.monotonic() + 300
        while not ranks.join(timeout=5):  # True once every rank has exited (it raises if one failed)
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                pytest.fail("the two tensor-parallel ranks did not finish within 300 s (did one pause alone?)")
        got = dict(results)
    half = len(LENGTHS) // 2
    prompts = _prompts()
    rows = {0: slice(0, half), 1: slice(half, len(LENGTHS))}
    assert got[0][2] == got[1][2] == 1, "both ranks loaded the new weights"
    # the pause column is not known in advance (1..CHECK_STEPS tokens per row at the first check)
    matches = [
        cut
        for cut in range(1, CHECK_STEPS + 1)
        if all(torch.equal(got[r][0], _greedy_with_a_switch(v0, v1, prompts[rows[r]], cut)) for r in (0, 1))
    ]
    assert len(matches) == 1, f"greedy outputs match a switch after {matches} tokens"
    responses = torch.cat([got[0][0], got[1][0]])
    spans = (
        (responses[:, matches[0] - 1 : matches[0]] != PAD)
        & ~torch.isin(responses[:, : matches[0]], torch.tensor(EOS)).any(1, keepdim=True)
    ).flatten()
    assert got[0][1] + got[1][1] == spans.int().tolist()
    assert 0 < spans.sum() < len(LENGTHS)
