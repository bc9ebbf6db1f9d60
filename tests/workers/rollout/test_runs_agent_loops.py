"""`runs_agent_loops`: one answer, whatever form the rollout config comes in (the typed
`RolloutConfig`, the composed DictConfig, or a partial dict whose missing keys take the class's
defaults)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl.trainer.config.loader import compose
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import AgentLoopConfig, MultiTurnConfig, RolloutConfig
from verl.workers.rollout.base import runs_agent_loops


def test_the_default_rollout_runs_no_agent_loops_in_any_form():
    section = compose("arith_demo").actor_rollout_ref.rollout
    assert not runs_agent_loops(section)
    assert not runs_agent_loops(omega_conf_to_dataclass(section))
    assert not runs_agent_loops(RolloutConfig())
    assert not runs_agent_loops({})


@pytest.mark.parametrize(
    "typed, partial",
    [
        (RolloutConfig(multi_turn=MultiTurnConfig(enable=True)), {"multi_turn": {"enable": True}}),
        (
            RolloutConfig(agent=AgentLoopConfig(agent_loop_config_path="agents.yaml")),
            {"agent": {"agent_loop_config_path": "agents.yaml"}},
        ),
    ],
)
def test_multi_turn_or_an_agent_loop_file_runs_agent_loops(typed, partial):
    assert runs_agent_loops(typed)
    assert runs_agent_loops(partial)
    assert runs_agent_loops(OmegaConf.create(partial))


def test_a_misspelled_key_is_an_error_not_a_silent_no():
    with pytest.raises(ValueError, match=r"multi_turn: unknown key\(s\) 'enabled'.*enable"):
        runs_agent_loops({"multi_turn": {"enabled": True}})
