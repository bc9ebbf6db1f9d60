"""Tiny random-init HF models and helpers for the rollout tests (head_dim 64, float32, CPU).

Imported by full module path (`tests.workers.rollout.rollout_helpers`), not as `conftest`: ranks
forked from a forkserver started by another directory's test resolve a bare `conftest` to that
directory's file.

`initializer_range` is raised above transformers' default so next-token distributions are peaked:
with near-uniform logits, a greedy comparison would hinge on last-ulp ties between two correct
implementations instead of on real differences.
"""

from __future__ import annotations

import torch

VOCAB = 48


def build_model(arch: str = "qwen2", seed: int = 0, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=2, n_positions=128, initializer_range=0.2)
        cls = GPT2LMHeadModel
    elif arch == "llama":
        # grouped-query attention, untied head, rope scaling: exercises the paths Qwen2 does not
        common.update(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, hidden_size=256)
        common.update(overrides)
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        common.update(overrides)
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    torch.manual_seed(seed)
    return cls(config).eval()


def left_padded_prompts(lengths, seed: int = 0, width: int | None = None):
    """Random prompts of the given lengths, left-padded with 0 to `width` (default: the longest)."""
    gen = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        input_ids[row, width - n :] = torch.randint(3, VOCAB, (n,), generator=gen)
        attention_mask[row, width - n :] = 1
    return input_ids, attention_mask


def hf_greedy_loop(model, input_ids, attention_mask, new_tokens: int):
    """Independent reference: full HF forward (no cache) + argmax, one token at a time."""
    ids, mask = input_ids.clone(), attention_mask.clone()
    out = []
    with torch.no_grad():
        for _ in range(new_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
            nxt = logits.argmax(-1)
            out.append(nxt)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], dim=1)
    return torch.stack(out, dim=1)


def sampled_prompt_batch(lengths, eos_token_id, pad_token_id: int = 0, **meta):
    """A DataProto of random left-padded prompts of `lengths` (seed 3), one uid per row, asking for
    sampling with the given stop/pad ids; `meta` adds or overrides meta_info keys."""
    import numpy as np

    from verl.protocol import DataProto

    input_ids, attention_mask = left_padded_prompts(lengths, seed=3)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors={"uid": np.array([f"u{i}" for i in range(len(lengths))], dtype=object)},
        meta_info={"eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "do_sample": True, **meta},
    )


def response_log_probs(model, out) -> torch.Tensor:
    """[B, R] float64 log-prob of each response token of a rollout output under `model` (a full
    forward over prompt + response on a float64 copy, no KV cache; 0 where the mask is 0)."""
    import copy

    model = copy.deepcopy(model).double()
    b = out.batch
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    P = b["prompts"].shape[1]
    scores = torch.log_softmax(logits[:, P - 1 : -1].double(), -1)
    return scores.gather(-1, b["responses"][..., None]).squeeze(-1) * b["response_mask"]


class SwapTo:
    """A stand-in for a rollout worker's weight refresh (partial rollouts): `model`'s weights wait
    from the start (when `waiting`), so the engine's first check pauses and loads them as version 1;
    counts the checks."""

    def __init__(self, rollout, model, waiting: bool = True):
        self.rollout, self.model, self.waiting = rollout, model, waiting
        self.version = 0
        self.num_checks = 0

    def pending(self) -> bool:
        self.num_checks += 1
        return self.waiting

    def load(self) -> int:
        self.rollout.update_weights(iter(self.model.state_dict().items()))
        self.waiting = False
        self.version = 1
        return self.version


def chat_prompts(model_path: str, questions, eos_token_id: int, pad_token_id: int, **meta):
    """A DataProto of "What is <q>?" user turns through the chat template of `model_path`'s tokenizer,
    left-padded, one uid per question; `meta` joins the ids in meta_info."""
    from verl.protocol import DataProto
    from verl.utils.tokenizer import hf_tokenizer

    tok = hf_tokenizer(model_path)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {q}?"}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    return DataProto.from_dict(
        tensors={"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(0)},
        non_tensors={"uid": [f"u{i}" for i in range(len(questions))]},
        meta_info={"eos_token_id": eos_token_id, "pad_token_id": pad_token_id, **meta},
    )


def sync_from_fsdp2(engine, trained, tmp_path) -> None:
    """Stream a real FSDP2 copy of `trained` (every layer and the root sharded, a 1-rank gloo group of
    this process) into `engine`: its state dict holds DTensors, which the engine must gather."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        sharded = copy.deepcopy(trained)
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        state = sharded.state_dict()
        assert any(hasattr(t, "full_tensor") for t in state.values())
        engine.update_weights(state.items())
    finally:
        dist.destroy_process_group()
