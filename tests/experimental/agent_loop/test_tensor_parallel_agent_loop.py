"""Multi-turn episodes over a tensor-parallel engine group (2 gloo ranks, one engine sharded over both).

The engine is a stand-in `ExternalEngineRollout` that records every call's requests: both ranks must
see the same calls in the same order (what a sharded engine requires), the group's first rank runs
all episodes, and each rank gets back exactly the rows it was given.
"""

from __future__ import annotations

import torch

from verl.protocol import DataProto
from verl.workers.rollout.engine_io import EngineResponse
from verl.workers.rollout.external_engine import ExternalEngineRollout


class _ScriptedEngine(ExternalEngineRollout):
    """Each request's answer: `#### <number of assistant turns in its context>` + eos; records calls."""

    def _generate(self, prompts, sampling, max_new_tokens, stop_token_ids, with_logprobs):
        self.calls.append([list(p) for p in prompts])
        tok = self.tok
        turn = [tok.decode(p).count("<|assistant|>") for p in prompts]
        return [
            EngineResponse(tok(f"#### {k}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for k in turn
        ]

    def update_weights(self, named_tensors):
        return {}

    def sleep(self):
        pass

    def wake_up(self):
        pass


def _rank(rank: int, world_size: int) -> None:
    import numpy as np
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from tests.experimental.agent_loop.test_tool_agent_loop import rollout_config
    from verl.experimental.agent_loop import AgentLoopRollout
    from verl.models import bundled_model_path

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    config = rollout_config(
        300, rollout={"tensor_model_parallel_size": 2, "calculate_log_probs": False}, interaction_config_path=None
    )
    engine = _ScriptedEngine(bundled_model_path(), config)
    engine.tok, engine.calls = tok, []
    # the simulated user accepts answer k on the k-th turn: rank 0's episode takes 2 turns, rank 1's 3
    truths = ["2"] if rank == 0 else ["3"]
    import tempfile

    path = tempfile.mktemp(suffix=".yaml")
    with open(path, "w") as f:
        f.write("interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n")
    config = rollout_config(
        300, rollout={"tensor_model_parallel_size": 2, "calculate_log_probs": False}, interaction_config_path=path
    )
    rollout = AgentLoopRollout(engine, config, tok)
    rows = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": f"q{t}"}], add_generation_prompt=True, tokenize=False)
        )["input_ids"]
        for t in truths
    ]
    ids = torch.tensor(rows)
    extra = np.empty(1, dtype=object)
    extra[:] = [{"interaction_kwargs": {"name": "gsm8k", "ground_truth": truths[0]}}]
    prompts = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        non_tensors={"extra_info": extra},
        meta_info={"do_sample": False, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id},
    )
    out = rollout.generate_sequences(prompts)
    assert len(out) == 1
    assert out.batch["prompts"][0].tolist()[-ids.shape[1] :] == rows[0]
    assert out.non_tensor_batch["turn_scores"][0] == ([0.0, 1.0] if rank == 0 else [0.0, 0.0, 1.0])
    text = tok.decode(out.batch["responses"][0], skip_special_tokens=True)
    assert text.endswith(f"#### {truths[0]}"), text
    # three engine calls (turn 1 of both, turn 2 of both, turn 3 of rank 1's), identical on both ranks
    calls: list = [None, None]
    dist.all_gather_object(calls, engine.calls)
    assert calls[0] == calls[1] and [len(c) for c in calls[0]] == [2, 2, 1], [len(c) for c in calls[0]]
    dist.barrier()


def test_multi_turn_over_a_tensor_parallel_engine_group_runs_on_the_first_rank_and_returns_each_ranks_rows():
    from tests.distributed_helpers import run_distributed

    run_distributed(_rank, 2)
