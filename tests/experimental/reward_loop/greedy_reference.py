"""transformers' own greedy continuation of the bundled model: the reference the servers' answers must equal."""

from __future__ import annotations

import functools

import torch

from verl.models import bundled_model_path


@functools.cache
def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float64).eval()


def stop_ids() -> list[int]:
    from verl.utils.model import get_generation_config

    eos = get_generation_config(bundled_model_path()).eos_token_id
    return list(eos) if isinstance(eos, list | tuple) else [eos]


def hf_greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
    """Up to and including the first stop token, in float64."""
    stops = stop_ids()
    out = (
        _model()
        .generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=stops[0],
        )[0, len(prompt) :]
        .tolist()
    )
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1]
    return out
