"""The vLLM rollout (`actor_rollout_ref.rollout.name=vllm`), laid out as upstream's package.

- `vllm_rollout`: `vLLMRollout`, vLLM's offline engine in the actor worker's process, and the
  helpers that turn a rollout config into engine and sampling arguments.
- `utils`: `build_cli_args_from_config`, engine arguments as `vllm serve` command-line flags.

Importing the package does not import vLLM (upstream's refuses to import without it): the engine
is imported when a `vLLMRollout` is built, so the config helpers and their tests run without it.
"""

from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config
from verl.workers.rollout.vllm_rollout.vllm_rollout import (
    check_vision_language_support,
    parse_vllm_output,
    vllm_engine_kwargs,
    vllm_request,
    vllm_sampling_kwargs,
    vLLMRollout,
)

__all__ = [
    "build_cli_args_from_config",
    "check_vision_language_support",
    "parse_vllm_output",
    "vLLMRollout",
    "vllm_engine_kwargs",
    "vllm_request",
    "vllm_sampling_kwargs",
]
