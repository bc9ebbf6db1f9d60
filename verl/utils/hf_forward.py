"""What a transformers model's `forward` accepts: the one place in verl that reads its signature.

transformers 5.24 renamed the KV-cache argument of every model's `forward` from `past_key_values`
to `cache`, and the output field with it; the old name is still accepted with a deprecation warning
until its announced removal. Models loaded with `trust_remote_code` bring their own forward and
may use either name. So the name is read from the model's own forward (the class's signature,
which the deprecation wrapper preserves) rather than inferred from the installed transformers
version: that is right for remote-code models too, and for versions not yet released.

Callers pass the cache with `forward.cache_kwargs(cache)` and read it back with
`forward.returned_cache(output)`. A model whose forward takes no cache argument under either name
gets `cache_argument=None`; code that needs a cache (the actor's shared-prompt forward, the
rollout's generic decoder) then refuses or turns itself off and says why, instead of passing a
keyword the model would silently swallow into `**kwargs`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CACHE_ARGUMENT_NAMES", "ModelForward", "hf_model", "model_forward"]

# newest name first: a forward that lists both (a wrapper forwarding either) gets the new one
CACHE_ARGUMENT_NAMES = ("cache", "past_key_values")


@dataclass(frozen=True)
class ModelForward:
    """The keyword arguments a model's forward takes that differ across models and versions."""

    cache_argument: str | None
    """"cache" (transformers >= 5.24), "past_key_values" (earlier, and many remote-code models) or
    None (the forward takes no KV cache)."""
    accepts_logits_to_keep: bool
    """Whether the forward can skip the LM head on all but the last positions (`logits_to_keep`)."""

    def cache_kwargs(self, cache) -> dict[str, Any]:
        """`{name: cache}` for the model's forward."""
        if self.cache_argument is None:
            raise TypeError(
                "this model's forward takes no KV cache argument (neither `cache` nor `past_key_values`); "
                "a path that needs one cannot run with it"
            )
        return {self.cache_argument: cache}

    def returned_cache(self, output):
        """The KV cache in a forward's output (the field carries the argument's name), or None."""
        if self.cache_argument is None:
            return None
        return getattr(output, self.cache_argument, None)


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a peft wrapper (`module` itself otherwise): a peft model forwards its keyword
    arguments to the model it wraps, whose config and forward signature are the ones to ask. FSDP2
    keeps the module's class (it only adds a mixin), so an FSDP2 module needs no unwrapping."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def model_forward(module: torch.nn.Module) -> ModelForward:
    """How to call `module`'s forward (an HF causal LM, or a peft/FSDP2 wrapper of one).

    Read from the instance's bound forward each time (microseconds): a hook or patch that replaces
    the forward after the model was built is seen as it is now.
    """
    params = inspect.signature(hf_model(module).forward).parameters
    cache_argument = next((name for name in CACHE_ARGUMENT_NAMES if name in params), None)
    return ModelForward(cache_argument=cache_argument, accepts_logits_to_keep="logits_to_keep" in params)
