"""How a role worker's rollout engine gets wrapped in agent loops, without the workers importing them.

When the rollout config runs agent loops (`runs_agent_loops`: multi-turn, or loops registered from
`agent.agent_loop_config_path`), the worker hands its engine to a wrapper that plays the loops over
it (the agent loop's `AgentLoopRollout`). The agent loop sits above the workers
(`verl.experimental`, tests/test_layers.py), so the worker does not name it: whoever builds the
worker passes the wrapper in (`ActorRolloutRefWorker(..., rollout_wrapper=...)`); the trainer
passes `AgentLoopRollout` (verl/trainer/ppo/worker_groups.py).

Why an argument and not a registry that `verl.experimental` fills on import: a registry lives in
one process, and the worker runs in a Ray actor that never imports the trainer's modules, so the
registration would have to be repeated in every worker process by some other means. A class given
to the worker's constructor travels with it: Ray pickles it by reference, and unpickling it in the
worker imports its module there.

A worker whose config runs agent loops but that was given no wrapper fails when it builds its
rollout, saying what to pass: generating single turns instead would silently ignore the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from verl.workers.rollout.base import runs_agent_loops

if TYPE_CHECKING:
    from verl.workers.rollout.base import BaseRollout

__all__ = ["RolloutWrapper", "wrap_rollout"]


class RolloutWrapper(Protocol):
    """Builds the rollout that runs agent loops over `rollout` (`AgentLoopRollout` is one)."""

    def __call__(
        self,
        rollout: BaseRollout,
        config,
        tokenizer,
        *,
        project_name: str | None = None,
        experiment_name: str | None = None,
        trainer_config=None,
    ) -> BaseRollout: ...


def wrap_rollout(
    rollout: BaseRollout,
    config,
    tokenizer,
    wrapper: RolloutWrapper | None,
    project_name: str | None = None,
    experiment_name: str | None = None,
    trainer_config=None,
) -> BaseRollout:
    """`rollout` itself, or `wrapper(rollout, ...)` when `config` (the rollout section) runs agent
    loops; `project_name`/`experiment_name` name the agent loops' traces (`rollout.trace`);
    `trainer_config` is what loops written against upstream's API see as `self.config`."""
    if not runs_agent_loops(config):
        return rollout
    if wrapper is None:
        raise ValueError(
            "actor_rollout_ref.rollout runs agent loops (multi_turn.enable=true or agent.agent_loop_config_path is "
            "set), but this worker was built without a rollout_wrapper to run them. The trainer passes one; a worker "
            "built by hand needs ActorRolloutRefWorker(..., rollout_wrapper=AgentLoopRollout) (from "
            "verl.experimental.agent_loop), or turn multi_turn off and unset agent.agent_loop_config_path"
        )
    return wrapper(
        rollout,
        config,
        tokenizer,
        project_name=project_name,
        experiment_name=experiment_name,
        trainer_config=trainer_config,
    )
