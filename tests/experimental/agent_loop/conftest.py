"""The real tiny model and tokenizer behind a deterministic engine for agent-loop tests.

`ForcedRollout` is a `BaseRollout` whose responses are fixed by a script (so a test knows every
token an episode must contain) while everything else is real: it receives the same DataProto
requests the agent loop's micro-batcher sends any engine, and its `rollout_log_probs` are the
bundled model's log-probs of the scripted tokens given exactly the context it was asked to continue
(teacher forcing), so they can be compared with the trainer's own log-prob pass over the finished
sequences.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import one_thread  # noqa: F401  (fixture)
from verl.workers.rollout.base import BaseRollout


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from verl.models import bundled_model_path

    return AutoTokenizer.from_pretrained(bundled_model_path())


@pytest.fixture(scope="session")
def tiny_model():
    from transformers import AutoModelForCausalLM

    from verl.models import bundled_model_path

    return AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32).eval()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return encode(tokenizer, text)


class ForcedRollout(BaseRollout):
    """Answers each request with `script(context_ids) -> response ids` (module docstring)."""

    def __init__(self, model, script, pad_token_id: int = 0, compute_logprobs: bool = True):
        self.model = model
        self.compute_logprobs = compute_logprobs
        self.script = script
        self.pad = pad_token_id
        self.contexts: list[list[int]] = []
        self.batch_sizes: list[int] = []

    @torch.no_grad()
    def generate_sequences(self, prompts):
        from tensordict import TensorDict

        from verl.protocol import DataProto

        meta = prompts.meta_info
        R = int(meta["response_length"])
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        B = ids.shape[0]
        responses = torch.full((B, R), self.pad, dtype=torch.long)
        response_mask = torch.zeros((B, R), dtype=torch.long)
        logprobs = torch.zeros((B, R), dtype=torch.float32)
        self.batch_sizes.append(B)
        for row in range(B):
            context = ids[row][mask[row]].tolist()
            self.contexts.append(context)
            forced = list(self.script(context))[:R]
            responses[row, : len(forced)] = torch.tensor(forced)
            response_mask[row, : len(forced)] = 1
            if self.compute_logprobs:
                logits = self.model(input_ids=torch.tensor([context + forced])).logits[0, len(context) - 1 : -1]
                logprobs[row, : len(forced)] = (
                    logits.float().log_softmax(-1).gather(-1, torch.tensor(forced)[:, None])[:, 0]
                )
        tensors = {"responses": responses, "response_mask": response_mask, "rollout_log_probs": logprobs}
        return DataProto(batch=TensorDict(tensors, batch_size=[B]), meta_info=dict(meta))

    def update_weights(self, named_tensors):
        return {}

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass
