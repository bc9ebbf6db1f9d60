"""`model_forward`: how to pass a KV cache to the installed transformers' models, and to other forwards.

The expected argument name for the installed transformers is taken from its version (the rename
landed in 5.24), independently of the signature reading under test; the behaviour test then
checks that the cache passed under that name is the one the model fills and returns.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

from tests.distributed_helpers import make_tiny_causal_lm
from verl.utils.hf_forward import model_forward

INSTALLED_USES_CACHE = Version(transformers.__version__).release >= (5, 24)


def test_the_installed_transformers_models_take_the_cache_under_their_versions_name():
    forward = model_forward(make_tiny_causal_lm())
    assert forward.cache_argument == ("cache" if INSTALLED_USES_CACHE else "past_key_values"), transformers.__version__
    assert forward.accepts_logits_to_keep


def test_the_cache_passed_under_the_detected_name_is_filled_and_returned():
    model = make_tiny_causal_lm().eval()
    forward = model_forward(model)
    cache = DynamicCache()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **forward.cache_kwargs(cache))
        assert forward.returned_cache(out) is cache
        assert cache.get_seq_length() == 4
        # decoding one more token on the cache equals the full forward's last position
        step = model(input_ids=torch.tensor([[9]]), use_cache=True, **forward.cache_kwargs(cache))
        full = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), use_cache=False)
    torch.testing.assert_close(step.logits[0, -1], full.logits[0, -1], atol=1e-12, rtol=0)


def test_a_peft_wrapped_model_is_read_through_to_its_base_model():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(make_tiny_causal_lm(), LoraConfig(r=2, target_modules=["q_proj"]))
    assert model_forward(peft_model) == model_forward(make_tiny_causal_lm())


class _OldStyleModel(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False):
        return input_ids


class _NoCacheModel(torch.nn.Module):
    def forward(self, input_ids, **kwargs):
        return input_ids


def test_a_remote_code_style_forward_keeps_its_own_name_and_a_forward_without_one_gets_none():
    old = model_forward(_OldStyleModel())
    assert old.cache_argument == "past_key_values" and not old.accepts_logits_to_keep
    assert old.cache_kwargs("c") == {"past_key_values": "c"}
    none = model_forward(_NoCacheModel())
    assert none.cache_argument is None
    with pytest.raises(TypeError, match="takes no KV cache argument"):
        none.cache_kwargs(DynamicCache())
