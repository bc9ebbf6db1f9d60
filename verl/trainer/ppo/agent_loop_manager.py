"""Upstream's `AgentLoopManager`: the driver's handle on generation, for trainers that build it themselves.

Upstream's `RayPPOTrainer.init_workers` ends with
`self.async_rollout_manager = AgentLoopManager(config=..., worker_group=self.actor_rollout_wg, ...)`, and
trainers written against it (verl-recipe's, users' own `init_workers`) do the same, then call
`async_rollout_manager.generate_sequences(prompts)`. Here the hybrid actor-rollout worker group generates
itself (its workers run the agent loops when `rollout.multi_turn.enable`, synced with the actor's weights
at each call), so the manager sends the prompt rows to that group: `generate_sequences` returns one sample
row per prompt row (prompt plus response, as the trainer's own generation) with `meta_info["timing"]`
(seconds of the call and of the rollout's phases). The prompts' meta_info (`do_sample`, `validate`,
`global_steps`, ...) reaches the rollout.

Differs from upstream's, and why:
- No separate rollout servers: `worker_group=None` (upstream's standalone mode) is refused; so are a reward
  model handed to the manager (`rm_wg`, `rm_resource_pool`: the trainer's reward step scores the samples)
  and `rollout_replicas` / `server_handles` (the engines are the group's, their weights synced at each
  generation, so there is nothing to hand a checkpoint engine).
- `start_profile` / `stop_profile` profile the worker group's processes, where generation runs.
"""

from __future__ import annotations

import time

from verl.protocol import DataProto
from verl.trainer.ppo.generation import generation_input
from verl.trainer.ppo.rollout_source import check_no_vision_tokens, meta_metrics, vision_placeholder_ids

__all__ = ["AgentLoopManager", "generate_with_group"]


def generate_with_group(
    worker_group, prompts: DataProto, tokenizer, processor, global_steps: int, multi_turn: bool
) -> DataProto:
    """The group's samples for `prompts` (one per row), with `meta_info["timing"]`. The prompts' own
    `meta_info["global_steps"]` (upstream's trainer stamps it) wins over `global_steps`."""
    meta = dict(prompts.meta_info)
    global_steps = int(meta.pop("global_steps", global_steps) or 0)
    gen = generation_input(prompts, tokenizer, global_steps, multi_turn, **meta)
    start = time.perf_counter()
    output = worker_group.generate_sequences(gen)
    seconds = time.perf_counter() - start
    check_no_vision_tokens(output, vision_placeholder_ids(processor), global_steps)
    timing = {"generate_sequences": seconds}
    timing.update({k.removeprefix("timing_s/"): v for k, v in meta_metrics(output).items() if "timing_s/" in k})
    output.meta_info["timing"] = timing
    return output


class AgentLoopManager:
    """Upstream's constructor and `generate_sequences` over a hybrid actor-rollout worker group (see the
    module docstring). `rollout_resource_pool` is the group's own pool when given (upstream uses it only
    for standalone and TensorRT-LLM servers)."""

    def __init__(self, config, worker_group=None, rollout_resource_pool=None, rm_resource_pool=None, rm_wg=None):
        if worker_group is None:
            raise NotImplementedError(
                "AgentLoopManager(worker_group=None) is upstream's standalone mode (rollout servers in their own "
                "pool); here generation runs in the actor-rollout worker group: pass worker_group="
                "trainer.actor_rollout_wg (asynchronous training's separate rollout pool is "
                "async_training.staleness_threshold > 0)"
            )
        if rm_wg is not None or rm_resource_pool is not None:
            raise NotImplementedError(
                "AgentLoopManager(rm_wg=..., rm_resource_pool=...): here the samples are scored by the trainer's "
                "reward step (compute_reward, with the reward model's worker group when reward_model.enable), not "
                "inside the rollout; pass neither"
            )
        model = config.actor_rollout_ref.model
        from verl.utils.tokenizer import hf_processor, hf_tokenizer

        trust = bool(model.get("trust_remote_code", False))
        tokenizer = hf_tokenizer(model.get("tokenizer_path") or model.path, trust_remote_code=trust)
        self._bind(config, worker_group, tokenizer, hf_processor(model.path, trust_remote_code=trust))
        self.rollout_resource_pool = rollout_resource_pool

    def _bind(self, config, worker_group, tokenizer, processor, trainer=None) -> None:
        self.config = config
        self.worker_group = worker_group
        self.rollout_resource_pool = None
        self.reward_model_manager = None  # upstream's attribute: no reward model runs inside the rollout here
        self.tokenizer, self.processor = tokenizer, processor
        self._trainer = trainer

    @classmethod
    def of_trainer(cls, trainer) -> AgentLoopManager:
        """The manager of a trainer that built its own worker groups (`trainer.async_rollout_manager` when
        its `init_workers` assigned none): the trainer's actor-rollout group, tokenizer and processor, and
        its current step stamping the samples."""
        manager = cls.__new__(cls)  # upstream's constructor loads the tokenizer the trainer already has
        manager._bind(trainer.config, trainer.actor_rollout_wg, trainer.tokenizer, trainer.processor, trainer)
        return manager

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One sample row per prompt row (repeat the prompts `rollout.n` times first, as upstream's driver
        does), `meta_info["timing"]` with the call's seconds; `prompts.meta_info["global_steps"]` (upstream's
        trainer sets it), else the trainer's step, stamps the samples."""
        multi_turn = bool(self.config.actor_rollout_ref.rollout.multi_turn.enable)
        step = self._trainer.global_steps if self._trainer is not None else 0
        return generate_with_group(self.worker_group, prompts, self.tokenizer, self.processor, step, multi_turn)

    def start_profile(self, **kwargs) -> None:
        """Start the profiler on the worker group's processes (where generation runs)."""
        if hasattr(self.worker_group, "start_profile"):
            self.worker_group.start_profile(**kwargs)

    def stop_profile(self) -> None:
        if hasattr(self.worker_group, "stop_profile"):
            self.worker_group.stop_profile()

    @property
    def rollout_replicas(self):
        raise AttributeError(
            "AgentLoopManager.rollout_replicas: there are no separate rollout servers here; the actor-rollout "
            "worker group generates, its engines synced with the actor's weights at each generate_sequences call"
        )

    server_handles = rollout_replicas
