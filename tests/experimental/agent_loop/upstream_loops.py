"""Agent loops written against upstream's API, importable by worker processes (a config file's
`_target_` names them): used by the rollout tests and the end-to-end `main_ppo` run."""

from __future__ import annotations

from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop


class ScoresItsOwnEpisodes(AgentLoopBase):
    """One model turn; reads what upstream loops read from `self.config` and the row, and scores the
    episode itself (`score`, a config-file argument), so no reward function runs."""

    def __init__(self, *args, score: float = 0.25, **kwargs):
        super().__init__(*args, **kwargs)
        self.score = score

    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(kwargs["raw_prompt"])
        out = await self.server_manager.generate(uuid4().hex, prompt_ids=prompt_ids, sampling_params=sampling_params)
        response = out.token_ids[: self.config.actor_rollout_ref.rollout.response_length]
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response,
            response_mask=[1] * len(response),
            reward_score=self.score,
            num_turns=2,
            extra_fields={"model": self.config.actor_rollout_ref.model.path, "source": kwargs["data_source"]},
        )


class ScoresEachTurn(ToolAgentLoop):
    """Upstream's `ToolAgentLoop.run` with one handler overridden, as recipes subclass it: each model
    turn gets a turn score of `turn_score` (a config-file argument), which a reward manager can read
    from the `turn_scores` column."""

    def __init__(self, *args, turn_score: float = 0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.turn_score = turn_score

    async def _handle_generating_state(self, agent_data, sampling_params, ignore_termination=False):
        state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        agent_data.turn_scores.append(self.turn_score)
        return state
