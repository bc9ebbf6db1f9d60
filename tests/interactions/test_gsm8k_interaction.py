"""Gsm8kInteraction against hand-worked answers (strict `#### n` format)."""

import asyncio

import pytest

from verl.interactions.gsm8k_interaction import CORRECT, INCORRECT, Gsm8kInteraction


def test_gsm8k_interaction_scores_the_last_assistant_turn():
    async def run():
        interaction = Gsm8kInteraction({"name": "gsm8k"})
        iid = await interaction.start_interaction("a", ground_truth="72")
        wrong = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "so #### 70"}]
        first = await interaction.generate_response(iid, wrong)
        right = wrong + [{"role": "user", "content": INCORRECT}, {"role": "assistant", "content": "#### 72"}]
        second = await interaction.generate_response(iid, right)
        unformatted = await interaction.generate_response(iid, [{"role": "assistant", "content": "72"}])
        await interaction.finalize_interaction(iid)
        return first, second, unformatted, interaction._instance_dict

    first, second, unformatted, left = asyncio.run(run())
    assert first == (False, INCORRECT, 0.0, {})
    assert second == (True, CORRECT, 1.0, {})
    assert unformatted[:3] == (False, INCORRECT, 0.0)  # strict: the answer must follow ####
    assert left == {}


def test_the_episode_state_is_upstreams_instance_dict_and_an_unknown_episode_cannot_be_finalized():
    async def run():
        interaction = Gsm8kInteraction({"name": "gsm8k"})
        await interaction.start_interaction("b", ground_truth="5")
        started = dict(interaction._instance_dict["b"])
        await interaction.generate_response("b", [{"role": "assistant"}])  # a turn without content scores 0
        after = dict(interaction._instance_dict["b"])
        with pytest.raises(KeyError, match="start_interaction was not called"):
            await interaction.finalize_interaction("never-started")
        return started, after

    started, after = asyncio.run(run())
    assert started == {"response": "", "ground_truth": "5", "reward": 0.0}
    assert after == {"response": None, "ground_truth": "5", "reward": 0.0}
