"""The interface every rollout engine implements: the built-in `hf` engine, vLLM and SGLang.

The hybrid engine (actor and rollout on the same devices) drives it in this order each step:

    rollout.wake_up()                         # re-allocate the weight buffers freed by sleep()
    rollout.update_weights(named_tensors)     # HF-named tensors, streamed as FSDP gathers them
    out = rollout.generate_sequences(prompts) # DataProto in, DataProto out (see hf_rollout.py)
    rollout.sleep()                           # free the KV cache and the weight copy for training

`update_weights` returns metrics (`timing_s/update_weights`) for the caller to log. An engine that
owns no separate weight copy may implement sleep/wake_up as no-ops, but must keep the call order
above valid.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import RolloutConfig

if TYPE_CHECKING:
    import torch

    from verl.protocol import DataProto
    from verl.utils.speed_paths import SpeedPath


def runs_agent_loops(rollout_config) -> bool:
    """Whether generation runs through agent loops (`AgentLoopRollout`): with multi-turn, or when
    `agent.agent_loop_config_path` registers loops (upstream's agent-loop rollout runs them either
    way). The rollout worker wraps its engine, and the driver sends the rows' `agent_name` and tool
    columns, on this one answer.

    `rollout_config` is a `RolloutConfig` or a section it is built from (a DictConfig, or a dict,
    whose missing keys take the class's defaults)."""
    config = omega_conf_to_dataclass(rollout_config, RolloutConfig)
    return bool(config.multi_turn.enable or config.agent.agent_loop_config_path)


class BaseRollout(ABC):
    """A generation engine the actor worker owns.

    Two ways to implement it, both accepted:

    - this build's engines (`hf`, `vllm`, `sglang`): `generate_sequences`, `update_weights(named_tensors)`,
      `sleep()` and `wake_up()`, called in the order of the module docstring;
    - upstream's server adapters: built with `(config, model_config, device_mesh)`, with asynchronous
      `update_weights(weights, **kwargs)` (weights: a generator, or an async generator from a checkpoint
      engine), `resume(tags)` and `release()`; `sleep()` / `wake_up()` then run `release()` /
      `resume(["weights", "kv_cache"])`.
    """

    def __init__(self, config=None, model_config=None, device_mesh=None):
        from verl.workers.config import HFModelConfig

        self.config = None if config is None else omega_conf_to_dataclass(config, RolloutConfig)
        self.model_config = None if model_config is None else omega_conf_to_dataclass(model_config, HFModelConfig)
        self.device_mesh = device_mesh

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Left-padded prompts (`input_ids`, `attention_mask`, `position_ids`) in; `prompts`,
        `responses`, `input_ids`, `attention_mask`, `position_ids`, `response_mask` (and optionally
        `rollout_log_probs`) out, with `non_tensor_batch` and `meta_info` passed through."""
        raise NotImplementedError(f"{type(self).__name__} does not generate batches (generate_sequences)")

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], **kwargs) -> dict[str, float]:
        """Load HF-named parameters (any order, possibly one at a time) into the engine in place."""

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(BaseRollout, name)

    def sleep(self) -> None:
        """Free the KV cache and the engine's weight copy so training can use the memory."""
        if not self._overrides("release"):
            raise NotImplementedError(f"{type(self).__name__} implements neither sleep() nor release()")
        _run_to_completion(self.release())

    def wake_up(self) -> None:
        """Re-allocate what `sleep` freed; weights must then be synced with `update_weights`."""
        if not self._overrides("resume"):
            raise NotImplementedError(f"{type(self).__name__} implements neither wake_up() nor resume(tags)")
        _run_to_completion(self.resume(["weights", "kv_cache"]))

    def resume(self, tags: list[str] | None = None):
        """Upstream's name: bring back what `release` freed (`tags`: "weights", "kv_cache"); here a `wake_up`,
        which restores both."""
        self.wake_up()

    def release(self) -> None:
        """Free everything for good (end of training); the default is a sleep."""
        self.sleep()

    def speed_paths(self) -> list[SpeedPath]:
        """The engine's speed paths and whether each is on (see `verl.utils.speed_paths`). Engines that
        choose their own fast paths (vLLM, SGLang log theirs) report none."""
        return []


def _run_to_completion(result) -> None:
    """Run `result` if it is a coroutine (upstream's adapters' `release`/`resume` are async)."""
    if inspect.iscoroutine(result):
        from verl.utils.ray_utils import run_sync

        run_sync(result)
