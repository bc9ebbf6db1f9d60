"""Gsm8kInteraction against hand-worked answers (strict `#### n` format)."""

import asyncio

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
        return first, second, unformatted, interaction._episodes

    first, second, unformatted, left = asyncio.run(run())
    assert first == (False, INCORRECT, 0.0, {})
    assert second == (True, CORRECT, 1.0, {})
    assert unformatted[:3] == (False, INCORRECT, 0.0)  # strict: the answer must follow ####
    assert left == {}
